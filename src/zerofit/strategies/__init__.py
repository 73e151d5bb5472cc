"""One Strategy per engine; the only package that imports torch.distributed."""

from zerofit.strategies.base import Strategy

__all__ = ["Strategy"]
