"""tfpipe's version: a leaf module, so a writer can record it without importing the package's face.

``2.0.0.dev0`` is a development release of 2.0.0 (PEP 440 orders it before 2.0.0); CHANGELOG.md says what each
release changes.
"""

__version__ = "2.0.0.dev0"
