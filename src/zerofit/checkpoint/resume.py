"""Which run directory a launch writes, and which checkpoint it resumes from: decided once, on rank 0, with
the process group up and before any model is loaded, so every refusal costs seconds, not a 7B load.

`checkpoint.resume`:

- `false`: a new run. A run directory that already holds a run is never touched: the run takes the first
  free `<run_name>-2`, `-3`, ...
- `auto`: resume from the newest checkpoint in `output_dir/run_name/` that verifies, if there is one;
  otherwise start at step 0 in that directory (saying so).
- `true`: like `auto`, but a run directory without a checkpoint to resume is an error.

A checkpoint is used only if its manifest verifies (every file present, of the right size and checksum);
a damaged one (a `step-N` folder without a manifest included) is passed over for the next older one, and
the resume says which and why. Its pickles are checked before anything loads them (`zerofit.checkpoint.safe_load`), and
a checkpoint at or past `train.max_steps` is refused (nothing is left to train), and so is one written
when early stopping ended the run (its manifest says so): a finished run says so and changes nothing, and
under `auto` (a scheduler's requeue) the launch exits 0 (`RunFinished`). The config the
checkpoint was saved with is compared with this launch's: a change that alters the training trajectory
(see `NEUTRAL_KEYS` for the ones that cannot) is refused with the diff and the override that accepts it
(`checkpoint.allow_changes`); an accepted change is applied after the load (`Strategy.apply_config`), or
refused here when the checkpoint's state fixes it (`FIXED_BY_CHECKPOINT`). The world size may change: every
strategy loads a checkpoint saved on another number of ranks, and the batch plan keeps the global batch, so
the data position is the same.

Deciding writes nothing (`settle_run_dir`): the run record changes only after the checkpoint has loaded,
in `restore` on rank 0, which locks the run directory (creating it and its `.zerofit.lock`), sets damaged
newer checkpoints aside (`finish_resume`: `step-N.damaged`) and rewinds `metrics.jsonl` to the resumed step.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from zerofit.checkpoint.checkpointer import CHECKPOINTS, Checkpointer
from zerofit.checkpoint.failed_save import error_parts, rank0_writes, rebuild_error
from zerofit.checkpoint.final_export import final_export_step
from zerofit.checkpoint.manifest import EARLY_STOPPED, MANIFEST, data_fingerprint, step_folders, verify
from zerofit.checkpoint.rundir import (
    check_output_location,
    free_name,
    held_by,
    lock_run_dir,
    locked_by,
    taken_note,
)
from zerofit.checkpoint.safe_load import UnsafeCheckpointError, check_checkpoint, refuse_unsafe
from zerofit.config.loader import flatten
from zerofit.config.schema import ZerofitConfig
from zerofit.core.errors import ResumeError, RunFinished, ZerofitError
from zerofit.core.run_layout import (
    DAMAGED_SUFFIX,
    METRICS_FILE,
    SAVING_SUFFIX,
    STEP_DIR_GLOB,
    RunLayout,
    run_dir_of,
)
from zerofit.engine_spec.run_plan import ResumePoint, RunDirDecision, RunPlan
from zerofit.metrics.history import rewind_metrics
from zerofit.resolution import ResolvedConfig
from zerofit.strategies.base import Strategy
from zerofit.version import __version__

# Config keys whose change cannot alter the training trajectory: names and places, logging, how
# checkpoints are kept, the planner's target, how the (unchanged) global batch is split over micro-batches
# (or packed rows) and ranks, implementation choices that compute the same values (recomputation, where
# saved activations wait: `train.activation_offload`; what the RMSNorms save: `train.lean_norm`; fused kernels
# and compiled layers, the same ops fused: `train.kernels`, `train.compile`; not
# `train.tiled_mlp`, whose shards draw LoRA dropout masks differently), the tokenization cache,
# and evaluation (a no-grad forward in eval mode: it draws no random numbers and changes no weight; the
# held-out fraction `data.eval_split` does change the training set, and is compared). `distributed.*` is judged by the
# checkpoint format instead (a ZeRO-2 checkpoint loads only into ZeRO-2), and `data.path` by the data
# file's content: a new path to the same content is a move, a new path to other content is another run
# (`_check_same_data`: refused, never offered to `checkpoint.allow_changes`), and new content at the same
# path an edit of the run's data (compared like a trajectory key). Every other key, including keys added
# later, counts as trajectory-changing.
NEUTRAL_KEYS = (
    "run_name",
    "output_dir",
    "logging",
    "checkpoint",
    "planner",
    "batch.micro_batch_size",
    "batch.grad_accum_steps",
    "distributed",
    "train.activation_checkpointing",
    "train.activation_offload",
    "train.lean_norm",
    "batch.tokens_per_micro_batch",
    "train.cross_entropy",
    "train.kernels",
    "train.compile",
    "model.attn_implementation",
    "model.varlen_kernel",
    "model.trust_remote_code",
    "data.path",
    "data.cache",
    "data.eval_path",
    "eval",
)
# Keys a launch may leave at `auto` that the saved (resolved) config states: `auto` resolves the same way
# again from the same data, so only a different explicit value is a change.
AUTO_KEYS = ("data.format",)
# Keys the loaded checkpoint fixes: its optimizer state is that optimizer's, its adapter has those shapes and
# modules, its weights are of that model and were trained on those (quantized) base weights. Accepting a
# change to one would load state that contradicts the config, so it is refused even when allowed. Every
# other accepted change is applied: hyperparameters are written into the loaded optimizer and the schedule
# is rebuilt for the new config (`Strategy.apply_config`), and the rest is read from the config as the run builds.
FIXED_BY_CHECKPOINT = (
    "optimizer.name",
    "lora.enabled",
    "lora.r",
    "lora.target_modules",
    "lora.use_dora",
    "lora.moe_experts",
    "lora.train_router",
    "model",
    "quantization",
)


def _matches(key: str, prefixes: tuple[str, ...] | list[str]) -> bool:
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def _show(value: Any) -> str:
    return json.dumps(value) if not isinstance(value, str) else value


def checkpoint_record(
    plan: RunPlan, checkpoint_format: str, config_file: str | None = None
) -> dict[str, Any]:
    """What every manifest of this run states besides its files and step (rank 0 computes it once);
    `config_file`: the file the launch read, whose name a resume compares (`_check_same_config_file`)."""
    return {
        "zerofit_version": __version__,
        "checkpoint_format": checkpoint_format,
        "config": plan.config.model_dump(mode="json"),
        "batch_plan": dataclasses.asdict(plan.batch),
        "data": data_fingerprint(plan.config.data.path),
        "config_file": Path(config_file).name if config_file else None,
    }


def _saved_config(manifest: dict[str, Any]) -> dict[str, Any]:
    """The checkpoint's config, flattened; a key it lacks (saved by a zerofit from before the key existed)
    reads as the key's default, which is what that version trained with (a new key's default keeps the old
    behaviour), so an older checkpoint resumes without a spurious `(unset) -> default` change."""
    saved = flatten(manifest.get("config", {}))
    defaults = flatten(ZerofitConfig().model_dump(mode="json"))
    return {**{key: value for key, value in defaults.items() if key not in saved}, **saved}


def _changes(manifest: dict[str, Any], resolved: ResolvedConfig) -> tuple[dict[str, str], list[str]]:
    """Differences between the checkpoint's config and this launch's: ({key: line} refused, notes).

    Refused: trajectory-changing keys not named in `checkpoint.allow_changes`. Notes: the accepted ones
    and the neutral ones, for the resume message.
    """
    saved, now = _saved_config(manifest), flatten(resolved.config.model_dump(mode="json"))
    changing: dict[str, str] = {}
    neutral: list[str] = []
    for key in sorted(set(saved) | set(now)):
        if saved.get(key) != now.get(key) and not (_matches(key, AUTO_KEYS) and now.get(key) == "auto"):
            if key == "train.max_steps" and now.get(key) is None and now.get("train.epochs") is not None:
                continue  # derived from train.epochs once the data loads; epochs and the data are compared
            line = f"{key}: {_show(saved.get(key, '(unset)'))} -> {_show(now.get(key, '(unset)'))}"
            if _matches(key, NEUTRAL_KEYS):
                if not _matches(
                    key, ("checkpoint.resume", "checkpoint.allow_changes", "checkpoint.trust_pickles")
                ):  # per launch
                    neutral.append(line)
            else:
                changing[key] = line
    data_line = _data_change(manifest, saved.get("data.path"), resolved.config.data.path)
    if data_line is not None:
        neutral = [n for n in neutral if not n.startswith("data.path:")]  # said once, with the content
        if data_line[0]:
            changing["data.path"] = data_line[1]
        else:
            neutral.append(data_line[1])
    allowed = resolved.config.checkpoint.allow_changes
    refused = {key: line for key, line in changing.items() if not _matches(key, allowed)}
    accepted = [
        f"{line} (accepted by checkpoint.allow_changes)"
        for key, line in changing.items()
        if key not in refused
    ]
    return refused, accepted + neutral


def _data_change(manifest: dict[str, Any], saved_path: Any, path: str) -> tuple[bool, str] | None:
    """How the training data differs from the checkpoint's: (changes the trajectory?, line), or None.

    A new path reaches here only with the same content (a moved or copied file: other content is another
    run's, refused by `_check_same_data` first) and is reported as a path change; the same path with new
    content as a content change, which alters the trajectory."""
    then = manifest.get("data", {}).get("sha256")
    now = data_fingerprint(path)["sha256"] if then else None
    differs = bool(then) and then != now
    if saved_path is not None and saved_path != path:
        assert then == now and then, "another source's content is refused before (_check_same_data)"
        return False, f"data.path: {_show(saved_path)} -> {path} (the same content (SHA-256 {then[:12]}...))"
    if differs:
        return True, (
            f"data.path: the content of {path} changed since the checkpoint was saved (SHA-256 {then[:12]}... "
            f"then, {now[:12] if now else 'none'}... now)"
        )
    return None


def _check_same_run(
    folder: Path, manifest: dict[str, Any], resolved: ResolvedConfig, config_file: str | None
) -> None:
    """Refuse a folder that holds another run: launched from another config file (`config_file`: the one
    this launch read) or trained on other data. Such a change is never offered to allow_changes."""
    _check_same_config_file(folder, manifest, resolved, config_file)
    _check_same_data(folder, manifest, resolved)


def _check_same_config_file(
    folder: Path, manifest: dict[str, Any], resolved: ResolvedConfig, config_file: str | None
) -> None:
    """Refuse a checkpoint saved by a launch of another config file (by file name: the same file may be
    reached by another path): two configs that resolve to one run_name share a folder, and the run in it is
    the other config's. Not a change to accept; a checkpoint or a launch without a file name passes."""
    then = manifest.get("config_file")
    now = Path(config_file).name if config_file else None
    if not then or not now or then == now:
        return
    raise ResumeError(
        f"checkpoint.resume: {resolved.run_dir} is another run: its checkpoint {folder.name} was saved by a "
        f"launch of {then}, and this launch reads {now}. Both configs give run_name = "
        f"{resolved.config.run_name!r}, so the folder holds the other config's run, and nothing was loaded (a "
        f"different config file is not a change to accept). To start a run of {now}, drop checkpoint.resume "
        f"(it would write {_fresh_dir(resolved)}) or give {now} its own run_name; to continue the run in "
        f"{resolved.run_dir}, launch {then} with checkpoint.resume=true"
    )


def _fresh_dir(resolved: ResolvedConfig) -> Path:
    """The folder a new run of this config would write now (`free_name`)."""
    cfg = resolved.config
    return Path(cfg.output_dir) / free_name(Path(cfg.output_dir), str(cfg.run_name))


def _check_same_data(folder: Path, manifest: dict[str, Any], resolved: ResolvedConfig) -> None:
    """Refuse a checkpoint trained on other data: a `data.path` that names another source whose content is
    not the saved one (or cannot be compared) makes the run directory another run's, found because both
    resolve to the same run name. Continuing it would train that run further on this data, so no
    `checkpoint.allow_changes` is offered: the fix is a new run, or the right data / run directory."""
    saved_path = _saved_config(manifest).get("data.path")
    path = resolved.config.data.path
    then = manifest.get("data", {}).get("sha256")
    now = data_fingerprint(path)["sha256"] if then else None
    if saved_path is None or saved_path == path or (then and now == then):
        return  # the same source, or the same content moved or copied (a neutral change, said on resume)
    content = (
        f"other content: SHA-256 {then[:12]}... then, {now[:12] + '...' if now else 'none'} now"
        if then
        else "a source whose content cannot be compared with the saved one"
    )
    fresh = _fresh_dir(resolved)
    raise ResumeError(
        f"checkpoint.resume: {resolved.run_dir} is another run: its checkpoint {folder.name} was trained on "
        f"data.path = {saved_path}, and this launch trains on {path} ({content}). A resume continues a run "
        "on its own data, and a different data.path is not a change to accept: it makes this folder another "
        "run's (both configs give the same run_name), so nothing was loaded. To start a new run on "
        f"{path}, drop checkpoint.resume (a new run never writes into {resolved.run_dir}: it would write "
        f"{fresh}) or give it its own run_name=NAME; to continue the run in {resolved.run_dir}, launch it "
        f"with data.path={saved_path}; to continue your own earlier run, set run_name to its folder's name"
    )


def _fixed_by_checkpoint(folder: Path, manifest: dict[str, Any], resolved: ResolvedConfig) -> None:
    """Refuse accepted changes to keys the checkpoint's state fixes (`FIXED_BY_CHECKPOINT`)."""
    saved, now = flatten(manifest.get("config", {})), flatten(resolved.config.model_dump(mode="json"))
    lines = [
        f"{key}: {_show(saved.get(key, '(unset)'))} -> {_show(now.get(key, '(unset)'))}"
        for key in sorted(set(saved) | set(now))
        if saved.get(key) != now.get(key)
        and _matches(key, FIXED_BY_CHECKPOINT)
        and not _matches(key, NEUTRAL_KEYS)
    ]
    if lines:
        raise ResumeError(
            f"checkpoint.resume: {folder} cannot take these changes, although checkpoint.allow_changes accepts "
            "them:\n  "
            + "\n  ".join(lines)
            + "\nThe checkpoint's own state fixes them (its optimizer state is "
            "that optimizer's, its adapter has those shapes and target modules, its weights belong to that "
            "model and its quantized base), so loading it under the new values would train something else than "
            "the config says. Resume with the saved values (drop these overrides), or start a new run "
            "(checkpoint.resume=false, or another run_name)"
        )


def _planned_steps(manifest: dict[str, Any], resolved: ResolvedConfig) -> int | None:
    """The run's step count: train.max_steps, or for a train.epochs run (whose count the data settles later)
    the count the checkpoint's run derived from the same epochs (the data content is compared elsewhere)."""
    train = resolved.config.train
    if train.max_steps is not None:
        return train.max_steps
    saved = manifest.get("config", {}).get("train", {})
    same_epochs = saved.get("epochs") == train.epochs
    return int(saved["max_steps"]) if same_epochs and saved.get("max_steps") is not None else None


def _tokens_seen(manifest: dict[str, Any]) -> int | None:
    """The valid label tokens the checkpoint's steps trained on, or None for a manifest written before
    zerofit recorded them (the resume then adds up the kept metrics rows, see `metrics.summary`)."""
    value = manifest.get("tokens_seen")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _check_step(folder: Path, step: int, max_steps: int, resolved: ResolvedConfig) -> None:
    """A checkpoint at or past the run's step count has nothing left to train: a run at its last step is
    finished (`_finished`); one past it (a lowered train.max_steps) is refused with the fix."""
    if step < max_steps:
        return
    if step == max_steps:
        train = resolved.config.train
        by_epochs = train.max_steps is None and train.epochs is not None
        length = f"train.epochs {train.epochs} = {max_steps} steps" if by_epochs else f"{max_steps} steps"
        further = (
            f"raise the epoch count and accept the change: train.epochs=N (N > {train.epochs}) "
            "checkpoint.allow_changes=[train.epochs]"
            if by_epochs
            else f"raise the step count and accept the change: train.max_steps=N (N > {step}) "
            "checkpoint.allow_changes=[train.max_steps]"
        )
        raise _finished(resolved, folder, step, f"it has trained all its {length}", further)
    raise ResumeError(
        f"checkpoint.resume: {folder} is at step {step} and train.max_steps is {max_steps}: the run has already "
        f"trained more than its {max_steps} steps, so resuming it would train nothing. To train further, raise "
        f"the step count and accept the change: train.max_steps=N (N > {step}) "
        "checkpoint.allow_changes=[train.max_steps]; to train again from step 0, start a new run "
        "(checkpoint.resume=false, or another run_name)"
    )


def _check_early_stop(folder: Path, manifest: dict[str, Any], resolved: ResolvedConfig) -> None:
    """A checkpoint written when early stopping ended the run (its manifest says so, `Checkpointer.save`)
    is a finished run, unless this launch changed train.early_stopping (accepted by
    checkpoint.allow_changes: a new patience decides again, from the evaluations the run kept)."""
    if manifest.get(EARLY_STOPPED) is not True:
        return
    saved, now = _saved_config(manifest), flatten(resolved.config.model_dump(mode="json"))
    keys = [key for key in set(saved) | set(now) if _matches(key, ("train.early_stopping",))]
    if any(saved.get(key) != now.get(key) for key in keys):
        return
    es = resolved.config.train.early_stopping
    raise _finished(
        resolved,
        folder,
        int(manifest["step"]),
        f"early stopping ended it after step {manifest['step']} (eval/loss did not improve by more than "
        f"{es.min_delta:g} for {es.patience} evaluation(s))",
        f"raise the patience and accept the change: train.early_stopping.patience=N (N > {es.patience}, or 0 "
        "to never stop early) checkpoint.allow_changes=[train.early_stopping]",
    )


def _finished(resolved: ResolvedConfig, folder: Path, step: int, why: str, further: str) -> ResumeError:
    """The one paragraph for a resume of a finished run: nothing trained, nothing written. Under
    `checkpoint.resume=auto` (a scheduler's requeue) a `RunFinished`, which the launcher ends with exit 0."""
    text = (
        f"checkpoint.resume: the run in {resolved.run_dir} has already finished: {why}; its newest checkpoint "
        f"is {folder.name}. Nothing was trained and nothing in the run directory was changed.{_export_note(resolved, folder, step)} "
        f"To train further, {further}; to train again from step 0, start a new run (checkpoint.resume=false, "
        "or another run_name)"
    )
    return RunFinished(text) if resolved.config.checkpoint.resume == "auto" else ResumeError(text)


def _export_note(resolved: ResolvedConfig, folder: Path, step: int) -> str:
    """For a finished run stopped after its last checkpoint but before its final export (`adapter/` or
    `model/`, written after that checkpoint): where its weights are and how to export them. Empty when the
    final export is there and as new as the checkpoint (summary.json's `last_step`)."""
    export = RunLayout(resolved.run_dir).export(adapter=resolved.config.lora.enabled)
    last = final_export_step(resolved.run_dir)
    if export.is_dir() and last is not None and last >= step:
        return ""
    return (
        f" Its final export ({export.name}/) was not written after {folder.name} (the run was stopped between "
        f"the two): the trained weights are in {folder.name}; write the export with `zerofit export "
        f"{resolved.run_dir} --out DIR`, which reads that checkpoint."
    )


def _check_pickles(folder: Path, trusted: bool) -> None:
    """Refuse a checkpoint whose pickles name code beyond the allow-list (`zerofit.checkpoint.safe_load`)."""
    # The engines' folder names, from the strategies that write them (imported here: only a resume needs
    # them, and a run of one engine need not import the others).
    from zerofit.strategies.deepspeed import TAG as DEEPSPEED_TAG
    from zerofit.strategies.fsdp_layout import DCP_DIR

    try:
        refuse_unsafe(
            check_checkpoint(folder, DEEPSPEED_TAG, DCP_DIR),
            trusted,
            "checkpoint.trust_pickles=true",
            f"checkpoint.resume: {folder}",
        )
    except UnsafeCheckpointError as exc:
        raise ResumeError(str(exc)) from None


def _refusal(folder: Path, refused: dict[str, str]) -> ResumeError:
    note = ""
    if "batch.global_batch_size" in refused:
        note = (
            "\n(a new global batch re-cuts the data order: step k would start at example k x the new size, "
            "skipping or repeating examples)"
        )
    return ResumeError(
        f"checkpoint.resume: {folder} was saved with a different config, and these changes alter the "
        "training trajectory:\n  " + "\n  ".join(refused.values()) + note + "\nResume with the saved values "
        "(drop these overrides), start a new run (checkpoint.resume=false, or another run_name), or accept "
        f"the changes with checkpoint.allow_changes=[{','.join(refused)}]"
    )


def _check_sequence_parallel_world(folder: Path, manifest: dict[str, Any], resolved: ResolvedConfig) -> None:
    """A checkpoint saved with `distributed.sequence_parallel` > 1 resumes on its own world size (any N
    that divides it): DeepSpeed 0.19.8 records its sequence-parallel size as the tensor-parallel degree
    of the checkpoint (the Ulysses mpu aliases one to the other), and its universal-checkpoint converter,
    which a change of world size needs, then refuses the checkpoint's single model-state file."""
    saved_world = int(manifest.get("world_size", resolved.world_size))
    saved_sp = int(_saved_config(manifest).get("distributed.sequence_parallel", 1) or 1)
    if saved_sp == 1 or saved_world == resolved.world_size:
        return
    raise ResumeError(
        f"checkpoint.resume: {folder} was saved with distributed.sequence_parallel = {saved_sp} on "
        f"{saved_world} rank(s), and this launch has {resolved.world_size}; a sequence-parallel checkpoint "
        f"resumes on the same number of ranks (DeepSpeed cannot re-partition it to another world size: its "
        f"universal-checkpoint converter reads the sequence-parallel size as tensor parallelism). Launch "
        f"{saved_world} rank(s), with any distributed.sequence_parallel that divides {saved_world} (1 "
        "included), or start a new run (checkpoint.resume=false)"
    )


def _elastic_note(manifest: dict[str, Any], resolved: ResolvedConfig) -> str | None:
    saved = int(manifest.get("world_size", resolved.world_size))
    if saved == resolved.world_size:
        return None
    note = (
        f"elastic resume: saved on {saved} rank(s), resuming on {resolved.world_size}; "
        f"{resolved.batch.describe()} (the global batch and the data position are unchanged)"
    )
    if resolved.config.lora.enabled and resolved.config.lora.dropout > 0:
        note += "; dropout masks are drawn per rank, so they differ from an uninterrupted run's"
    return note


def find_resume_point(
    resolved: ResolvedConfig, checkpoint_format: str, config_file: str | None = None
) -> ResumePoint | None:
    """The newest checkpoint of the run directory that verifies and may be resumed, or None if there is none.

    Raises `ResumeError` when checkpoints exist but none verifies, when the engine cannot load the newest
    good one, when the folder is another run's (`_check_same_run`), or when the config changed in a way
    that alters the trajectory."""
    run_dir = resolved.run_dir
    damaged: list[tuple[Path, list[str]]] = []
    for _step, folder in reversed(step_folders(run_dir / CHECKPOINTS)):
        manifest, problems = verify(folder)
        if manifest is None or problems:
            damaged.append((folder, problems))
            continue
        saved_format = manifest.get("checkpoint_format")
        if saved_format != checkpoint_format:
            raise ResumeError(
                f"checkpoint.resume: {folder} was written by the {saved_format} engine and this launch runs "
                f"{checkpoint_format}; a checkpoint loads only into the engine layout that wrote it (the world "
                "size may change, the engine may not): launch with the distributed.strategy / "
                "distributed.preset the run was saved with, or start a new run (checkpoint.resume=false)"
            )
        _check_same_run(folder, manifest, resolved, config_file)
        refused, notes = _changes(manifest, resolved)
        if refused:
            raise _refusal(folder, refused)
        _fixed_by_checkpoint(folder, manifest, resolved)
        max_steps = _planned_steps(manifest, resolved)
        if max_steps is not None:
            _check_step(folder, int(manifest["step"]), max_steps, resolved)
        _check_early_stop(folder, manifest, resolved)
        _check_pickles(folder, resolved.config.checkpoint.trust_pickles)
        _check_sequence_parallel_world(folder, manifest, resolved)
        fallbacks = [
            f"{bad.name} is damaged ({'; '.join(why[:2])}{'; ...' if len(why) > 2 else ''}): resuming from "
            f"{folder.name}, the newest checkpoint that verifies"
            for bad, why in damaged
        ]
        elastic = _elastic_note(manifest, resolved)
        if elastic:  # the elastic note states the new split
            notes = [
                n for n in notes if not n.startswith(("batch.micro_batch_size", "batch.grad_accum_steps"))
            ]
        return ResumePoint(
            folder=folder,
            step=int(manifest["step"]),
            world_size=int(manifest.get("world_size", resolved.world_size)),
            elapsed_s=float(manifest.get("elapsed_s", 0.0)),
            tokens_seen=_tokens_seen(manifest),
            notes=tuple(fallbacks + ([elastic] if elastic else []) + [f"changed: {n}" for n in notes]),
            damaged=tuple(bad for bad, _ in damaged),
        )
    if damaged:
        listing = "; ".join(f"{bad.name}: {why[0] if why else 'unreadable'}" for bad, why in damaged)
        raise ResumeError(
            f"checkpoint.resume: no checkpoint in {run_dir / CHECKPOINTS} verifies ({listing}); nothing can be "
            "resumed safely: start a new run (checkpoint.resume=false, or another run_name)"
        )
    return None


def _nothing_to_resume(run_dir: Path) -> ResumeError:
    partial = (
        sorted(p.name for p in (run_dir / CHECKPOINTS).glob(f"{STEP_DIR_GLOB}{SAVING_SUFFIX}"))
        if run_dir.is_dir()
        else []
    )
    why = (
        f"{run_dir} does not exist"
        if not run_dir.exists()
        else f"{run_dir / CHECKPOINTS} holds no complete checkpoint"
        + (f" (only an interrupted save: {', '.join(partial)})" if partial else "")
    )
    # A default run name says model, method, preset, precision and global batch: a change to one of them
    # looks for another directory. Name the runs that could be meant.
    others = sorted(
        p.parents[2].name for p in run_dir.parent.glob(f"*/{CHECKPOINTS}/{STEP_DIR_GLOB}/{MANIFEST}")
    )
    hint = (
        f"; runs with checkpoints in {run_dir.parent}: {', '.join(dict.fromkeys(others))}" if others else ""
    )
    return ResumeError(
        f"checkpoint.resume = true, but {why}{hint}; a run is found by its run directory (output_dir/"
        "run_name; the default run_name includes the model, method, preset, precision and global batch): "
        "pass the run_name to resume, or set checkpoint.resume=auto to start at step 0 when there is "
        "nothing to resume"
    )


def _decide(
    resolved: ResolvedConfig, checkpoint_format: str, config_file: str | None
) -> tuple[str, ResumePoint | None]:
    mode = resolved.config.checkpoint.resume
    if mode is False:
        name = free_name(Path(resolved.config.output_dir), str(resolved.config.run_name))
        check_output_location(run_dir_of(resolved.config.output_dir, name))
        return name, None
    check_output_location(run_dir_of(resolved.config.output_dir, str(resolved.config.run_name)))
    holder = locked_by(resolved.run_dir)
    if holder is not None:
        raise ResumeError(
            f"checkpoint.resume: {held_by(resolved.run_dir, holder)}: a stopped run may still be saving its "
            "checkpoint, or another launch uses this run_name; wait for it to exit, then resume (or give "
            "this run another run_name)"
        )
    point = find_resume_point(resolved, checkpoint_format, config_file)
    if point is None and mode is True:
        raise _nothing_to_resume(resolved.run_dir)
    return str(resolved.config.run_name), point


def settle_run_dir(
    resolved: ResolvedConfig, strategy: Strategy, config_file: str | None = None
) -> RunDirDecision:
    """The run name this launch writes under and the checkpoint it resumes from (collective; rank 0 decides,
    every rank gets the same answer). Nothing is written: `zerofit.engine_spec.run_plan.make_run_plan` records it.

    A refusal is raised on every rank, so every rank exits with the same message.
    """
    outcome: tuple[Any, ...]
    if strategy.rank == 0:
        try:
            outcome = ("ok", *_decide(resolved, strategy.checkpoint_format, config_file))
        except ZerofitError as exc:
            outcome = ("error", *error_parts(exc))
    else:
        outcome = ()
    strategy.wait_for_rank0("rank 0 to verify the checkpoints")  # hashing may outlast the pg timeout
    outcome = strategy.broadcast_object(outcome)
    if outcome[0] == "error":
        raise rebuild_error(*outcome[1:])
    _, name, point = outcome
    note = taken_note(resolved.config.output_dir, str(resolved.config.run_name), name)
    return RunDirDecision(run_name=name, resume=point, note=note)


def finish_resume(point: ResumePoint) -> None:
    """After a successful load (rank 0): set damaged newer checkpoints aside, out of the way of pruning and
    of the next resume (renamed `step-N.damaged`, kept for inspection)."""
    for folder in point.damaged:
        target = folder.with_name(folder.name + DAMAGED_SUFFIX)
        suffix = 1
        while target.exists():
            suffix += 1
            target = folder.with_name(f"{folder.name}{DAMAGED_SUFFIX}-{suffix}")
        folder.rename(target)


def restore(
    checkpointer: Checkpointer, point: ResumePoint | None, run_dir: Path
) -> tuple[int, list[dict[str, Any]] | None]:
    """Load `point` (collective), then bring the run record in line with it on rank 0: damaged newer
    checkpoints set aside, metrics.jsonl rewound to the resumed step (a torn last line repaired).

    Returns (the step training continues from, the kept metrics rows; None when not resuming). Called after
    `settle_run_dir` validated the resume, so a refused or failed load never changes the run record.
    """
    step = checkpointer.load(point.folder, point.world_size) if point is not None else 0

    def settle_record() -> list[dict[str, Any]]:
        lock_run_dir(run_dir)
        if point is not None:
            finish_resume(point)
        return rewind_metrics(run_dir / METRICS_FILE, step)  # `auto` without a checkpoint: back to step 0

    rows = rank0_writes(checkpointer.strategy, run_dir, settle_record) or []
    return step, (rows if point is not None else None)


def resume_message(point: ResumePoint | None, mode: bool | str, run_dir: Path, max_steps: int) -> str | None:
    """What a launch says about resuming (rank 0 prints it after the plan), or None for a new run."""
    if point is None:
        return (
            f"checkpoint.resume=auto: no checkpoint in {run_dir}: starting at step 0"
            if mode == "auto"
            else None
        )
    lines = [f"resumed from {point.folder} at step {point.step} of {max_steps}"]
    lines += [f"  {note}" for note in point.notes]
    return "\n".join(lines)
