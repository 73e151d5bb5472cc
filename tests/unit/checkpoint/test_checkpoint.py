"""Checkpoints in one process: atomic saves with a manifest, verification, fallback to the newest checkpoint
that verifies, refusal of trajectory-changing config changes, the run-dir rules of `checkpoint.resume`, and
the metrics.jsonl rewind of a resumed run."""

from __future__ import annotations

import fcntl
import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from config_helpers import DEMO_DATA, new_run_plan, one_process_strategy
from zerofit.checkpoint import MANIFEST, Checkpointer, checkpoint_record, complete_checkpoints, verify
from zerofit.checkpoint.manifest import data_fingerprint
from zerofit.checkpoint.resume import (
    DAMAGED_SUFFIX,
    find_resume_point,
    finish_resume,
    restore,
    settle_run_dir,
)
from zerofit.config import load_config
from zerofit.config.schema import CheckpointSection
from zerofit.core.errors import ConfigError, ResumeError
from zerofit.core.run_layout import LOCK_FILE
from zerofit.engine_spec import render_spec
from zerofit.engine_spec.run_plan import RunPlan, make_run_plan
from zerofit.metrics.history import rewind_metrics
from zerofit.resolution import ResolvedConfig, resolve
from zerofit.strategies.single import SingleStrategy


def _strategy() -> SingleStrategy:
    torch.manual_seed(0)
    strategy = one_process_strategy()
    strategy.prepare(
        torch.nn.Linear(3, 3),
        lambda m: torch.optim.AdamW(m.parameters(), lr=0.1),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (s + 1)),
    )
    return strategy


def _train_one_step(strategy: SingleStrategy) -> None:
    strategy.backward(strategy.unwrap()(torch.ones(2, 3)).pow(2).sum())
    strategy.clip_and_step(None)


def _resolved(run_dir: Path, *overrides: str) -> ResolvedConfig:
    cfg = load_config(
        None,
        [
            f"data.path={DEMO_DATA}",
            f"output_dir={run_dir.parent}",
            f"run_name={run_dir.name}",
            "distributed.strategy=single",
            "batch.global_batch_size=4",
            "batch.micro_batch_size=2",
            *overrides,
        ],
    )
    return resolve(cfg, 1)


def _saved_run(run_dir: Path, steps: tuple[int, ...] = (2, 4), *overrides: str) -> Checkpointer:
    """A run directory with checkpoints at `steps`, each manifest recording the config of `overrides`."""
    strategy = _strategy()
    record = checkpoint_record(new_run_plan(_resolved(run_dir, *overrides)), strategy.checkpoint_format)
    ckpt = Checkpointer(strategy, run_dir, CheckpointSection(keep_last=5), max_steps=10, record=record)
    for step in range(1, max(steps) + 1):
        _train_one_step(strategy)
        if step in steps:
            ckpt.save(step)
    return ckpt


def test_save_is_atomic_keeps_the_last_n_and_lists_every_file(tmp_path: Path) -> None:
    strategy = _strategy()
    ckpt = Checkpointer(strategy, tmp_path, CheckpointSection(every_steps=2, keep_last=2), max_steps=7)
    for step in range(1, 8):
        _train_one_step(strategy)
        ckpt.after_step(step)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [6, 7]  # every 2, the end, keep 2
    assert not list((tmp_path / "checkpoints").glob("*.tmp"))
    folder = tmp_path / "checkpoints" / "step-7"
    manifest = json.loads((folder / MANIFEST).read_text())
    assert set(manifest["files"]) == {"state.pt", "rng-rank0.pt"}
    assert manifest["files"]["state.pt"]["size"] == (folder / "state.pt").stat().st_size
    assert manifest["step"] == 7 and manifest["world_size"] == 1
    assert verify(folder) == (manifest, [])


def test_a_stop_saves_once_even_when_a_periodic_save_fell_on_the_same_step(tmp_path: Path) -> None:
    strategy = _strategy()
    ckpt = Checkpointer(strategy, tmp_path, CheckpointSection(every_steps=2), max_steps=7)
    _train_one_step(strategy)
    ckpt.after_step(1, force=True)
    _train_one_step(strategy)
    ckpt.after_step(2)
    before = (tmp_path / "checkpoints" / "step-2" / MANIFEST).stat().st_mtime_ns
    ckpt.after_step(2, force=True)
    assert [s for s, _ in complete_checkpoints(tmp_path)] == [1, 2]
    assert (tmp_path / "checkpoints" / "step-2" / MANIFEST).stat().st_mtime_ns == before


def test_a_checkpoint_records_the_tokens_seen_a_resume_continues_from(tmp_path: Path) -> None:
    """The loop's running count of label tokens goes into every manifest and back into the resume point
    (the metrics rows lack the unlogged steps under logging.log_every > 1); an older manifest gives None."""
    run_dir = tmp_path / "r"
    strategy = _strategy()
    record = checkpoint_record(new_run_plan(_resolved(run_dir)), strategy.checkpoint_format)
    ckpt = Checkpointer(strategy, run_dir, CheckpointSection(every_steps=2), max_steps=10, record=record)
    for step, seen in ((1, 7), (2, 15), (3, 22)):
        _train_one_step(strategy)
        ckpt.after_step(step, False, seen)
    manifest_path = run_dir / "checkpoints" / "step-2" / MANIFEST
    assert json.loads(manifest_path.read_text())["tokens_seen"] == 15
    point = find_resume_point(_resolved(run_dir), "torch-state")
    assert point is not None and (point.step, point.tokens_seen) == (2, 15)
    manifest = json.loads(manifest_path.read_text())
    del manifest["tokens_seen"]  # a checkpoint from before the record
    manifest_path.write_text(json.dumps(manifest))
    point = find_resume_point(_resolved(run_dir), "torch-state")
    assert point is not None and point.tokens_seen is None


def test_a_half_written_checkpoint_is_ignored(tmp_path: Path) -> None:
    ckpt = _saved_run(tmp_path / "r", (3,))
    (ckpt.root / "step-5.tmp").mkdir()  # a crash mid-save
    (ckpt.root / "step-6").mkdir()  # no manifest
    assert [s for s, _ in complete_checkpoints(tmp_path / "r")] == [3]


def test_load_restores_model_optimizer_scheduler_rng_and_step(tmp_path: Path) -> None:
    strategy = _strategy()
    ckpt = Checkpointer(strategy, tmp_path, CheckpointSection(), max_steps=10)
    for _ in range(2):
        _train_one_step(strategy)
    folder = ckpt.save(2)
    expected_rng = torch.rand(3)
    _train_one_step(strategy)
    expected_weight = strategy.unwrap().weight.detach().clone()

    fresh = _strategy()
    assert Checkpointer(fresh, tmp_path, CheckpointSection(), max_steps=10).load(folder, 1) == 2
    assert torch.equal(torch.rand(3), expected_rng)
    assert fresh.current_lr() == pytest.approx(0.1 / 3)
    _train_one_step(fresh)
    assert torch.equal(fresh.unwrap().weight, expected_weight)


@pytest.mark.parametrize(
    ("damage", "problem"),
    [
        (lambda f: (f / "rng-rank0.pt").unlink(), "rng-rank0.pt is missing"),
        (lambda f: os.truncate(f / "state.pt", 100), "state.pt is 100 bytes, the manifest says"),
        (lambda f: _flip_last_byte(f / "state.pt"), "state.pt does not match its SHA-256"),
        (lambda f: (f / MANIFEST).write_text("{"), "manifest.json is unreadable"),
        (lambda f: _set_manifest_step(f, 3), "the folder is step-4 but its manifest.json says step 3"),
    ],
)
def test_a_damaged_checkpoint_falls_back_to_the_newest_that_verifies(
    tmp_path: Path, damage: Any, problem: str
) -> None:
    run_dir = tmp_path / "r"
    _saved_run(run_dir, (2, 4))
    damage(run_dir / "checkpoints" / "step-4")
    point = find_resume_point(_resolved(run_dir), "torch-state")
    assert point is not None and point.step == 2 and point.folder.name == "step-2"
    assert any(problem in note and "resuming from step-2" in note for note in point.notes), point.notes
    finish_resume(point)  # after the load: the damaged one is set aside, out of the way of pruning
    assert [s for s, _ in complete_checkpoints(run_dir)] == [2]
    assert (run_dir / "checkpoints" / f"step-4{DAMAGED_SUFFIX}").is_dir()


def _set_manifest_step(folder: Path, step: int) -> None:
    """The manifest of `folder` made to name another step (a checkpoint renamed or copied over another)."""
    manifest = json.loads((folder / MANIFEST).read_text())
    (folder / MANIFEST).write_text(json.dumps({**manifest, "step": step}))


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_when_no_checkpoint_verifies_nothing_is_resumed(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    _saved_run(run_dir, (2,))
    (run_dir / "checkpoints" / "step-2" / "state.pt").unlink()
    with pytest.raises(ResumeError, match=r"no checkpoint in .* verifies \(step-2: state.pt is missing\)"):
        find_resume_point(_resolved(run_dir), "torch-state")


def test_a_trajectory_changing_config_change_is_refused_with_the_diff_and_the_override(
    tmp_path: Path,
) -> None:
    run_dir = tmp_path / "r"
    _saved_run(run_dir, (2,))
    changed = _resolved(run_dir, "optimizer.lr=0.5", "batch.global_batch_size=8", "logging.log_every=2")
    with pytest.raises(ResumeError) as info:
        find_resume_point(changed, "torch-state")
    text = str(info.value)
    assert "optimizer.lr: 0.0002 -> 0.5" in text and "batch.global_batch_size: 4 -> 8" in text
    assert "checkpoint.allow_changes=[batch.global_batch_size,optimizer.lr]" in text
    assert "log_every" not in text  # logging cannot change the trajectory
    accepted = _resolved(
        run_dir,
        "optimizer.lr=0.5",
        "batch.micro_batch_size=1",
        "logging.log_every=2",
        "checkpoint.allow_changes=[optimizer]",
    )
    point = find_resume_point(accepted, "torch-state")
    assert point is not None and point.step == 2
    assert "changed: optimizer.lr: 0.0002 -> 0.5 (accepted by checkpoint.allow_changes)" in point.notes
    assert "changed: batch.micro_batch_size: 2 -> 1" in point.notes
    assert "changed: logging.log_every: 1 -> 2" in point.notes


def test_a_checkpoint_of_another_config_file_is_another_run_never_a_change_to_accept(tmp_path: Path) -> None:
    """demo-chat.yaml resumed into the demo's folder (both resolved to one run_name) was offered
    checkpoint.allow_changes=[...]: a run launched from another config file is refused as another run's."""
    run_dir = tmp_path / "r"
    strategy = _strategy()
    plan = new_run_plan(_resolved(run_dir))
    record = checkpoint_record(plan, strategy.checkpoint_format, "configs/demo.yaml")
    assert record["config_file"] == "demo.yaml"
    ckpt = Checkpointer(strategy, run_dir, CheckpointSection(), max_steps=10, record=record)
    _train_one_step(strategy)
    ckpt.save(1)
    same = "/elsewhere/demo.yaml"  # the file, by another path
    assert find_resume_point(_resolved(run_dir), "torch-state", same) is not None
    assert find_resume_point(_resolved(run_dir), "torch-state") is not None  # a config built in code
    allowed = _resolved(run_dir, "checkpoint.allow_changes=[data.path,train.max_steps]")
    with pytest.raises(ResumeError) as err:
        find_resume_point(allowed, "torch-state", "configs/demo-chat.yaml")
    text = str(err.value)
    assert f"{run_dir} is another run: its checkpoint step-1 was saved by a launch of demo.yaml" in text
    assert "this launch reads demo-chat.yaml" in text and "not a change to accept" in text
    assert "allow_changes=[" not in text and f"it would write {tmp_path / 'r-2'}" in text


def test_the_data_is_compared_by_content_not_by_path(tmp_path: Path) -> None:
    data = tmp_path / "data.jsonl"
    data.write_text(Path(DEMO_DATA).read_text())
    run_dir = tmp_path / "r"
    _saved_run(run_dir, (2,), f"data.path={data}")
    assert find_resume_point(_resolved(run_dir), "torch-state") is not None  # same bytes, other path
    data.write_text(data.read_text().replace("a", "b", 1))
    with pytest.raises(ResumeError, match=r"data.path: the content of .* changed"):
        find_resume_point(_resolved(run_dir, f"data.path={data}"), "torch-state")


def test_auto_keys_and_computation_choices_resume_while_a_held_out_fraction_does_not(tmp_path: Path) -> None:
    # The saved config states what `auto` resolved to (`data.format` as detected); a launch that still says
    # auto resumes. The loss implementation, the token budget's split, the cache and evaluation cannot move
    # the trajectory; holding out a fraction of the training data does.
    run_dir = tmp_path / "r"
    _saved_run(run_dir, (2,), "data.format=prompt_response")
    same = _resolved(run_dir, "data.format=auto", "train.cross_entropy=unchunked", "data.cache=false")
    assert find_resume_point(same, "torch-state") is not None
    with pytest.raises(ResumeError, match=r"data.format: prompt_response -> text"):
        find_resume_point(_resolved(run_dir, "data.format=text"), "torch-state")
    with pytest.raises(ResumeError, match=r"data.eval_split: null -> 0.1"):
        find_resume_point(_resolved(run_dir, "data.eval_split=0.1"), "torch-state")


def test_a_saved_dataset_folder_is_fingerprinted_by_its_files(tmp_path: Path) -> None:
    folder = tmp_path / "saved"
    (folder / "train").mkdir(parents=True)
    (folder / "train" / "data-00000-of-00001.arrow").write_bytes(b"rows")
    (folder / "dataset_dict.json").write_text('{"splits": ["train"]}')
    first = data_fingerprint(folder)
    assert first["size"] == 4 + len('{"splits": ["train"]}') and first["sha256"]
    (folder / "train" / "data-00000-of-00001.arrow").write_bytes(b"rowz")
    assert data_fingerprint(folder)["sha256"] != first["sha256"]
    assert (
        data_fingerprint("org/some-hub-dataset")["sha256"] is None
    )  # nothing local to hash: the id is compared


def test_a_checkpoint_loads_only_into_the_engine_layout_that_wrote_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    _saved_run(run_dir, (2,))
    with pytest.raises(ResumeError, match=r"written by the torch-state engine and this launch runs fsdp-dcp"):
        find_resume_point(_resolved(run_dir), "fsdp-dcp")


def _settle(resolved: ResolvedConfig) -> RunPlan:
    """The run plan after rank 0's run-directory decision (one rank: no process group)."""
    strategy = SimpleNamespace(
        rank=0,
        broadcast_object=lambda obj: obj,
        wait_for_rank0=lambda what: None,
        checkpoint_format="torch-state",
    )
    decision = settle_run_dir(resolved, strategy)  # type: ignore[arg-type]
    return make_run_plan(resolved, render_spec(resolved), decision)


def test_resume_modes_and_the_run_directory(tmp_path: Path) -> None:
    run_dir = tmp_path / "r"
    # true: nothing to resume is an error that says why; auto: start at step 0 in that directory.
    with pytest.raises(ResumeError, match=r"checkpoint.resume = true, but .*/r does not exist"):
        _settle(_resolved(run_dir, "checkpoint.resume=true"))
    auto = _settle(_resolved(run_dir, "checkpoint.resume=auto"))
    assert auto.run_dir == run_dir and auto.resume is None
    (run_dir / "checkpoints" / "step-3.tmp").mkdir(parents=True)
    with pytest.raises(
        ResumeError, match=r"holds no complete checkpoint \(only an interrupted save: step-3.tmp\)"
    ):
        _settle(_resolved(run_dir, "checkpoint.resume=true"))
    # false: a directory that holds a run is never reused; resume finds the run whatever the world size.
    _saved_run(run_dir, (2,))
    fresh = _settle(_resolved(run_dir))
    assert fresh.run_dir == tmp_path / "r-2" and fresh.config.run_name == "r-2" and fresh.resume is None
    # ... and the run's plan says so, never a silent -2.
    assert f"{run_dir} already holds a run, so this new run writes {tmp_path / 'r-2'}" in fresh.notes[-1]
    resumed = _settle(_resolved(run_dir, "checkpoint.resume=true"))
    assert resumed.run_dir == run_dir and resumed.resume is not None
    assert not any("already holds" in note for note in resumed.notes)
    assert (resumed.resume.step, resumed.resume.world_size) == (2, 1)


def test_the_default_run_name_does_not_depend_on_the_world_size() -> None:
    names = {
        resolve(
            load_config(
                None, [f"data.path={DEMO_DATA}", "batch.global_batch_size=8", "batch.micro_batch_size=2"]
            ),
            n,
        ).config.run_name
        for n in (1, 2, 4)
    }
    assert names == {"tiny-llama-lora-zero2-bf16-g8"}


def test_run_dir_problems_are_refused_before_anything_loads(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ConfigError, match=r"a-file' is a file, not a folder"):
        _settle(_resolved(tmp_path / "a-file" / "r"))
    monkeypatch.setattr(os, "access", lambda path, mode: False)  # (root may write anywhere)
    with pytest.raises(ConfigError, match=r"is not writable by this user"):
        _settle(_resolved(tmp_path / "r"))


@pytest.mark.parametrize("mode", ["auto", "true", "false"])
def test_a_run_name_that_leaves_output_dir_is_refused_and_writes_nothing_there(
    tmp_path: Path, mode: str
) -> None:
    # Another run's files beside output_dir: `run_name=../victim` must never reach them.
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / "config.yaml").write_text("mine\n")
    (victim / "metrics.jsonl").write_text('{"step": 1}\n')
    before = sorted((p.name, p.read_text()) for p in victim.iterdir())
    resolved = _resolved(tmp_path / "runs" / "r", f"checkpoint.resume={mode}")
    # A config that slipped past the schema (built in Python without validation) is refused by the joins.
    resolved.config.__dict__["run_name"] = "../victim"
    with pytest.raises(ConfigError, match=r"run_name = '\.\./victim': must be one folder name"):
        _settle(resolved)
    with pytest.raises(ConfigError, match=r"run_name = '\.\./victim'"):
        make_run_plan(resolved, render_spec(resolved))
    raw = load_config(
        None, [f"data.path={DEMO_DATA}", "batch.global_batch_size=4", "batch.micro_batch_size=2"]
    )
    raw.__dict__["run_name"] = "../victim"
    with pytest.raises(ConfigError, match=r"run_name = '\.\./victim'"):
        resolve(raw, 1)
    assert sorted((p.name, p.read_text()) for p in victim.iterdir()) == before
    assert not (tmp_path / "runs").exists()


def test_a_run_dir_whose_lock_another_run_holds_is_refused_as_that_not_as_a_full_disk(tmp_path: Path) -> None:
    # Two launches with one run_name: the first holds the lock; the second must say so (EAGAIN from flock is
    # not a full disk), with the holder's pid, and the fix.
    run_dir = tmp_path / "r"
    run_dir.mkdir()
    with (run_dir / LOCK_FILE).open("a+") as held:
        fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        held.write("4242\n")
        held.flush()
        checkpointer = SimpleNamespace(strategy=SimpleNamespace(rank=0, broadcast_object=lambda obj: obj))
        with pytest.raises(ResumeError) as err:
            restore(checkpointer, None, run_dir)  # type: ignore[arg-type]
    text = str(err.value)
    assert f"another zerofit run (pid 4242) holds {run_dir}'s lock ({LOCK_FILE})" in text
    assert "wait for it to finish, or give this run another run_name" in text
    assert "free space" not in text and "Resource temporarily unavailable" not in text


def test_an_unknown_allowed_change_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"'optimizer.lrr' is not a config key.*did you mean 'optimizer.lr'"
    ):
        _resolved(tmp_path / "r", "checkpoint.allow_changes=[optimizer.lrr]")


def test_metrics_are_rewound_to_the_resumed_step_and_a_torn_line_is_repaired(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "loss": 1.0 / s} for s in (1, 2, 3, 4)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 5, "lo')  # killed mid-write
    assert rewind_metrics(path, 3) == rows[:3]
    assert [json.loads(line) for line in path.read_text().splitlines()] == rows[:3]
    assert rewind_metrics(tmp_path / "absent.jsonl", 3) == []


def test_the_summary_of_a_resumed_run_covers_the_whole_run(tmp_path: Path) -> None:
    from zerofit.metrics.summary import RunFilesSink

    sink = RunFilesSink(tmp_path)
    sink.resume_from([{"step": 1, "loss": 3.0, "tokens": 10}, {"step": 2, "loss": 2.0, "tokens": 10}], 100.0)
    sink.log(3, {"loss": 1.0, "tokens": 10})
    sink.close()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["steps"], summary["tokens_seen"], summary["final_loss"], summary["min_loss"]) == (
        3,
        30,
        1.0,
        1.0,
    )
    assert summary["wall_s"] >= 100.0


def test_a_checkpoint_from_before_a_key_existed_resumes_as_that_keys_default(tmp_path: Path) -> None:
    # A zerofit from before `train.early_stopping` / `train.epochs` saved configs without them; they read as
    # their defaults (which reproduce the old behaviour), not as `(unset) -> 0` trajectory changes.
    run_dir = tmp_path / "r"
    _saved_run(run_dir, (2,))
    manifest_path = run_dir / "checkpoints" / "step-2" / MANIFEST
    manifest = json.loads(manifest_path.read_text())
    del manifest["config"]["train"]["early_stopping"], manifest["config"]["train"]["epochs"]
    manifest_path.write_text(json.dumps(manifest))
    point = find_resume_point(_resolved(run_dir), "torch-state")
    assert point is not None and point.step == 2
    # ...but a launch that sets such a key to something else than its default is a change.
    with pytest.raises(ResumeError, match=r"train.early_stopping.patience: 0 -> 3"):
        find_resume_point(
            _resolved(
                run_dir, "train.early_stopping.patience=3", "data.eval_split=0.1", "eval.every_steps=1"
            ),
            "torch-state",
        )
