"""Metrics: a small logger protocol with sinks (metrics.jsonl always; W&B and console optional).

Entry points for the training loop: `open_sinks` (zerofit.metrics.setup), `memory_snapshot` and
`per_rank_fields` (zerofit.metrics.memory), `throughput_fields` / `mfu` (zerofit.metrics.throughput).
Heavy modules (wandb, rich) are imported only where used.
"""

from zerofit.metrics.base import JsonlSink, MetricsSink, MultiSink, NullSink

__all__ = ["JsonlSink", "MetricsSink", "MultiSink", "NullSink"]
