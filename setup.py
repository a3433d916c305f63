"""For tools that still run ``setup.py`` (Apache Beam's ``--setup_file`` on Dataflow workers): every setting is in
pyproject.toml, which setuptools reads from here too."""

from setuptools import setup

setup()
