"""tfpipe's version: a leaf module, so a writer can record it without importing the package's face."""

__version__ = "1.0.0"
