"""tfpipe's version: a leaf module, so a writer can record it without importing the package's face.

One story across the package, the docs and the CHANGELOG: 1.0.0 was released on 2026-11-24; what was added since
is tfpipe 1.1 (the CHANGELOG's ``[Unreleased]``, the docs' "tfpipe 1.1"), and until it is released the package
says ``1.1.0.dev0`` (PEP 440: before 1.1.0). The old spellings renamed in 1.0 are removed in the 1.1.0 release
(``tfpipe.deprecations.REMOVED_IN``).
"""

__version__ = "1.1.0.dev0"
