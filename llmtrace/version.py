"""The package version, at the bottom so that any layer (the trace's run event) can name it."""

__version__ = "0.1.0"
