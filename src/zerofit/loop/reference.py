"""DPO's precomputed reference (`preference.reference: precomputed`): one pass before training, cached.

    precompute_reference: every training and evaluation pair -> the cache ($ZEROFIT_CACHE/reference/
                          <key>.safetensors) or, on a miss, one no-grad pass of the model as loaded (before
                          any checkpoint is restored, so a resumed run scores the same base): rank r takes
                          pairs r, r + dp, ... in micro-batches of micro_batch_size pairs, every rank runs
                          the same number of forwards (an empty one is the dummy row: ZeRO-3 / FSDP2 gather
                          collectives stay matched) -> one all-reduce of the [pairs, 2] fp64 table (each
                          rank fills its rows) -> `PreferencePair.reference` of every pair; rank 0 writes
                          the cache.

The key is the tokenized pairs themselves (a hash of every pair's token ids and labels, in order: it
changes exactly when the tokenization cache's key or the held-out split does), the model's identity (its
name_or_path, a hash of its weight files: for tiny-llama the files its seed built) and what changes its
numbers (precision, quantization, attention implementation). The table is safetensors (never pickle) with
a SHA-256 of its bytes in the metadata; a hit (a file that reads, has the pairs' shape, finite values and
the digest it claims) skips the pass, and the plan says which happened. A file that fails a check is
never used: a one-line note names it and the check, the pass runs and its table replaces the file.
Training never holds a reference model: the loop reads `reference_logps` from the batch
(`zerofit.data.pairs.collate_pairs`).
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerofit.catalogue.models import TINY_LLAMA
from zerofit.config.schema import ZerofitConfig
from zerofit.core.digest import files_sha256
from zerofit.core.file_modes import follow_umask
from zerofit.core.progress import progress
from zerofit.data.cache import cache_key
from zerofit.data.pairs import PreferencePair, collate_pairs
from zerofit.models.build import resolve_model_path
from zerofit.models.tiny import cache_dir
from zerofit.objectives.fused_loss import FUSED_LINEAR, forward_token_losses
from zerofit.objectives.preference import row_logps
from zerofit.strategies.base import Strategy

__all__ = ["ReferencePass", "precompute_reference", "reference_key"]

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".json")
_TABLE = "reference_logps"  # the cache file's one tensor: [pairs, 2] fp64, (chosen, rejected) per pair
_DIGEST_KEY = "sha256"  # its metadata's content digest (`_table_digest`), checked before the table is used


@dataclass(frozen=True)
class ReferencePass:
    """What the reference pass did: how many pairs, whether the cache answered, and where it is."""

    pairs: int
    cached: bool
    path: Path | None  # None: not cached (data.cache false, or weights that are not local files)
    uncached_because: str = ""

    def describe(self) -> str:
        """The plan's line for it."""
        where = f" ({self.path})" if self.path is not None else f" (not cached: {self.uncached_because})"
        how = "read from the cache, no pass" if self.cached else "computed in one pass before training"
        return f"reference log-probs of {self.pairs:,} pairs {how}{where}"


def _weights_digest(cfg: ZerofitConfig) -> str | None:
    """A hash of the model's weight and config files (None when they are not local files)."""
    path = Path(resolve_model_path(cfg))
    if not path.is_dir():
        try:
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(cfg.model.name_or_path, local_files_only=True))
        except Exception:  # not in the local hub cache either: no identity, so no cache entry
            return None
    files = sorted(p for p in path.iterdir() if p.is_file() and p.name.endswith(_WEIGHT_SUFFIXES))
    return files_sha256(files) if files else None


def _pairs_digest(pairs: list[PreferencePair]) -> str:
    """A hash of every pair's token ids and labels, in order."""
    digest = hashlib.sha256()
    for pair in pairs:
        for example in (pair.chosen, pair.rejected):
            digest.update(torch.tensor(example.input_ids, dtype=torch.int64).numpy().tobytes())
            digest.update(torch.tensor(example.labels, dtype=torch.int64).numpy().tobytes())
            digest.update(b"|")
    return digest.hexdigest()


def reference_key(cfg: ZerofitConfig, pairs: list[PreferencePair]) -> str | None:
    """The cache entry's name for these pairs scored by this config's model (None: not cacheable)."""
    weights = _weights_digest(cfg)
    if weights is None:
        return None
    return cache_key(
        kind="reference",
        pairs=_pairs_digest(pairs),
        model=cfg.model.name_or_path,
        weights=weights,
        seed=cfg.seed if cfg.model.name_or_path == TINY_LLAMA else None,
        precision=cfg.train.precision,
        load_in=cfg.quantization.load_in,
        attn=cfg.model.attn_implementation,
    )


def _table_digest(table: torch.Tensor) -> str:
    """SHA-256 of the table's bytes (fp64, row-major): what a cache file's metadata claims it holds."""
    return hashlib.sha256(table.contiguous().numpy().tobytes()).hexdigest()


def _read(path: Path, n: int) -> tuple[torch.Tensor | None, str]:
    """The cached [n, 2] table, or (None, what is wrong with the file: "" when there is none).

    A file is used only when it is what was written for these pairs: readable safetensors holding an fp64
    [n, 2] table of finite values whose bytes match the digest in its metadata (an edited table would
    silently move every DPO loss off ln 2 at step 1)."""
    if not path.is_file():
        return None, ""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            claimed = (f.metadata() or {}).get(_DIGEST_KEY)
            table = f.get_tensor(_TABLE) if _TABLE in list(f.keys()) else None
    except Exception as exc:  # safetensors raises its own error types for a damaged file
        return None, f"could not be read ({type(exc).__name__}: {exc})"
    if table is None or table.dtype != torch.float64 or tuple(table.shape) != (n, 2):
        what = "no table" if table is None else f"a {table.dtype} table of shape {tuple(table.shape)}"
        return None, f"holds {what}, not the float64 ({n}, 2) table of these pairs"
    if claimed is None:
        return None, "has no content digest in its metadata (written by an older zerofit)"
    if _table_digest(table) != claimed:
        return None, "does not match the content digest in its metadata (edited or corrupted since written)"
    if not bool(torch.isfinite(table).all()):
        return None, "holds values that are not finite"
    return table, ""


def _write(path: Path, table: torch.Tensor) -> None:
    """Written with its digest to a temporary file, renamed into place: a reader never sees half a table."""
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    table = table.to(torch.float64).contiguous()
    save_file({_TABLE: table}, tmp, metadata={_DIGEST_KEY: _table_digest(table)})
    follow_umask(tmp)  # mkstemp's (and safetensors') 0600: the run's other files follow the umask
    os.replace(tmp, path)


def _cached_table(path: Path | None, n: int) -> torch.Tensor | None:
    """The sound cached table at `path` (rank 0), or None; a file that fails a check gets a one-line note
    and is recomputed and replaced (`precompute_reference`)."""
    if path is None:
        return None
    table, problem = _read(path, n)
    if problem:
        print(
            f"zerofit: reference log-prob cache file {path} {problem}: computing the reference again, "
            "replacing it",
            file=sys.stderr,
            flush=True,
        )
    return table


def _score(
    strategy: Strategy,
    model: torch.nn.Module,
    pairs: list[PreferencePair],
    micro: int,
    pad_id: int,
    impl: str,
) -> torch.Tensor:
    """This rank's share of the [pairs, 2] table (zeros elsewhere), by no-grad forwards of the model."""
    dp, rank = strategy.world_size, strategy.rank
    mine = list(range(rank, len(pairs), dp))
    most = math.ceil(len(pairs) / dp)  # rank 0's share, the largest: every rank runs as many forwards
    forwards = math.ceil(most / micro)
    table = torch.zeros(len(pairs), 2, dtype=torch.float64, device=strategy.device)
    impl = FUSED_LINEAR if impl == FUSED_LINEAR else "chunked"
    was_training = model.training
    model.eval()
    shown = progress(f"reference log-probs of {len(pairs):,} pairs", forwards, "forwards", enabled=rank == 0)
    try:
        with torch.no_grad(), shown as state:
            for k in range(forwards):
                state.update(k)
                idx = mine[k * micro : (k + 1) * micro]
                batch = collate_pairs([pairs[i] for i in idx], pad_id)
                with strategy.accumulate(is_last=True):
                    inputs = {key: batch[key].to(strategy.device) for key in ("input_ids", "attention_mask")}
                    logps = row_logps(
                        forward_token_losses(model, inputs, batch["labels"], impl), batch["labels"]
                    )[0]
                if idx:
                    m = len(idx)
                    table[idx] = torch.stack([logps[:m], logps[m:]], dim=1).double()
    finally:
        model.train(was_training)
    return table


def precompute_reference(
    cfg: ZerofitConfig,
    strategy: Strategy,
    model: torch.nn.Module,
    pairs: list[PreferencePair],
    micro_batch_size: int,
    pad_id: int,
) -> ReferencePass:
    """Attach the reference log-probs to every pair of `pairs` (collective; module docstring)."""
    key = reference_key(cfg, pairs) if cfg.data.cache else None
    path = cache_dir() / "reference" / f"{key}.safetensors" if key is not None else None
    because = "data.cache is false" if not cfg.data.cache else "the model's weights are not local files"
    found = _cached_table(path, len(pairs)) if strategy.rank == 0 else None
    cached = bool(strategy.broadcast_object(found is not None))  # rank 0's: every rank runs the pass or none
    if found is not None:
        local: torch.Tensor = found.to(strategy.device, torch.float64)
    elif cached:
        local = torch.zeros(len(pairs), 2, dtype=torch.float64, device=strategy.device)
    else:
        local = _score(strategy, model, pairs, micro_batch_size, pad_id, cfg.train.cross_entropy)
    table = strategy.all_reduce_sum(local).cpu()
    if not cached and path is not None and strategy.rank == 0 and _read(path, len(pairs))[0] is None:
        _write(path, table)  # the first sound table for these pairs wins: later runs all read the same one
    values: list[Any] = table.tolist()
    for pair, (chosen, rejected) in zip(pairs, values, strict=True):
        pair.reference = (chosen, rejected)
    return ReferencePass(len(pairs), cached, path, "" if path is not None else because)
