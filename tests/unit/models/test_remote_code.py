"""A saved config is data: nothing from a run or export folder runs code, and nothing outside it is read.

A run folder whose `config.yaml` says `model.trust_remote_code: true` and points `model.name_or_path` at a
base model whose config.json has an `auto_map` to a `modeling_evil.py` (which writes a marker file when
imported): `zerofit export --merge`, `zerofit generate RUN` and `zerofit generate EXPORT` refuse it in one
paragraph naming the file and `--trust-remote-code`, and the marker never appears; with the flag (the user's
own opt-in) the config the loads read says so, and an export carrying the code says it. A folder with an `auto_map` loaded without
trust_remote_code is one paragraph, not transformers' traceback; a saved `data.chat_template` file outside
the run folder is never read.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import yaml

from config_helpers import DEMO_DATA, config
from zerofit.cli import main as cli
from zerofit.core.errors import ConfigError
from zerofit.export import EXPORT_INFO, export_run
from zerofit.models.build import build_model, load_tokenizer
from zerofit.models.tiny import ensure_tiny_model
from zerofit.trained import RunConfig, WeightsSource, read_run_config
from zerofit.trained.generate import load_generator
from zerofit.trained.model import load_base, tokenizer_for

MODELING = """from pathlib import Path
Path({marker!r}).write_text("ran")
from transformers import LlamaForCausalLM


class EvilForCausalLM(LlamaForCausalLM):
    pass
"""
RAW = {
    "data": {"path": DEMO_DATA},
    "distributed": {"strategy": "single"},
    "train": {"precision": "fp32"},
    "lora": {"enabled": True, "r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]},
}


def _evil_base(folder: Path, marker: Path, model_type: str = "llama") -> Path:
    """A copy of tiny-llama whose config.json maps AutoModelForCausalLM to a file that writes `marker`."""
    shutil.copytree(ensure_tiny_model("tiny-llama", 0), folder)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["auto_map"] = {"AutoModelForCausalLM": "modeling_evil.EvilForCausalLM"}
    if model_type != "llama":  # types transformers has no class of its own for: only the code loads them
        cfg["model_type"] = model_type
        cfg["auto_map"]["AutoConfig"] = "modeling_evil.EvilConfig"
        tok = json.loads((folder / "tokenizer_config.json").read_text())
        tok["tokenizer_class"] = "EvilTokenizerFast"
        tok["auto_map"] = {"AutoTokenizer": [None, "modeling_evil.EvilTokenizerFast"]}
        (folder / "tokenizer_config.json").write_text(json.dumps(tok))
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "modeling_evil.py").write_text(MODELING.format(marker=str(marker)))
    return folder


@pytest.fixture(scope="module")
def adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LoRA adapter of tiny-llama (RAW's LoRA) with its tokenizer: a run's final export `adapter/`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from zerofit.models.build import lora_spec
    from zerofit.models.lora import apply_lora

    folder = tmp_path_factory.mktemp("adapter") / "adapter"
    base = ensure_tiny_model("tiny-llama", 0)
    model = apply_lora(AutoModelForCausalLM.from_pretrained(base), lora_spec(config(RAW)))
    model.save_pretrained(folder)
    AutoTokenizer.from_pretrained(base).save_pretrained(folder)
    return folder


def _run(root: Path, adapter: Path, marker: Path) -> Path:
    """A run folder `root/run`: the adapter as its final export, the evil base in `run/base`, and a config.yaml
    edited to trust remote code and load that base."""
    run = root / "run"
    shutil.copytree(adapter, run / "adapter")
    base = _evil_base(run / "base", marker)
    raw = config(RAW, model={"name_or_path": str(base), "trust_remote_code": True}).model_dump(mode="json")
    (run / "config.yaml").write_text(yaml.safe_dump(raw))
    return run


def _export_folder(run: Path, out: Path) -> Path:
    """An adapter export of `run` as `zerofit export` writes one (zerofit_export.json carries the config)."""
    shutil.copytree(run / "adapter", out)
    info = {"kind": "adapter", "config": yaml.safe_load((run / "config.yaml").read_text())}
    (out / EXPORT_INFO).write_text(json.dumps(info))
    return out


def _refused(message: str, file: Path) -> None:
    assert "\n" not in message.removeprefix("Invalid configuration: ")
    for needle in (f"{file.parent} would run its code", str(file), "--trust-remote-code", "nothing ran"):
        assert needle in message, needle


def test_export_and_generate_refuse_a_saved_trust_remote_code(
    tmp_path: Path, adapter: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "pwned"
    run = _run(tmp_path, adapter, marker)
    evil = run / "base" / "modeling_evil.py"
    export = _export_folder(run, tmp_path / "export")
    with pytest.raises(ConfigError) as err:
        export_run(run, tmp_path / "merged", merge=True)
    _refused(str(err.value), evil)
    with pytest.raises(ConfigError) as err:
        load_generator(export)
    _refused(str(err.value), evil)
    capsys.readouterr()
    for argv in (
        ["export", str(run), "--merge", "--out", str(tmp_path / "merged")],
        ["export", str(run), "--format", "gguf", "--out", str(tmp_path / "gguf")],
        ["generate", str(run), "--prompt", "hi", "--max-new-tokens", "1"],
        ["generate", str(export), "--prompt", "hi", "--max-new-tokens", "1"],
    ):
        assert cli(argv) == 2, argv
        _refused(capsys.readouterr().err.split("error: ", 1)[1].strip(), evil)
    assert not marker.exists()
    assert not (tmp_path / "merged").exists() and not (tmp_path / "gguf").exists()


def test_a_saved_trust_remote_code_without_an_auto_map_loads_normally(tmp_path: Path, adapter: Path) -> None:
    run = _run(tmp_path, adapter, tmp_path / "pwned")
    (run / "base" / "config.json").write_text(
        json.dumps(
            {
                k: v
                for k, v in json.loads((run / "base" / "config.json").read_text()).items()
                if k != "auto_map"
            }
        )
    )
    assert export_run(run, tmp_path / "merged", merge=True).kind == "merged"  # nothing would run: no refusal
    assert not (tmp_path / "merged" / "modeling_evil.py").exists()


def test_the_users_flag_is_the_opt_in_and_a_merged_export_says_it_carries_the_code(
    tmp_path: Path, adapter: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Cheap: the flag settles the config the loads read (the load itself is transformers' own), and an export
    folder holding the base's code (as a merged export with the flag does) is named when written and refused
    by `generate` without the flag. (Run by hand: `zerofit export RUN --merge --trust-remote-code` imports it.)"""
    from zerofit.commands.export import _note_remote_code

    marker = tmp_path / "pwned"
    run = _run(tmp_path, adapter, marker)
    assert read_run_config(run, trust_remote_code=True).config.model.trust_remote_code is True
    merged = tmp_path / "merged"
    shutil.copytree(run / "base", merged)  # what save_pretrained of the remote-code model writes
    (merged / EXPORT_INFO).write_text(
        json.dumps({"kind": "merged", "config": yaml.safe_load((run / "config.yaml").read_text())})
    )
    _note_remote_code(merged)
    assert f"carries the base model's own code ({merged / 'modeling_evil.py'})" in capsys.readouterr().out
    with pytest.raises(ConfigError) as err:
        load_generator(merged)
    _refused(str(err.value), merged / "modeling_evil.py")
    assert not marker.exists()


def _load_base(cfg: Any) -> Any:
    """`load_base` as export / generate call it."""
    import torch

    return load_base(cfg, torch.float32, "cpu")


def test_an_auto_map_folder_without_trust_remote_code_is_one_paragraph(tmp_path: Path) -> None:
    base = _evil_base(tmp_path / "custom", tmp_path / "pwned", model_type="evil-llama")
    cfg = config(RAW, model={"name_or_path": str(base)}, lora={"enabled": False})
    for load in (
        load_tokenizer,
        build_model,
        _load_base,
        lambda _: load_generator(base),
    ):  # a run's loads, generate's
        with pytest.raises(ConfigError) as err:
            load(cfg)
        message = str(err.value)
        assert "\n" not in message.removeprefix("Invalid configuration: ")
        for needle in (
            f"{base} needs Python code of its own",
            f"{base}/modeling_evil.py (config.json auto_map AutoModelForCausalLM = 'modeling_evil.EvilForCausalLM')",
            "tokenizer_config.json auto_map AutoTokenizer = 'modeling_evil.EvilTokenizerFast'",
            "model.trust_remote_code: true",
            "--trust-remote-code",
        ):
            assert needle in message, needle
    assert not (tmp_path / "pwned").exists()


def test_generate_of_a_model_folder_runs_its_code_only_with_the_users_flag(tmp_path: Path) -> None:
    """`zerofit generate FOLDER`: a model folder named on the command line loads with transformers' own class
    (its auto_map ignored, nothing imported) unless the user passes --trust-remote-code."""
    marker = tmp_path / "pwned"
    base = _evil_base(tmp_path / "custom", marker)
    assert type(load_generator(base).model).__name__ == "LlamaForCausalLM" and not marker.exists()
    assert type(load_generator(base, trust_remote_code=True).model).__name__ == "EvilForCausalLM"
    assert marker.exists()


def test_remote_code_lists_model_and_tokenizer_auto_maps(tmp_path: Path) -> None:
    from zerofit.models.hub import remote_code

    (tmp_path / "config.json").write_text(json.dumps({"auto_map": {"AutoConfig": "configuration_x.XConfig"}}))
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({"auto_map": {"AutoTokenizer": [None, "other/repo--tokenization_x.XTokenizerFast"]}})
    )
    assert [code.file for code in remote_code(str(tmp_path))] == [
        f"{tmp_path}/configuration_x.py",
        "other/repo/tokenization_x.py",
    ]
    assert remote_code(str(tmp_path / "absent")) == []


@pytest.mark.parametrize("final_export", [False, True])
def test_a_saved_chat_template_file_is_read_only_inside_the_run(
    tmp_path: Path, adapter: Path, final_export: bool
) -> None:
    secret = tmp_path / "secret.txt"
    secret.write_text("root:x:0:0:secret")
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    source = WeightsSource("adapter", adapter, 4) if final_export else None
    cfg: Any = config(RAW, model={"name_or_path": "tiny-llama"})

    def tokenizer(value: str) -> Any:
        return tokenizer_for(RunConfig(run_dir, cfg, {"data": {"chat_template": value}}), source)

    if final_export:  # the run's own tokenizer carries the template training used; the file is not read
        assert tokenizer(str(secret)).chat_template == load_tokenizer(cfg).chat_template
    else:
        with pytest.raises(ConfigError, match=r"names a file outside the run folder.*copy the template into"):
            tokenizer(str(secret))
    (run_dir / "chat.jinja").write_text("{{ messages }}")
    assert tokenizer("chat.jinja").chat_template == "{{ messages }}"
    assert tokenizer(str(run_dir / "chat.jinja")).chat_template == "{{ messages }}"
    assert tokenizer("{{ text }}").chat_template == "{{ text }}"


PLANTED = """from pathlib import Path
Path({marker!r}).write_text("imported")


def reward(prompts, completions, columns):
    return [0.0] * len(completions)
"""


def test_a_run_folders_reward_function_is_never_imported_by_export_generate_or_plan(
    tmp_path: Path, adapter: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GRPO run's config.yaml names `module:function` rewards; only a launch with that config imports them.
    The module is planted on sys.path (where an import would find it) and writes a marker when imported."""
    import sys

    marker = tmp_path / "imported"
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / "planted_reward_zf.py").write_text(PLANTED.format(marker=str(marker)))
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    run = tmp_path / "run"
    shutil.copytree(adapter, run / "adapter")
    rl = {
        "rewards": [{"function": "planted_reward_zf:reward"}, {"function": "exact_match"}],
        "num_generations": 2,  # the global batch is G x prompts_per_step completions (the batch rule)
        "prompts_per_step": 2,
    }
    batch = {"global_batch_size": 4, "micro_batch_size": 2}  # a saved config.yaml holds the resolved split
    raw = config(RAW, train={"objective": "grpo"}, rl=rl, batch=batch).model_dump(mode="json")
    (run / "config.yaml").write_text(yaml.safe_dump(raw))
    export = _export_folder(run, tmp_path / "export")
    for argv in (
        ["export", str(run), "--merge", "--out", str(tmp_path / "merged")],
        ["generate", str(run), "--prompt", "hi", "--max-new-tokens", "1"],
        ["generate", str(export), "--prompt", "hi", "--max-new-tokens", "1"],
        ["plan", "--config", str(run / "config.yaml")],
    ):
        assert cli(argv) == 0, (argv, capsys.readouterr().err)
    assert "planted_reward_zf:reward" in capsys.readouterr().out  # the plan names it, without importing it
    assert not marker.exists() and "planted_reward_zf" not in sys.modules
