"""The resolution of a config for a launch: `resolve()` and the `ResolvedConfig` it returns."""

from zerofit.resolution.pipeline import ResolvedConfig, resolve

__all__ = ["ResolvedConfig", "resolve"]
