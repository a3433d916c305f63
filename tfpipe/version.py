"""tfpipe's version: a leaf module, so a writer can record it without importing the package's face.

CHANGELOG.md says what each release changes; between releases the version is the next one's development release
(``2.1.0.dev0``, which PEP 440 orders before 2.1.0).
"""

__version__ = "2.0.1.dev0"
