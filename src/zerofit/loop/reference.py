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

A digest proves only that nothing changed the file by accident (whoever writes the table can write its
digest), so a hit is also checked against its source, the model: `_source_problem` recomputes a seeded
sample of rows (`zerofit.data.cache_check.sample_indices`: 8 pairs, the first and the last among them) with
the model as the pass would, every rank its share and the same rows on every rank, and compares them with
the file's within `_TOLERANCE` (by precision: what rounding alone can move). Rank 0's verdict is every
rank's; on a mismatch a one-line note (`mismatch_note`) names the file, the full pass runs and replaces it.
The sample's forwards are no-grad, in eval mode, and draw no random numbers: a genuine hit trains exactly
as the pass that wrote it.
Under a token budget (`batch.tokens_per_micro_batch`) the pass packs its pairs as training does (windows of
pairs, each sequence a segment of the run's rows, `zerofit.data.pairs.collate_packed_pairs`): the same
log-probs up to rounding, in fewer forwards. Training never holds a reference model: the loop reads
`reference_logps` from the batch (`zerofit.data.pairs`).
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from zerofit.catalogue.models import TINY_LLAMA
from zerofit.config.schema import ZerofitConfig
from zerofit.core.digest import files_sha256
from zerofit.core.file_modes import follow_umask
from zerofit.core.progress import progress
from zerofit.data.batches import model_inputs
from zerofit.data.cache import cache_key
from zerofit.data.cache_check import mismatch_note, sample_indices
from zerofit.data.packing import packed_unit_micro_batches, units_of
from zerofit.data.pairs import PreferencePair, collate_packed_pairs, collate_pairs
from zerofit.models.build import resolve_model_path
from zerofit.models.tiny import cache_dir
from zerofit.objectives.logps import sequence_logps
from zerofit.strategies.base import Strategy
from zerofit.token_loss.fused import FUSED_LINEAR, forward_token_losses

__all__ = ["ReferencePass", "precompute_reference", "reference_key"]

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".json")
_TABLE = "reference_logps"  # the cache file's one tensor: [pairs, 2] fp64, (chosen, rejected) per pair
_DIGEST_KEY = "sha256"  # its metadata's content digest (`_table_digest`), checked before the table is used
# How far a sampled row recomputed by the model may lie from the cached one, |cached - recomputed| <=
# tol x (|recomputed| + 1), by train.precision (part of the key: a table is only ever checked in the
# precision it was computed in). The recompute batches the pairs differently, so it differs in rounding
# only. fp32: sums over other batchings differ by 1.3e-7 relative (3.8e-6 at most, 600 demo pairs of
# tiny-llama on CPU); 1e-4 leaves room for GPU kernels that change with the batch shape. bf16 / fp16: 2^-8,
# bf16's unit roundoff, the relative precision a value computed from bf16 activations cannot beat; measured,
# other batchings differ by 1.7e-4 relative (0.003), bf16 from fp32 by 3.4e-4 (0.010 at most), so 2^-8 is
# 10x the distance of a bf16 table from the exact fp32 one, and a shift of a fraction of a nat is caught.
_TOLERANCE = {"fp32": 1e-4, "bf16": 2.0**-8, "fp16": 2.0**-8}


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
    """A hash of every pair's token ids and labels, and a vision model's pairs' image inputs, in order."""
    digest = hashlib.sha256()
    for pair in pairs:
        for example in (pair.chosen, pair.rejected):
            digest.update(torch.tensor(example.input_ids, dtype=torch.int64).numpy().tobytes())
            digest.update(torch.tensor(example.labels, dtype=torch.int64).numpy().tobytes())
            for name, tensor in sorted(getattr(example, "images", {}).items()):
                digest.update(
                    name.encode() + tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
                )
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


# Pairs per packed window of the pass (per rank and row of the micro-batch): each window is packed on its own
# (`packed_unit_micro_batches`, first-fit over its micro-batches), so packing costs O(window) per pair.
_WINDOW_PER_ROW = 16


def _forwards(
    pairs: list[PreferencePair], micro: int, pad_id: int, dp: int, rank: int, row_tokens: int | None
) -> Iterator[tuple[list[int], dict[str, torch.Tensor]]]:
    """This rank's forwards of the pass, (pair indices, collated micro-batch), as many on every rank.
    Padded: pairs rank, rank + dp, ... in micro-batches of `micro` pairs. Packed (`row_tokens`, the run's
    `batch.tokens_per_micro_batch` rows): windows of pairs packed as training packs a global batch."""
    if row_tokens is None:
        mine = list(range(rank, len(pairs), dp))
        most = math.ceil(len(pairs) / dp)  # rank 0's share, the largest: every rank runs as many forwards
        for k in range(math.ceil(most / micro)):
            idx = mine[k * micro : (k + 1) * micro]
            yield idx, collate_pairs([pairs[i] for i in idx], pad_id)
        return
    window = _WINDOW_PER_ROW * micro * dp
    for start in range(0, len(pairs), window):
        indices = list(range(start, min(start + window, len(pairs))))
        lengths = {i: (len(pairs[i].chosen.input_ids), len(pairs[i].rejected.input_ids)) for i in indices}
        for rows in packed_unit_micro_batches(indices, lengths, micro, row_tokens, dp, rank):
            yield units_of(rows), collate_packed_pairs(rows, pairs, pad_id)


def _score(
    strategy: Strategy,
    model: torch.nn.Module,
    pairs: list[PreferencePair],
    micro: int,
    pad_id: int,
    impl: str,
    row_tokens: int | None = None,
) -> torch.Tensor:
    """This rank's share of the [pairs, 2] table (zeros elsewhere), by no-grad forwards of the model."""
    table = torch.zeros(len(pairs), 2, dtype=torch.float64, device=strategy.device)
    impl = FUSED_LINEAR if impl == FUSED_LINEAR else "chunked"
    was_training = model.training
    model.eval()
    rank, dp = strategy.rank, strategy.world_size
    shown = progress(f"reference log-probs of {len(pairs):,} pairs", len(pairs), "pairs", enabled=rank == 0)
    try:
        with torch.no_grad(), shown as state:
            for idx, batch in _forwards(pairs, micro, pad_id, dp, rank, row_tokens):
                state.update(min(len(pairs), max(idx, default=0) + 1))
                labels = batch["labels"]
                with strategy.accumulate(is_last=True):
                    token_nll = forward_token_losses(
                        model, model_inputs(batch, strategy.device), labels, impl
                    )
                    logps = sequence_logps(token_nll, labels, batch.get("sequence_ids"))[0]
                if idx:
                    m = len(idx)
                    table[idx] = torch.stack([logps[:m], logps[m:]], dim=1).double()
    finally:
        model.train(was_training)
    return table


def _row_tokens(cfg: ZerofitConfig) -> int | None:
    """The packed rows' tokens under a token budget (data.max_seq_len), else None: the pass lays its pairs out
    as training does."""
    return cfg.data.max_seq_len if cfg.batch.tokens_per_micro_batch is not None else None


def _tolerance(cfg: ZerofitConfig) -> float:
    """How far a recomputed reference log-prob may lie from the cached one (`_TOLERANCE`): a quantized
    model's, whose kernels dequantize to a half dtype, as a half precision's."""
    return _TOLERANCE["bf16" if cfg.quantization.load_in != "none" else cfg.train.precision]


def _source_problem(
    cfg: ZerofitConfig,
    strategy: Strategy,
    model: torch.nn.Module,
    pairs: list[PreferencePair],
    table: torch.Tensor,
    micro: int,
    pad_id: int,
) -> str:
    """What a cached `table` gets wrong on a seeded sample of its rows recomputed by `model` ("" when it
    matches within `_tolerance`), rank 0's verdict on every rank (collective: every rank runs the sample's
    forwards, `_score`, as the pass does)."""
    rows = sample_indices(range(len(pairs)))
    sample = [pairs[i] for i in rows]
    local = _score(strategy, model, sample, micro, pad_id, cfg.train.cross_entropy, _row_tokens(cfg))
    fresh = strategy.all_reduce_sum(local)
    fresh, held = fresh.cpu(), table[rows]
    rtol = _tolerance(cfg)
    off = ((held - fresh).abs() > rtol * (fresh.abs() + 1)).nonzero()
    problem = ""
    if len(off):
        k, side = (int(v) for v in off[0])
        problem = (
            f"pair {rows[k]}'s {('chosen', 'rejected')[side]} reference log-prob is {float(held[k, side]):.4f} "
            f"in the file, {float(fresh[k, side]):.4f} recomputed by the model, beyond the "
            f"{cfg.train.precision} tolerance of {rtol:.2g} x (|log-prob| + 1)"
        )
    return str(strategy.broadcast_object(problem))


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
    table, problem = None, ""
    if cached:  # rank 0's table on every rank, then checked against the model on a sample
        zeros = torch.zeros(len(pairs), 2, dtype=torch.float64)
        table = strategy.all_reduce_sum((zeros if found is None else found).to(strategy.device)).cpu()
        problem = _source_problem(cfg, strategy, model, pairs, table, micro_batch_size, pad_id)
        if problem and strategy.rank == 0 and path is not None:
            mismatch_note(path, problem)
    if table is None or problem:
        cached = False
        local = _score(
            strategy, model, pairs, micro_batch_size, pad_id, cfg.train.cross_entropy, _row_tokens(cfg)
        )
        table = strategy.all_reduce_sum(local).cpu()
        # The first sound table for these pairs wins (later runs all read the same one); a mismatched one goes.
        if path is not None and strategy.rank == 0 and (problem or _read(path, len(pairs))[0] is None):
            _write(path, table)
    values: list[Any] = table.tolist()
    for pair, (chosen, rejected) in zip(pairs, values, strict=True):
        pair.reference = (chosen, rejected)
    return ReferencePass(len(pairs), cached, path, "" if path is not None else because)
