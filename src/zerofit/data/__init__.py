"""Training data: sources (`records.py`), formats (`formats.py`), chat templates (`chat.py`), tokenizing
(`tokenize.py`, `sft.py`, cached by `cache.py`), held-out evaluation splits (`holdout.py`) and global
batches (`batches.py`: order, split, collate)."""

from zerofit.data.batches import GlobalBatchSampler, collate, split_global_batch
from zerofit.data.chat import set_chat_template
from zerofit.data.formats import FORMATS
from zerofit.data.holdout import hold_out
from zerofit.data.sft import (
    DataStats,
    Example,
    TokenizedData,
    load_examples,
    load_sft_dataset,
    tokenize_example,
)
from zerofit.loss import IGNORE_INDEX

__all__ = [
    "FORMATS",
    "IGNORE_INDEX",
    "DataStats",
    "Example",
    "GlobalBatchSampler",
    "TokenizedData",
    "collate",
    "hold_out",
    "load_examples",
    "load_sft_dataset",
    "set_chat_template",
    "split_global_batch",
    "tokenize_example",
]
