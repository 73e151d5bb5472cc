"""Checkpoints through the strategy: atomic, verified by a manifest, loadable on another world size.

A checkpoint is written into `checkpoints/step-N.tmp/` (the strategy's engine files and each rank's RNG
state), then every rank hashes its share of the files, rank 0 writes `manifest.json` (see `manifest.py`)
and renames the folder to `checkpoints/step-N/`: a crash mid-save leaves a `.tmp` folder that resume
ignores, never a half-written `step-N` in place of a good one.

Resume restores model, optimizer, scheduler, RNG and the step; the data order needs no state because the
sampler is a pure function of the step. The strategy loads a checkpoint saved on another world size
(elastic resume; see each strategy's `load`). RNG streams are per rank: a rank that did not exist when the
checkpoint was saved keeps its seeded stream.
"""

from __future__ import annotations

import random
import shutil
import time
from pathlib import Path
from typing import Any

import torch

from zerofit.checkpoint.failed_save import attempt, first_failure, remove_partial, save_failed
from zerofit.checkpoint.manifest import (
    EARLY_STOPPED,
    checkpoint_folders,
    describe_files,
    listed_files,
    write_manifest,
)
from zerofit.checkpoint.policy import EvalWatch, SaveClock, write_best
from zerofit.checkpoint.rundir import CHECKPOINTS
from zerofit.config.schema import CheckpointSection
from zerofit.core.run_layout import saving_dir_name, step_dir_name
from zerofit.core.writes import torch_save
from zerofit.strategies.base import Strategy


def complete_checkpoints(run_dir: Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint (one with a manifest) in `run_dir`, oldest first."""
    return checkpoint_folders(Path(run_dir) / CHECKPOINTS)


def _rng_state() -> dict[str, Any]:
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Checkpointer:
    """Saves every `checkpoint.every_steps` optimizer steps, at the end, and whenever the loop forces a save
    (a stop, a due `checkpoint.every_minutes`, a new best evaluation under `checkpoint.keep_best`, early
    stopping). Keeps the newest `keep_last` checkpoints plus the best one.

    `record` is what every manifest states about the run besides its files (config, batch plan, world size,
    checkpoint format, data fingerprint; see `resume.checkpoint_record`). `elapsed_s` is the wall time the
    run had already spent before this session (a resumed run's), so manifests carry the whole run's time.
    `clock` restarts at every save; `watch` says which step holds the best evaluation (protected from
    pruning, recorded in `checkpoints/best.json`).
    """

    def __init__(
        self,
        strategy: Strategy,
        run_dir: Path,
        section: CheckpointSection,
        max_steps: int,
        record: dict[str, Any] | None = None,
        elapsed_s: float = 0.0,
        clock: SaveClock | None = None,
        watch: EvalWatch | None = None,
    ) -> None:
        self.strategy = strategy
        self.root = Path(run_dir) / CHECKPOINTS
        self.section = section
        self.max_steps = max_steps
        self.record = dict(record or {})
        self.elapsed_before = elapsed_s
        self.started = time.monotonic()
        self.last_saved: int | None = None
        self.tokens_seen: int | None = None  # the loop's running count, recorded in every manifest
        self.clock = clock if clock is not None else SaveClock(section.every_minutes)
        self.watch = watch

    @property
    def elapsed_s(self) -> float:
        """Wall time of the whole run so far (earlier sessions included)."""
        return self.elapsed_before + time.monotonic() - self.started

    def after_step(self, steps_done: int, force: bool = False, tokens_seen: int | None = None) -> None:
        """Called by the loop after every optimizer step (on every rank); `force` saves now (a decision every
        rank agreed on: a stop, a due wall-clock save, a new best evaluation). `tokens_seen` (the valid label
        tokens of steps 1..`steps_done`) goes into the manifest, where a resume continues the count from:
        the metrics rows alone lack the unlogged steps' tokens under `logging.log_every` > 1."""
        if tokens_seen is not None:
            self.tokens_seen = tokens_seen
        every = self.section.every_steps
        due = steps_done == self.max_steps or bool(every and steps_done % every == 0) or force
        if due and self.last_saved != steps_done:
            self.save(steps_done)
            self.clock.reset()
        if self.strategy.rank == 0 and self._best_step() == steps_done and self.last_saved == steps_done:
            assert self.watch is not None and self.watch.best_value is not None
            write_best(self.root, steps_done, self.watch.best_value, self.watch.metric)

    def _best_step(self) -> int | None:
        """The step whose checkpoint is kept as the best (None: no evaluation yet, or keep_best off)."""
        return self.watch.best_step if self.watch is not None and self.section.keep_best else None

    def save(self, steps_done: int) -> Path:
        """Write checkpoint `step-<steps_done>` atomically, with its manifest (collective).

        A failed write on any rank (a full disk) ends the save on every rank alike: the ranks exchange
        what failed, rank 0 removes the partial folder, and every rank raises the same
        `CheckpointWriteError` (see `failed_save`); the newest complete checkpoint stays as it was.
        """
        rank, world = self.strategy.rank, self.strategy.world_size
        final = self.root / step_dir_name(steps_done)
        tmp = self.root / saving_dir_name(steps_done)
        failure = attempt(lambda: self._prepare(tmp)) if rank == 0 else None
        self._raise_if_failed([self.strategy.broadcast_object(failure)], tmp, steps_done)
        failure = attempt(lambda: self._write_files(tmp, steps_done))
        # Exchanging the outcome is also the barrier: every rank's files are on disk (or failed) after it.
        self._raise_if_failed(self.strategy.all_gather_object(failure), tmp, steps_done)
        # Every rank hashes its share of the files; rank 0 lists them all in the manifest.
        shares = self.strategy.all_gather_object(describe_files(tmp, listed_files(tmp)[rank::world]))
        failure = None
        if rank == 0:
            files = {name: meta for share in shares for name, meta in share.items()}
            manifest = {
                **self.record,
                "step": steps_done,
                "world_size": world,
                "elapsed_s": round(self.elapsed_s, 3),
                **({"tokens_seen": self.tokens_seen} if self.tokens_seen is not None else {}),
                **({EARLY_STOPPED: True} if self._early_stopped(steps_done) else {}),
                "files": files,
            }
            failure = attempt(lambda: self._commit(tmp, final, manifest))
        self._raise_if_failed([self.strategy.broadcast_object(failure)], tmp, steps_done)
        self.last_saved = steps_done
        return final

    def _early_stopped(self, steps_done: int) -> bool:
        """Whether early stopping ends the run after `steps_done` (the loop records the verdict before
        this step's save): the manifest says so, and a resume of it is a finished run."""
        return self.watch is not None and self.watch.stopped_at == steps_done

    @staticmethod
    def _prepare(tmp: Path) -> None:
        """Rank 0: an empty `step-N.tmp` (a directory needs a block on some filesystems: it can fail too)."""
        shutil.rmtree(tmp, ignore_errors=True)  # leftovers of a crashed save
        tmp.mkdir(parents=True)

    def _write_files(self, tmp: Path, steps_done: int) -> None:
        """This rank's files of the checkpoint: the engine's state and the rank's RNG streams."""
        self.strategy.save(tmp, {"step": steps_done})
        torch_save(_rng_state(), tmp / f"rng-rank{self.strategy.rank}.pt")

    def _commit(self, tmp: Path, final: Path, manifest: dict[str, Any]) -> None:
        """Rank 0: the manifest, then the rename that makes the checkpoint complete, then pruning."""
        write_manifest(tmp, manifest)
        self._replace(tmp, final)
        self._prune()

    def _raise_if_failed(self, failures: list[str | None], tmp: Path, steps_done: int) -> None:
        """If any rank's write failed: rank 0 removes the partial folder, and every rank raises."""
        failure = first_failure(failures)
        if failure is None:
            return
        if self.strategy.rank == 0:
            remove_partial(tmp)
        self.strategy.barrier()  # every rank reports after the cleanup, so all see the same free space
        raise save_failed(self.root, steps_done, failure, self.root.parent.name)

    @staticmethod
    def _replace(tmp: Path, final: Path) -> None:
        # The old folder is moved aside before the new one takes its name, and deleted only afterwards.
        old = final.with_name(final.name + ".old")
        if final.exists():
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)

    def _prune(self) -> None:
        best = self._best_step()
        for step, folder in complete_checkpoints(self.root.parent)[: -self.section.keep_last]:
            if step != best:  # the best evaluation's checkpoint outlives keep_last
                shutil.rmtree(folder, ignore_errors=True)

    def load(self, folder: Path, saved_world_size: int) -> int:
        """Restore the (verified) checkpoint `folder`, saved on `saved_world_size` ranks; returns its step."""
        client_state = self.strategy.load(folder, saved_world_size)
        rng_file = folder / f"rng-rank{self.strategy.rank}.pt"
        if rng_file.is_file():  # absent only for a rank the saving run did not have (elastic resume)
            _set_rng_state(torch.load(rng_file, weights_only=True))
        step = int(client_state["step"])
        self.last_saved = step
        return step
