"""Run configuration: the typed schema, YAML + dotted overrides, and the rules by area (`rules/`) that the
resolution (`zerofit.resolution.resolve`) checks a whole config with."""

from zerofit.config.loader import load_config, parse_overrides
from zerofit.config.schema import ZerofitConfig

__all__ = ["ZerofitConfig", "load_config", "parse_overrides"]
