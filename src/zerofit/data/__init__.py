"""Training data: records (`sft.py`: read, tokenize, mask) and global batches (`batches.py`: order, split,
collate)."""

from zerofit.data.batches import GlobalBatchSampler, collate, split_global_batch
from zerofit.data.sft import DataStats, Example, load_sft_dataset, tokenize_example
from zerofit.loss import IGNORE_INDEX

__all__ = [
    "IGNORE_INDEX",
    "DataStats",
    "Example",
    "GlobalBatchSampler",
    "collate",
    "load_sft_dataset",
    "split_global_batch",
    "tokenize_example",
]
