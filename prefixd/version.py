"""prefixd's version: the one source (the package re-exports it, the build reads it here)."""

__version__ = "0.1.0"
