"""Loading a model fails as one paragraph: a hub id that cannot be fetched (unreachable, gated, misspelled:
with a did-you-mean, what trains offline and what can only be planned, and no command that cannot work, the
same from `zerofit plan`, a launch and `zerofit generate`), and `lora.target_modules` entries that name no
module — refused before any weight is loaded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from config_helpers import config
from zerofit.catalogue.models import SMOLLM2
from zerofit.core.errors import ConfigError, LaunchError
from zerofit.models.build import build_model, load_tokenizer
from zerofit.models.hub import hub_problem

REPO = Path(__file__).resolve().parents[3]
NAME = "meta-llama/Llama-2-7b-hf"


@pytest.mark.parametrize(
    ("text", "kind", "needles"),
    [
        (
            "You are trying to access a gated repo.\nMake sure to have access to it at https://huggingface.co/x.",
            LaunchError,
            (
                "gated model",
                "accept its licence at https://huggingface.co/meta-llama/Llama-2-7b-hf",
                "HF_TOKEN",
            ),
        ),
        (
            f"{NAME} is not a local folder and is not a valid model identifier listed on 'https://huggingface.co/models'",
            ConfigError,
            ("neither a local folder nor a model on the Hugging Face hub", "check the spelling"),
        ),
        (
            "We couldn't connect to 'https://huggingface.co' to load the files, and couldn't find them in the cached files.",
            LaunchError,
            ("cannot be reached", "not in the local cache", f"hf download {NAME}"),
        ),
    ],
)
def test_hub_failures_become_one_paragraph(text: str, kind: type, needles: tuple[str, ...]) -> None:
    problem = hub_problem(NAME, "weights", OSError(text))
    assert isinstance(problem, kind)
    message = str(problem)
    assert "\n" not in message.removeprefix("Invalid configuration: ")
    assert f"model.name_or_path = {NAME!r}" in message
    for needle in needles:
        assert needle in message, needle


def test_other_errors_and_local_folders_keep_their_traceback(tmp_path: Path) -> None:
    assert hub_problem(NAME, "weights", RuntimeError("a bug")) is None
    assert hub_problem(NAME, "weights", OSError("disk on fire")) is None
    assert (
        hub_problem(str(tmp_path), "weights", OSError("We couldn't connect to 'https://huggingface.co'"))
        is None
    )


def test_an_unreachable_hub_id_is_refused_when_its_tokenizer_loads() -> None:
    # The test environment is offline (HF_HUB_OFFLINE=1, see conftest.py) and this id is not cached.
    with pytest.raises(LaunchError, match="offline mode is on") as err:
        load_tokenizer(config({"model": {"name_or_path": "zerofit-tests/no-such-model"}}))
    assert "zerofit-tests/no-such-model" in str(err.value)
    assert "trains offline here: the built-in models tiny-llama" in str(err.value)


def _no_retrying_fetch(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """transformers' fetches (which retry an unreachable hub with backoff for ~25 s) record their calls."""
    import transformers

    calls: list[str] = []

    def fetch(name: str, *args: Any, **kwargs: Any) -> Any:
        calls.append(name)
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files")

    for cls in (transformers.AutoConfig, transformers.AutoTokenizer):
        monkeypatch.setattr(cls, "from_pretrained", fetch)
    return calls


@pytest.mark.parametrize("offline", [True, False])
def test_an_unknown_or_unreachable_hub_id_is_said_at_once_with_the_known_ids(
    monkeypatch: pytest.MonkeyPatch, offline: bool
) -> None:
    """`meta-llama/Llama-3-8B` (no such id) without network: one paragraph before any retrying fetch, naming
    the close catalogued id and the ids that work without network; with network, the hub's 404 says it."""
    import httpx
    import huggingface_hub
    from huggingface_hub.errors import RepositoryNotFoundError

    from zerofit.catalogue.models import model_config_dict

    asked: list[str] = []

    def model_info(self: Any, name: str, **kwargs: Any) -> Any:
        asked.append(name)
        assert kwargs["timeout"] <= 5
        if offline:
            raise httpx.ConnectError("[Errno -2] Name or service not known")
        request = httpx.Request("GET", f"https://huggingface.co/api/models/{name}")
        raise RepositoryNotFoundError("404 Client Error", response=httpx.Response(404, request=request))

    monkeypatch.setattr(huggingface_hub.HfApi, "model_info", model_info)
    monkeypatch.setattr(huggingface_hub, "is_offline_mode", lambda: False)
    calls = _no_retrying_fetch(monkeypatch)
    name = "meta-llama/Llama-3-8B"
    kind = LaunchError if offline else ConfigError
    for load in (
        lambda: model_config_dict(name),
        lambda: load_tokenizer(config({"model": {"name_or_path": name}})),
    ):
        with pytest.raises(kind) as err:
            load()
        text = str(err.value)
        assert (
            "cannot be reached from here (ConnectError" if offline else "nor a model on the Hugging Face hub"
        ) in text
        assert "did you mean meta-llama/Llama-3.1-8B (" in text and " or meta-llama/Meta-Llama-3-8B (" in text
        assert "Trains offline here: the built-in models tiny-llama" in text
        # a download of the catalogued ids it suggests, where there is none here; never of the misspelling
        assert ("`hf download meta-llama/Llama-3.1-8B` where there is network" in text) == offline
        assert f"hf download {name}" not in text
    assert calls == [] and asked == [name, name]


def test_an_unreachable_hub_id_at_launch_is_one_paragraph(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "launchers" / "launch_finetune.py"),
            "--config",
            str(REPO / "configs" / "demo.yaml"),
            "distributed.strategy=single",
            f"output_dir={tmp_path}",
            f"model.name_or_path={NAME}",
            f"data.path={REPO / 'data' / 'demo.jsonl'}",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("zerofit (rank 0): error: model.name_or_path = "), lines
    assert not any(tmp_path.iterdir())  # nothing written


@pytest.mark.parametrize(
    ("name", "guess"),
    [
        (
            "HuggingFaceTB/SmolLM2-135M-Instructt",
            "did you mean smollm2-135m-instruct (built in: HuggingFaceTB/SmolLM2-135M-Instruct, trains offline)? ",
        ),
        ("smollm2-135m", "did you mean smollm2-135m-instruct (built in, trains offline)? "),
    ],
)
def test_a_misspelled_model_gets_a_did_you_mean_and_no_impossible_command(
    name: str, guess: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Offline (the tests' HF_HUB_OFFLINE=1): the built-in it resembles, what trains offline apart from what
    can only be planned (catalogued ids without weights, gated ones among them), and no `hf download` of a
    name that cannot be downloaded; `zerofit plan`, a launch's load and `zerofit generate` say the same."""
    from zerofit.cli import main

    monkeypatch.chdir(REPO)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(LaunchError) as err:
        load_tokenizer(config({"model": {"name_or_path": name}}))  # what a launch loads first
    said = [str(err.value)]
    for argv in (
        ["plan", "--config", "configs/demo-smollm2.yaml", f"model.name_or_path={name}"],
        ["generate", name, "--prompt", "What is the capital of France?"],
    ):
        assert main(argv) == 2
        said.append(capsys.readouterr().err.strip().split(": error: ", 1)[1])
    assert said[0] == said[1] == said[2]
    text = said[0]
    assert "\n" not in text and guess in text and "hf download" not in text
    offline, plan_only = text.split(guess)[1].split("; plan only")
    assert offline.startswith("Trains offline here: the built-in models tiny-llama") and SMOLLM2 in offline
    assert "meta-llama/Llama-2-7b-hf" in plan_only and "meta-llama/Llama-2-7b-hf" not in offline


def test_cached_models_train_offline_and_are_suggested(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A model in the local Hugging Face cache (config.json and safetensors weights) is listed with what trains
    offline and suggested for a misspelling of it; a catalogued id that is cached leaves the plan-only list."""
    from huggingface_hub import constants

    from zerofit.catalogue.hub_ids import check_hub_id
    from zerofit.catalogue.models import known_models

    for repo in ("someone/my-model", "Qwen/Qwen2.5-7B", "someone/config-only"):
        snapshot = tmp_path / f"models--{repo.replace('/', '--')}" / "snapshots" / ("0" * 40)
        snapshot.mkdir(parents=True)
        (snapshot / "config.json").write_text("{}")
        if repo != "someone/config-only":  # no weights: nothing to train
            (snapshot / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    with pytest.raises(LaunchError) as err:
        check_hub_id("someone/my-modle", known_models())
    text = str(err.value)
    assert "did you mean someone/my-model (in the Hugging Face cache, trains offline)? " in text
    plan_only = text.split("; plan only")[1]
    assert "and from the Hugging Face cache Qwen/Qwen2.5-7B, someone/my-model;" in text
    assert "Qwen/Qwen2.5-7B" not in plan_only and "config-only" not in text


def _no_weight_load(monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("weights were loaded before the LoRA targets were checked")

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", refuse)


def test_lora_targets_that_name_no_module_are_refused_before_the_load(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _no_weight_load(monkeypatch)
    cfg = config({"seed": 0, "lora": {"target_modules": ["q_proj", "v_porj", "attn"]}})
    with pytest.raises(ConfigError) as err:
        build_model(cfg)
    message = str(err.value)
    assert "'v_porj', 'attn' name no module of LlamaForCausalLM" in message
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"):
        assert name in message.split("the module names that exist are:")[1]
    assert "lora.target_modules=all-linear" in message


def test_lora_targets_that_exist_pass_the_check() -> None:
    built = build_model(config({"seed": 0, "lora": {"target_modules": ["self_attn.q_proj", "lm_head"]}}))
    trainable = {n for n, p in built.model.named_parameters() if p.requires_grad}
    assert len(trainable) == 2 * 2 + 2 and any("lm_head" in n for n in trainable)


def test_zerofit_plan_refuses_a_bad_target_too(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from zerofit.cli import main

    monkeypatch.chdir(REPO)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert main(["plan", "--config", "configs/demo.yaml", "lora.target_modules=[q_proj,qkv_proj]"]) == 2
    assert "'qkv_proj' names no module of" in capsys.readouterr().err
