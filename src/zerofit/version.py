"""zerofit's version, at the ground floor: checkpoint manifests record it, and `zerofit.__version__` is it."""

__version__ = "0.1.0"
