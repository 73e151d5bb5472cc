"""Run configuration: typed schema, YAML + dotted overrides, and `resolve()`."""

from zerofit.config.loader import load_config, parse_overrides
from zerofit.config.resolve import ResolvedConfig, resolve
from zerofit.config.schema import ZerofitConfig

__all__ = ["ResolvedConfig", "ZerofitConfig", "load_config", "parse_overrides", "resolve"]
