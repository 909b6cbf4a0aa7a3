"""The package's version, in a module of its own that imports nothing: setup reads it, the CLI
prints it (``commpatch --version``) and ``commpatch.__version__`` re-exports it."""

__version__ = "0.1.0"
