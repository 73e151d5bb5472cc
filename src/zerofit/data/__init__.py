"""Training data: records (`sft.py`: read, tokenize, mask), global batches (`batches.py`: order, split,
collate) and token-budget micro-batches (`packing.py`: pack whole examples into rows)."""

from zerofit.data.batches import GlobalBatchSampler, collate, model_inputs, split_global_batch
from zerofit.data.packing import collate_packed, packed_micro_batches
from zerofit.data.sft import DataStats, Example, load_sft_dataset, tokenize_example
from zerofit.loss import IGNORE_INDEX

__all__ = [
    "IGNORE_INDEX",
    "DataStats",
    "Example",
    "GlobalBatchSampler",
    "collate",
    "collate_packed",
    "load_sft_dataset",
    "model_inputs",
    "packed_micro_batches",
    "split_global_batch",
    "tokenize_example",
]
