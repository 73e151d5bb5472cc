"""Metrics: a small logger protocol with sinks (metrics.jsonl always; W&B and console optional)."""

from zerofit.metrics.base import JsonlSink, MetricsSink, MultiSink, NullSink

__all__ = ["JsonlSink", "MetricsSink", "MultiSink", "NullSink"]
