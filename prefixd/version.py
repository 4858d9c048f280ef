"""The one version source: the package metadata (pyproject.toml) and every module that reports it
read it here, below every layer."""

__version__ = "0.1.0"
