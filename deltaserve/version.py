"""The package version, in a module of its own so that any layer can report it without importing the facade."""

__version__ = "0.1.0"
