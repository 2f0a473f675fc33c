"""cadence's version, written once (``cadence.__version__`` re-exports it).

A module of its own, with a literal, so that ``pyproject.toml`` reads it without
importing cadence, and so that the precompile cache key (a field of which it is) reads
it without importing the ``cadence`` package that lazily serves ``cadence.precompile``.
"""

__version__ = "0.1.0"
