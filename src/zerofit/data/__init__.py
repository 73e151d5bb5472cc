"""Training data: sources (`records.py`), formats (`formats.py`), chat templates (`chat.py`), tokenizing
(`tokenize.py`, `sft.py`, cached by `cache.py`), held-out evaluation splits (`holdout.py`), global batches
(`batches.py`: order, split, collate) and token-budget micro-batches (`packing.py`: pack whole examples
into rows)."""

from zerofit.data.batches import GlobalBatchSampler, collate, model_inputs, split_global_batch
from zerofit.data.chat import set_chat_template
from zerofit.data.formats import FORMATS
from zerofit.data.holdout import hold_out
from zerofit.data.packing import collate_packed, packed_micro_batches
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
    "collate_packed",
    "hold_out",
    "load_examples",
    "load_sft_dataset",
    "model_inputs",
    "packed_micro_batches",
    "set_chat_template",
    "split_global_batch",
    "tokenize_example",
]
