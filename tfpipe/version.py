"""tfpipe's version: a leaf module, so a writer can record it without importing the package's face.

2.0 removed the spellings 1.x deprecated and laid ``tfpipe/`` out in sub-packages (the CHANGELOG's migration
table); until 2.0.0 is released the package says ``2.0.0.dev0`` (PEP 440: before 2.0.0).
"""

__version__ = "2.0.0.dev0"
