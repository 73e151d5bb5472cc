"""`zerofit presets` and `zerofit plan`, in-process and as the installed console script; and the wheel."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from zerofit.catalogue.presets import list_presets
from zerofit.cli import main
from zerofit.config import load_config
from zerofit.engine_spec import render_spec
from zerofit.resolution import resolve

REPO = Path(__file__).resolve().parents[2]
DEMO = "configs/demo.yaml"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("WORLD_SIZE", raising=False)


def _zerofit(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """Run the installed `zerofit` console script (the same one `pip install` puts on PATH)."""
    script = Path(sys.executable).with_name("zerofit")
    full_env = {k: v for k, v in os.environ.items() if k != "WORLD_SIZE"} | (env or {})
    return subprocess.run(
        [str(script), *args], capture_output=True, text=True, cwd=REPO, env=full_env, check=False, timeout=120
    )


def _json_out(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(list(argv)) == 0
    return json.loads(capsys.readouterr().out)


# ----------------------------------------------------------------------------------------- presets


def test_presets_json_lists_every_preset(capsys: pytest.CaptureFixture[str]) -> None:
    rows = _json_out(capsys, "presets", "--json")
    assert [r["name"] for r in rows] == sorted(list_presets())
    assert {r["strategy"] for r in rows} == {"deepspeed", "fsdp"}
    assert all(r["description"] for r in rows)
    assert {r["name"]: r["strategy"] for r in rows}["zero3_offload"] == "deepspeed"


def test_presets_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["presets"]) == 0
    out = capsys.readouterr().out
    for name in list_presets():
        assert name in out


# ----------------------------------------------------------------------------------------- plan


def test_plan_json_is_the_exact_engine_config(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    out_dir = f"output_dir={tmp_path}"  # no earlier run there: the plan's run_dir is the resolved one
    report = _json_out(
        capsys, "plan", "--config", DEMO, "--world-size", "2", "--json", "batch.micro_batch_size=2", out_dir
    )
    assert report["batch"]["global_batch_size"] == 16
    assert (report["batch"]["micro_batch_size"], report["batch"]["grad_accum_steps"]) == (2, 4)
    assert report["batch"]["dp_size"] == 2
    assert report["batch"]["max_tokens_per_optimizer_step"] == 16 * 64
    assert "upper bound" in report["batch"]["tokens_note"]
    resolved = resolve(load_config(DEMO, ["batch.micro_batch_size=2", out_dir]), 2)
    assert report["engine_config"] == render_spec(resolved).to_json()
    assert report["engine_config"]["gradient_accumulation_steps"] == 4
    assert report["run_dir"] == str(resolved.run_dir)
    assert report["engine_config_file"] == str(resolved.run_dir / "ds_config.json")
    assert report["config"]["batch"]["grad_accum_steps"] == 4  # the resolved config, nothing left to derive
    assert report["config"] == resolved.config.model_dump(mode="json")


def test_plan_names_the_run_directory_a_new_run_will_take(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """A new run beside a taken name writes `NAME-2`: the plan says that folder (and why), not NAME."""
    taken = tmp_path / "runs" / "r"
    taken.mkdir(parents=True)
    (taken / "config.yaml").write_text("run_name: r\n")
    args = ["plan", "--config", DEMO, f"output_dir={tmp_path / 'runs'}", "run_name=r"]
    report = _json_out(capsys, *args, "--json")
    assert report["run_dir"] == str(tmp_path / "runs" / "r-2")
    assert report["engine_config_file"] == str(tmp_path / "runs" / "r-2" / "ds_config.json")
    assert main(args) == 0
    # Compared without whitespace: rich folds a path longer than the line (pytest-xdist's tmp paths are longer).
    text = "".join(capsys.readouterr().out.split())
    assert "".join(f"run directory: {tmp_path / 'runs' / 'r-2'}".split()) in text
    assert (
        "".join(f"{taken} already holds a run, so this new run writes {tmp_path / 'runs' / 'r-2'}".split())
        in text
    )
    assert "checkpoint.resume=true" in text
    # A resume continues the named folder.
    resumed = _json_out(capsys, *args, "checkpoint.resume=true", "--json")
    assert resumed["run_dir"] == str(taken) and not any("already holds" in n for n in resumed["notes"])


def test_plan_fsdp_writes_fsdp_json(capsys: pytest.CaptureFixture[str]) -> None:
    report = _json_out(
        capsys,
        "plan",
        "--config",
        DEMO,
        "--json",
        "distributed.strategy=fsdp",
        "distributed.preset=fsdp_offload",
    )
    assert report["engine_config_file"].endswith("fsdp.json")
    assert report["engine_config"]["cpu_offload"] is True


def test_plan_world_size_defaults_to_env_then_one(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _json_out(capsys, "plan", "--config", DEMO, "--json")["batch"]["dp_size"] == 1
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert _json_out(capsys, "plan", "--config", DEMO, "--json")["batch"]["dp_size"] == 4
    # An explicit flag wins over the environment.
    assert _json_out(capsys, "plan", "--config", DEMO, "--json", "--world-size", "2")["batch"]["dp_size"] == 2


def test_plan_text_shows_every_factor_and_the_engine_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--config", DEMO, "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "global 16 = micro 4 x accum 2 x dp 2" in out
    for word in ("global_batch_size", "micro_batch_size", "grad_accum_steps", "dp_size", "upper bound"):
        assert word in out
    assert "ds_config.json" in out and '"train_batch_size": 16' in out


def test_plan_text_names_each_memory_lever_that_is_on(capsys: pytest.CaptureFixture[str]) -> None:
    levers = ["train.tiled_mlp=16", "train.activation_offload=true", "train.lean_norm=true"]
    argv = ["plan", "--config", DEMO, *levers, "train.activation_checkpointing=true"]
    assert main(argv) == 0
    out = " ".join(capsys.readouterr().out.split())  # (rich wraps long lines)
    assert "Memory levers: tiled MLP 16 shards (train.tiled_mlp), activation offload on (" in out
    assert "lean norm on" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["--config", DEMO, "batch.micro_batch_size=2", "--json", "train.max_steps=7", "--world-size", "2"],
        ["batch.micro_batch_size=2", "--config", DEMO, "--json", "--world-size", "2", "train.max_steps=7"],
        ["--json", "batch.micro_batch_size=2", "--world-size", "2", "train.max_steps=7", "--config", DEMO],
    ],
)
def test_plan_takes_overrides_and_flags_in_any_order(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    report = _json_out(capsys, "plan", *argv)
    assert report["batch"]["formula"] == "global 16 = micro 2 x accum 4 x dp 2"
    assert report["config"]["train"]["max_steps"] == 7


def test_a_stray_flag_is_still_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--config", DEMO, "a.b=1", "--jsn"])
    assert exit_info.value.code == 2
    assert "unrecognized arguments: --jsn" in capsys.readouterr().err


def test_plan_says_when_one_override_switches_the_engine(capsys: pytest.CaptureFixture[str]) -> None:
    report = _json_out(
        capsys, "plan", "--config", DEMO, "--json", "--world-size", "2", "distributed.strategy=fsdp"
    )
    assert (report["strategy"], report["preset"]) == ("fsdp", "fsdp")
    assert report["engine_config_file"].endswith("fsdp.json")
    assert any("replaces the config file's deepspeed preset 'zero2'" in note for note in report["notes"])
    assert main(["plan", "--config", DEMO, "--world-size", "1", "distributed.strategy=single"]) == 0
    assert "Note: distributed.strategy = 'single' replaces" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["batch.global_bach_size=4"], "did you mean 'batch.global_batch_size'?"),
        (["distributed.preset=zero9"], "not a known preset"),
        (["batch.micro_batch_size=0"], "micro_batch_size must be a positive integer, got 0"),
        (["train.bf16=true", "train.fp16=true"], "train.precision"),
    ],
)
def test_plan_user_errors_exit_non_zero(
    capsys: pytest.CaptureFixture[str], args: list[str], needle: str
) -> None:
    assert main(["plan", "--config", DEMO, *args]) != 0
    err = capsys.readouterr().err
    assert err.startswith("zerofit plan: error: ") and needle in err


def test_bad_world_size_env(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "two")
    assert main(["plan", "--config", DEMO]) != 0
    assert "WORLD_SIZE = 'two'" in capsys.readouterr().err


def test_acceptance_indivisible_split_via_console_script() -> None:
    proc = _zerofit(
        "plan",
        "--config",
        DEMO,
        "--world-size",
        "8",
        "batch.global_batch_size=64",
        "batch.micro_batch_size=3",
    )
    assert proc.returncode != 0
    assert "Traceback" not in proc.stderr + proc.stdout
    msg = proc.stderr
    for text in ("global_batch_size=64", "micro_batch_size=3", "dp_size=8", "1, 2, 4, 8"):
        assert text in msg


def test_conflicting_foreign_ds_config_via_console_script(tmp_path: Path) -> None:
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"train_batch_size": 32, "train_micro_batch_size_per_gpu": "auto"}))
    proc = _zerofit("plan", "--config", DEMO, f"distributed.ds_config={ds}", env={"WORLD_SIZE": "2"})
    assert proc.returncode != 0 and "Traceback" not in proc.stderr
    assert "train_batch_size = 32" in proc.stderr and "train_batch_size = 16" in proc.stderr


@pytest.mark.slow
def test_console_script_json_output() -> None:
    proc = _zerofit("plan", "--config", DEMO, "--json", env={"WORLD_SIZE": "2"})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["engine_config"]["train_batch_size"] == 16


# ----------------------------------------------------------------------------------------- packaging


@pytest.mark.slow
def test_wheel_ships_the_presets(tmp_path: Path) -> None:
    """`ds_configs/` and the shipped lm-eval tasks' data must be inside the wheel, not only in the checkout."""
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(REPO)],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = tmp_path.glob("zerofit-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    shipped = {f"zerofit/ds_configs/{p.name}" for p in (REPO / "ds_configs").glob("*.json")}
    assert len(shipped) == len(list_presets()) >= 8
    assert shipped <= names
    assert "zerofit/engine_spec/render.py" in names and "zerofit/config/batching.py" in names
    # the lm-eval tasks zerofit ships, with the data files they read offline (`zerofit.harness.shipped`)
    tasks = {f"zerofit/harness/tasks/{p.name}" for p in (REPO / "src/zerofit/harness/tasks").glob("*.yaml")}
    data = {f"zerofit/harness/data/{n}" for n in ("demo_smollm2_heldout.jsonl", "demo_smollm2_facts.jsonl")}
    assert len(tasks) == 3 and tasks | data | {"zerofit/harness/data/demo_grpo_heldout.jsonl"} <= names


# ----------------------------------------------------------------------------------------- export, generate


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (["export", "runs/does-not-exist", "--out", "/tmp/zerofit-never-written"], "does-not-exist"),
        (
            ["generate", "runs/does-not-exist", "--prompt", "hi", "--max-new-tokens", "0"],
            "--max-new-tokens 0",
        ),
    ],
)
def test_export_and_generate_errors_are_the_commands_own(
    capsys: pytest.CaptureFixture[str], argv: list[str], needle: str
) -> None:
    """A run folder and flags are not a configuration: the paragraph must not say "Invalid configuration"."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"zerofit {argv[0]}: error: ") and needle in err
    assert "Invalid configuration" not in err
