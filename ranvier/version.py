"""ranvier's version: one place for the package metadata, the CLI and the compile cache key."""

__version__ = "0.1.0"
