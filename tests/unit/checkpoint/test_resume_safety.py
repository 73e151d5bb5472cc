"""Resume and export in one process: a planted pickle runs nothing (every kind of file zerofit reads), changes a
resume accepted are trained with (the logged lr is the new config's schedule), resume says what it passes over
and why, a resume continues the exact count of tokens seen, and a reader survives pruning of the checkpoint it
reads."""

from __future__ import annotations

import hashlib
import importlib
import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

import zerofit
from config_helpers import DEMO_DATA, new_run_plan
from zerofit.checkpoint import MANIFEST, checkpoint_record
from zerofit.checkpoint.resume import find_resume_point
from zerofit.config import load_config
from zerofit.core.errors import ResumeError, RunFinished, ZerofitError
from zerofit.export import export_run
from zerofit.resolution import ResolvedConfig, resolve
from zerofit.strategies.optim import lr_multiplier
from zerofit.trained import checkpoints as trained_checkpoints
from zerofit.trained import read_checkpoint
from zerofit.trained.generate import load_generator

LR, STEPS = 3e-3, 4
BASE: dict[str, Any] = {
    "seed": 1,
    "batch": {"global_batch_size": 4, "micro_batch_size": 2},
    "distributed": {"strategy": "single"},
    "train": {"max_steps": STEPS, "precision": "fp32"},
    "optimizer": {"lr": LR},
    "scheduler": {"name": "cosine", "warmup_steps": 1},
    "lora": {"dropout": 0.0},
    "data": {"path": DEMO_DATA, "max_seq_len": 64},
    "checkpoint": {"every_steps": 2, "keep_last": 5},
    "logging": {"console": False, "wandb": {"mode": "disabled"}},
}


class _Planted:
    """An object whose unpickling runs a command: what an attacker puts into a checkpoint file."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, (f"touch {self.marker}",))


def _plant(folder: Path, name: str, marker: Path) -> None:
    """Replace `folder/name` by a malicious pickle and fix the manifest up so that it verifies."""
    path = folder / name
    torch.save({"module": {}, "payload": _Planted(marker)}, path)
    manifest = json.loads((folder / MANIFEST).read_text())
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    manifest["files"][name] = {"size": path.stat().st_size, "sha256": digest}
    (folder / MANIFEST).write_text(json.dumps(manifest))


def _train(root: Path, name: str, **overrides: Any) -> Path:
    cfg = {**BASE, "output_dir": str(root), "run_name": name}
    zerofit.train(cfg, **overrides)
    return root / name


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A finished single-process LoRA run with checkpoints at steps 2 and 4 (the one run this module trains
    from scratch; tests copy it)."""
    return _train(tmp_path_factory.mktemp("resume-safety"), "base")


def _copy(run: Path, tmp_path: Path, name: str = "copy") -> Path:
    target = tmp_path / name
    shutil.copytree(run, target, ignore=shutil.ignore_patterns(".zerofit.lock"))
    return target


def _resume(run_dir: Path, *overrides: str) -> zerofit.api.RunResult:
    items = {key: yaml.safe_load(value) for key, value in (o.split("=", 1) for o in overrides)}
    return zerofit.train(
        {**BASE, "output_dir": str(run_dir.parent), "run_name": run_dir.name},
        **{"checkpoint.resume": True, **items},
    )


# --- accepted changes are applied --------------------------------------------------------------------


def test_an_accepted_lr_and_schedule_length_are_trained_with(run: Path, tmp_path: Path) -> None:
    run_dir = _copy(run, tmp_path)
    _resume(
        run_dir,
        "optimizer.lr=0.001",
        "train.max_steps=8",
        "optimizer.weight_decay=0.1",
        "optimizer.betas=[0.8,0.95]",
        "checkpoint.allow_changes=[optimizer,train.max_steps]",
    )
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9))
    old = lr_multiplier("cosine", 1, STEPS, 0.0)
    new = lr_multiplier("cosine", 1, 8, 0.0)
    assert [r["lr"] for r in rows[:STEPS]] == pytest.approx([LR * old(s) for s in range(STEPS)], rel=1e-9)
    assert [r["lr"] for r in rows[STEPS:]] == pytest.approx(
        [1e-3 * new(s) for s in range(STEPS, 8)], rel=1e-9
    )
    # The optimizer trained (and saved) with the new hyperparameters, not the loaded ones.
    state = torch.load(run_dir / "checkpoints" / "step-8" / "state.pt", weights_only=True)
    groups = state["optimizer"]["param_groups"]
    assert [g["weight_decay"] for g in groups] == [0.1]  # LoRA: matrices only, the decay group
    assert all(tuple(g["betas"]) == (0.8, 0.95) for g in groups)


def test_a_change_the_checkpoint_fixes_is_refused_even_when_allowed(run: Path, tmp_path: Path) -> None:
    run_dir = _copy(run, tmp_path)
    (run_dir / "checkpoints" / "step-4").rename(run_dir / "checkpoints" / "step-4.moved")
    with pytest.raises(ResumeError, match=r"cannot take these changes.*\n  lora.r: 16 -> 8") as err:
        _resume(run_dir, "lora.r=8", "checkpoint.allow_changes=[lora.r]")
    assert "Resume with the saved values" in str(err.value)


# --- resume says what it does ------------------------------------------------------------------------


def _resolved(run_dir: Path, *overrides: str) -> ResolvedConfig:
    items = [f"{k}={v}" for k, v in _flat(BASE)] + [
        f"output_dir={run_dir.parent}",
        f"run_name={run_dir.name}",
        "checkpoint.resume=true",
        *overrides,
    ]
    return resolve(load_config(None, items), 1)


def _flat(raw: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for key, value in raw.items():
        if isinstance(value, dict):
            out += _flat(value, f"{prefix}{key}.")
        else:
            out.append((f"{prefix}{key}", value))
    return out


@pytest.mark.parametrize("how", ["emptied", "manifest deleted"])
def test_a_newest_folder_without_a_manifest_is_reported_not_skipped(
    run: Path, tmp_path: Path, how: str
) -> None:
    run_dir = _copy(run, tmp_path)
    newest = run_dir / "checkpoints" / "step-4"
    if how == "emptied":
        shutil.rmtree(newest)
        newest.mkdir()
    else:
        (newest / MANIFEST).unlink()
    point = find_resume_point(_resolved(run_dir), "torch-state")
    assert point is not None and point.step == 2
    said = "is empty" if how == "emptied" else f"has no {MANIFEST}"
    assert any(
        n.startswith(f"step-4 is damaged (the folder {said}") and "resuming from step-2" in n
        for n in point.notes
    )


def test_a_new_data_path_is_a_move_or_another_run_never_a_change_to_accept(run: Path, tmp_path: Path) -> None:
    """The same content under a new path is a move (said, resumed); other content under a new path makes the
    folder another run's (two configs resolving to one run_name): refused, and no allow_changes offered."""
    run_dir = _copy(run, tmp_path)
    same = tmp_path / "same.jsonl"
    shutil.copy(DEMO_DATA, same)
    longer = ("train.max_steps=6", "checkpoint.allow_changes=[train.max_steps]")
    point = find_resume_point(_resolved(run_dir, f"data.path={same}", *longer), "torch-state")
    assert point is not None
    assert any(f"data.path: {DEMO_DATA} -> {same} (the same content" in n for n in point.notes), point.notes
    other = tmp_path / "other.jsonl"
    other.write_text(Path(DEMO_DATA).read_text().splitlines()[0] + "\n")
    for allowed in ((), ("checkpoint.allow_changes=[train.max_steps,data.path]",)):
        with pytest.raises(ResumeError, match=rf"{run_dir} is another run") as err:
            find_resume_point(_resolved(run_dir, f"data.path={other}", *longer, *allowed), "torch-state")
        text = str(err.value)
        assert f"trained on data.path = {DEMO_DATA}, and this launch trains on {other} (other content" in text
        assert "allow_changes=[" not in text and "not a change to accept" in text
        assert f"it would write {run_dir}-2" in text and f"launch it with data.path={DEMO_DATA}" in text


def test_resuming_at_or_past_max_steps_is_an_error_with_the_fix(run: Path, tmp_path: Path) -> None:
    run_dir = _copy(run, tmp_path)
    with pytest.raises(
        ResumeError, match=r"is at step 4 and train.max_steps is 3.*allow_changes=\[train.max_steps\]"
    ):
        find_resume_point(
            _resolved(run_dir, "train.max_steps=3", "checkpoint.allow_changes=[train.max_steps]"),
            "torch-state",
        )
    with pytest.raises(ResumeError, match=r"has already finished: it has trained all its 4 steps") as err:
        find_resume_point(_resolved(run_dir), "torch-state")
    assert "train.max_steps=N (N > 4) checkpoint.allow_changes=[train.max_steps]" in str(err.value)
    with pytest.raises(RunFinished):  # under resume=auto (a requeue) the launcher exits 0
        find_resume_point(_resolved(run_dir, "checkpoint.resume=auto"), "torch-state")


def test_tokens_seen_counts_unlogged_steps_and_a_resume_continues_it_exactly(
    run: Path, tmp_path: Path
) -> None:
    """logging.log_every=3 over 4 steps logs steps 3 and 4; their `tokens_seen` and summary.json's are the
    label tokens of every step (the fixture's run logs each step of the same batches). Resumed from step 2,
    whose checkpoint no row reaches, the run logs the same values: the count comes from the manifest."""
    every = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    running = [sum(r["tokens"] for r in every[:n]) for n in range(1, STEPS + 1)]
    sparse = _train(tmp_path / "runs", "sparse", **{"logging.log_every": 3})

    def seen(run_dir: Path) -> tuple[list[tuple[int, int]], int]:
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((run_dir / "summary.json").read_text())
        return [(r["step"], r["tokens_seen"]) for r in rows], summary["tokens_seen"]

    expected = ([(3, running[2]), (4, running[3])], running[3])
    assert running[3] > every[2]["tokens"] + every[3]["tokens"] and seen(sparse) == expected
    resumed = _copy(sparse, tmp_path, "resumed")
    shutil.rmtree(resumed / "checkpoints" / "step-4")  # resume from step 2: no row is kept
    _resume(resumed, "logging.log_every=3")
    assert seen(resumed) == expected


# --- a planted pickle runs nothing -------------------------------------------------------------------


def _fake_checkpoint(run_dir: Path, layout: str) -> Path:
    """A checkpoint folder in the FSDP2 or DeepSpeed layout (real `torch.save` / DCP files, a real manifest)
    for the resume and export checks, which look at files before any engine reads them."""
    import torch.distributed.checkpoint as dcp

    from zerofit.checkpoint.manifest import describe_files, listed_files, write_manifest

    folder = run_dir / "checkpoints" / "step-2"
    folder.mkdir(parents=True)
    if layout == "fsdp":
        dcp.save(
            {"model": {"w": torch.ones(2)}, "optim": {"param_groups": [{"lr": 0.1}]}},
            checkpoint_id=str(folder / "dcp"),
            no_dist=True,
        )
        torch.save({"scheduler": {"last_epoch": 2}, "client_state": {"step": 2}}, folder / "extra.pt")
        fmt = "fsdp-dcp"
    else:
        (folder / "engine").mkdir()
        torch.save({"module": {"w": torch.ones(2)}}, folder / "engine" / "mp_rank_00_model_states.pt")
        torch.save(
            {"optimizer_state_dict": {}}, folder / "engine" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
        )
        fmt = "deepspeed-zero2"
    torch.save({"torch": torch.get_rng_state()}, folder / "rng-rank0.pt")
    record = checkpoint_record(new_run_plan(_resolved(run_dir)), fmt)
    write_manifest(
        folder,
        {
            **record,
            "step": 2,
            "world_size": 1,
            "elapsed_s": 1.0,
            "files": describe_files(folder, listed_files(folder)),
        },
    )
    return folder


KINDS = [
    ("single", "state.pt", "zerofit"),
    ("single", "rng-rank0.pt", "zerofit"),
    ("fsdp", "extra.pt", "zerofit"),
    ("deepspeed", "engine/mp_rank_00_model_states.pt", "DeepSpeed"),
    ("deepspeed", "engine/zero_pp_rank_0_mp_rank_00_optim_states.pt", "DeepSpeed"),
]


@pytest.mark.parametrize(("layout", "name", "reader"), KINDS, ids=[k[1] for k in KINDS])
def test_a_planted_pickle_is_refused_on_resume(
    run: Path, tmp_path: Path, layout: str, name: str, reader: str
) -> None:
    marker = tmp_path / "pwned"
    if layout == "single":
        run_dir = _copy(run, tmp_path)
        folder, fmt = run_dir / "checkpoints" / "step-4", "torch-state"
    else:
        run_dir = tmp_path / "r"
        folder, fmt = (
            _fake_checkpoint(run_dir, layout),
            {"fsdp": "fsdp-dcp", "deepspeed": "deepspeed-zero2"}[layout],
        )
    _plant(folder, name, marker)
    if layout == "single":
        with pytest.raises(ResumeError) as err:
            _resume(run_dir, "train.max_steps=6", "checkpoint.allow_changes=[train.max_steps]")
    else:
        with pytest.raises(ResumeError) as err:
            find_resume_point(
                _resolved(run_dir, "train.max_steps=6", "checkpoint.allow_changes=[train.max_steps]"), fmt
            )
    message = str(err.value)
    assert f"{folder / name} (would import posix.system)" in message
    assert "would run code from the file" in message
    opt_in = "checkpoint.trust_pickles=true"
    assert (opt_in in message) == (reader == "DeepSpeed")
    assert not marker.exists()
    if reader == "DeepSpeed":  # the opt-in lets DeepSpeed's reader have it; zerofit's own loads never
        point = find_resume_point(
            _resolved(
                run_dir, "train.max_steps=6", "checkpoint.allow_changes=[train.max_steps]", f"{opt_in}"
            ),
            fmt,
        )
        assert point is not None and point.step == 2


def test_a_planted_dcp_metadata_pickle_is_refused(tmp_path: Path) -> None:
    import pickle

    marker = tmp_path / "pwned"
    folder = _fake_checkpoint(tmp_path / "r", "fsdp")
    (folder / "dcp" / ".metadata").write_bytes(pickle.dumps(_Planted(marker)))
    with pytest.raises(ZerofitError, match=r"\.metadata \(would import posix\.system\).*--trust-pickles"):
        read_checkpoint(folder)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["state.pt", "rng-rank0.pt"])
def test_export_and_generate_run_nothing_from_a_planted_pickle(run: Path, tmp_path: Path, name: str) -> None:
    from zerofit.cli import main

    marker = tmp_path / "pwned"
    run_dir = _copy(run, tmp_path)
    _plant(run_dir / "checkpoints" / "step-2", name, marker)
    with pytest.raises(ZerofitError, match=rf"step-2/{name} \(would import posix.system\)"):
        export_run(run_dir, tmp_path / "out", step=2)
    with pytest.raises(ZerofitError, match="would run code from the file"):
        load_generator(run_dir, step=2)
    assert main(["export", str(run_dir), "--out", str(tmp_path / "out"), "--step", "2"]) != 0
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_export_of_a_planted_deepspeed_file_runs_nothing_unless_trusted(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    folder = _fake_checkpoint(tmp_path / "r", "deepspeed")
    (folder / "engine" / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()  # ZeRO-0: model states only
    manifest = json.loads((folder / MANIFEST).read_text())
    del manifest["files"]["engine/zero_pp_rank_0_mp_rank_00_optim_states.pt"]
    (folder / MANIFEST).write_text(json.dumps(manifest))
    _plant(folder, "engine/mp_rank_00_model_states.pt", marker)
    with pytest.raises(
        ZerofitError, match=r"\(would import posix\.system\).*--trust-pickles lets DeepSpeed unpickle"
    ):
        read_checkpoint(folder)
    assert not marker.exists()


# --- a reader survives pruning -----------------------------------------------------------------------


def test_a_checkpoint_pruned_while_it_is_read_is_read_from_the_snapshot(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir = _copy(run, tmp_path)
    folder = run_dir / "checkpoints" / "step-2"
    expected = read_checkpoint(folder)
    real = trained_checkpoints._read_layout

    def pruned_meanwhile(copy: Path, named: Path) -> dict[str, torch.Tensor]:
        shutil.rmtree(folder)  # a running training's keep_last prunes it right after the snapshot
        return real(copy, named)

    monkeypatch.setattr(trained_checkpoints, "_read_layout", pruned_meanwhile)
    state = read_checkpoint(folder)
    assert state.keys() == expected.keys() and all(torch.equal(state[k], expected[k]) for k in state)
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".step-2.read-")]  # no leftovers
    monkeypatch.undo()
    # Pruned before the snapshot could take it: said plainly, not blamed on the format.
    with pytest.raises(ZerofitError, match=r"was deleted before it could be read: a training still running"):
        read_checkpoint(folder)


def test_generate_during_training_rereads_the_newest_when_the_one_picked_is_pruned(
    run: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from zerofit.trained import model as trained

    run_dir = _copy(run, tmp_path)
    shutil.rmtree(run_dir / "adapter")  # no final export: the newest weights are the newest checkpoint
    real = trained.find_weights
    picks: list[int | None] = []

    def picked_then_pruned(*args: Any) -> Any:
        source = real(*args)
        picks.append(source.step)
        if len(picks) == 1:  # a running training prunes the checkpoint right after the reader picked it
            shutil.rmtree(source.path)
        return source

    monkeypatch.setattr(trained, "find_weights", picked_then_pruned)
    loaded = trained.load_trained(run_dir)
    assert picks == [4, 2] and loaded.source.step == 2


# --- a step that is not finite stops the run --------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    ("when", "what"),
    [
        ("before", "the loss is nan"),  # NaN weights going into step 3: its forward gives a NaN loss
        ("after", "the weights the update wrote are not all finite"),  # step 3's update overflowed
    ],
)
def test_a_step_that_is_not_finite_stops_the_run_and_keeps_the_last_good_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str, what: str
) -> None:
    loop = importlib.import_module(
        "zerofit.loop.train"
    )  # (`zerofit.train` the attribute is the API's function)
    real, calls = loop.train_step, []

    def poisoned(strategy: Any, model: torch.nn.Module, *args: Any) -> loop.StepResult:
        calls.append(1)
        param = next(p for p in model.parameters() if p.requires_grad)
        if len(calls) == 3 and when == "before":
            param.data.fill_(float("nan"))
        result = real(strategy, model, *args)
        if len(calls) == 3 and when == "after":
            param.data.fill_(float("inf"))
        return result

    monkeypatch.setattr(loop, "train_step", poisoned)
    with pytest.raises(zerofit.core.errors.TrainingDiverged) as err:
        _train(tmp_path, "nan", **{"checkpoint.every_steps": 1})
    text, run_dir = str(err.value), tmp_path / "nan"
    assert text.startswith(f"training diverged at step 3: {what}") and "lr " in text
    assert "fp16" in text and "preference.beta" in text
    assert (
        f"{run_dir / 'checkpoints' / 'step-2'} (step 2), is kept" in text and "checkpoint.resume=true" in text
    )
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["step-1", "step-2"]
    assert not (run_dir / "adapter").exists()  # no export of the bad weights
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]  # the bad step's row says what happened
    assert all(r["loss"] is not None for r in rows[:2]) and (rows[2]["loss"] is None) == (when == "before")


@pytest.mark.parametrize("rank", [0, 1])
def test_a_divergence_every_rank_agreed_on_is_said_once_by_rank_0(
    rank: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every rank raises `TrainingDiverged` from the step's all-reduced vote: one paragraph per run, not per
    rank. (A rank's own error, such as a failed write, is still said by that rank.)"""
    from zerofit.core.errors import TrainingDiverged
    from zerofit.recipe import run
    from zerofit.strategies.env import LaunchEnv

    def diverges(*_: Any) -> Any:
        raise TrainingDiverged("training diverged at step 3: the loss is nan")

    monkeypatch.setattr(run, "launch_env", lambda: LaunchEnv(rank, 2, rank, False))
    monkeypatch.setattr(run, "load_config", diverges)
    assert run.main(["--config", "configs/demo.yaml"]) == run.EXIT_USER_ERROR
    err = capsys.readouterr().err
    assert err.count("training diverged at step 3") == (1 if rank == 0 else 0)
