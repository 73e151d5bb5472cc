"""Training data: sources (`records.py`), formats (`formats.py`), chat templates (`chat.py`), tokenizing
(`tokenize.py`, `sft.py`, cached by `cache.py`), held-out evaluation splits (`holdout.py`), global batches
(`batches.py`: order, split, collate) and token-budget micro-batches (`packing.py`: pack whole examples
into rows); preference pairs (`preference.py` reads them, `pairs.py` collates them)."""

from zerofit.data.batches import GlobalBatchSampler, collate, model_inputs, split_global_batch
from zerofit.data.chat import set_chat_template
from zerofit.data.formats import FORMATS
from zerofit.data.holdout import eval_source, hold_out
from zerofit.data.packing import collate_packed, packed_micro_batches
from zerofit.data.pairs import PreferencePair, collate_pairs
from zerofit.data.preference import load_preference_pairs
from zerofit.data.sft import (
    DataStats,
    Example,
    TokenizedData,
    load_examples,
    load_sft_dataset,
    tokenize_example,
)
from zerofit.token_loss.sums import IGNORE_INDEX

__all__ = [
    "FORMATS",
    "IGNORE_INDEX",
    "DataStats",
    "Example",
    "GlobalBatchSampler",
    "PreferencePair",
    "TokenizedData",
    "collate",
    "collate_packed",
    "collate_pairs",
    "eval_source",
    "hold_out",
    "load_examples",
    "load_preference_pairs",
    "load_sft_dataset",
    "model_inputs",
    "packed_micro_batches",
    "set_chat_template",
    "split_global_batch",
    "tokenize_example",
]
