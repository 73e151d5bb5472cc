"""Heavy optional libraries are imported only by the code that uses them.

Every launch pays its processes' start-up: measured on a 2-core CPU machine, importing peft costs ~1.5 CPU-s
(it imports bitsandbytes, which imports torch's inductor), DeepSpeed ~0.2-2 CPU-s (more without torch
loaded), matplotlib ~0.7 and wandb ~0.3, in every rank. A run that does not use them (no LoRA: no peft;
FSDP, DDP or one process: no DeepSpeed; W&B off: no wandb; training: no plotting; nothing quantized: no
bitsandbytes) must not pay for them, so each is imported inside the function that needs it, and hidden
from libraries that would import it only to look for its types (peft's bitsandbytes layers, accelerate's
DeepSpeed engine in `save_pretrained`: `zerofit.core.lazy`; a LoRA build measured 7.7 -> 6.3 CPU-s). These
checks run in a fresh interpreter, whose `sys.modules` holds only what the code under test imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# Imported only where used: DeepSpeed by its strategy, peft by LoRA, bitsandbytes by quantization and 8-bit
# optimizers, wandb by its sink and reader, matplotlib by the plots, liger-kernel by its kernels, gguf by the
# GGUF export, mlflow and tensorboard by their sinks (and compare's TensorBoard reader), lm-eval by `zerofit eval`
# and `eval.harness`.
LAZY = (
    "deepspeed",
    "peft",
    "bitsandbytes",
    "wandb",
    "matplotlib",
    "liger_kernel",
    "gguf",
    "mlflow",
    "tensorboard",
    "lm_eval",
)

EVERY_MODULE = """
import importlib, json, pkgutil, sys
import zerofit
for info in pkgutil.walk_packages(zerofit.__path__, "zerofit."):
    importlib.import_module(info.name)
print(json.dumps(sorted(sys.modules)))
"""

# What a plain (no LoRA, no quantization) one-process run builds before it trains: config, engine spec, run
# plan, strategy, tokenizer and model; the run's own modules imported as `zerofit.recipe.run` imports them;
# then the model saved as its final export saves it.
PLAIN_RUN = """
import json, sys
sys.path.insert(0, sys.argv[1])
from config_helpers import DEMO_DATA, new_run_plan
from zerofit.config import load_config
from zerofit.resolution import resolve
from zerofit.engine_spec import render_spec
from zerofit.strategies import build_strategy
from zerofit.models.build import build_model, load_tokenizer
import zerofit.recipe.assembly, zerofit.recipe.run, zerofit.loop.train, zerofit.strategies.fsdp, zerofit.strategies.ddp

overrides = ["distributed.strategy=single", "lora.enabled=false", "train.precision=fp32",
             "batch.global_batch_size=1", "batch.micro_batch_size=1", f"data.path={DEMO_DATA}"]
resolved = resolve(load_config(None, overrides), 1)
new_run_plan(resolved)
build_strategy(render_spec(resolved))
model = build_model(resolved.config, tokenizer=load_tokenizer(resolved.config))
# and its final export's writer (transformers' save_pretrained, which unwraps the model through accelerate)
import tempfile
from pathlib import Path
from zerofit.checkpoint.final_export import save_pretrained_here
save_pretrained_here(model.model, Path(tempfile.mkdtemp()))
print(json.dumps(sorted(sys.modules)))
# Then the same run with LoRA: peft now, and still no bitsandbytes (nothing is quantized).
lora = resolve(load_config(None, [*overrides[:1], "lora.enabled=true", *overrides[2:]]), 1)
build_model(lora.config, tokenizer=load_tokenizer(lora.config))
print(json.dumps(sorted(sys.modules)))
"""


def _modules_after(code: str, *args: str) -> list[set[str]]:
    """The top-level packages in `sys.modules` each time a fresh interpreter running `code` printed them."""
    proc = subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    printed = [line for line in proc.stdout.splitlines() if line.startswith("[")]
    return [{name.split(".")[0] for name in json.loads(line)} for line in printed]


@pytest.fixture(scope="module")
def plain_then_lora() -> list[set[str]]:
    """The packages loaded after a plain run's build, then after the same run's build with LoRA."""
    return _modules_after(PLAIN_RUN, str(REPO / "tests"))


def test_importing_every_zerofit_module_imports_no_optional_library() -> None:
    (loaded,) = _modules_after(EVERY_MODULE)
    assert "zerofit" in loaded and "torch" in loaded  # the walk really imported the package
    assert sorted(loaded & set(LAZY)) == []


@pytest.mark.slow
def test_a_plain_run_builds_and_saves_without_deepspeed_peft_or_bitsandbytes(
    plain_then_lora: list[set[str]],
) -> None:
    loaded = plain_then_lora[0]
    assert "transformers" in loaded  # the model really was built
    assert sorted(loaded & set(LAZY)) == []


@pytest.mark.slow
def test_a_lora_run_imports_peft_without_bitsandbytes(plain_then_lora: list[set[str]]) -> None:
    # peft's own import pulls in bitsandbytes (and with it torch's inductor) unless zerofit hides it:
    # nothing is quantized, so no process of a LoRA run pays for it.
    loaded = plain_then_lora[1]
    assert "peft" in loaded  # the adapters really were applied
    assert sorted(loaded & set(LAZY)) == ["peft"]


# A one-process ZeRO-2 run through the API: DeepSpeed's reductions import its Muon kernels, whose
# `torch.compile` decoration would import inductor's compiler (`torch._inductor.compile_fx` and its code
# generators, ~160 modules, ~0.7 CPU-s a rank) for kernels never called. (transformers' masking imports
# torch._dynamo, which imports the light `torch._inductor` package itself: that part every run pays.)
ZERO_RUN = """
import json, sys, tempfile
import zerofit
zerofit.train("configs/demo.yaml", distributed__preset="zero2", lora__enabled=False, train__max_steps=2,
              train__precision="fp32", batch__global_batch_size=2, batch__micro_batch_size=2,
              checkpoint__save_final=False, logging__wandb__mode="disabled", output_dir=tempfile.mkdtemp())
print(json.dumps(sorted(sys.modules)))
"""


@pytest.mark.slow
def test_a_zero_run_leaves_inductors_compiler_unloaded() -> None:
    proc = subprocess.run(
        [sys.executable, "-c", ZERO_RUN], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    loaded = set(json.loads(proc.stdout.splitlines()[-1]))
    assert "deepspeed.runtime.zero.muon.original_muon" in loaded  # the reduction really ran its Muon check
    assert "torch._inductor.compile_fx" not in loaded


# A plain one-process run (no LoRA, one process, W&B off) imports what its start-up uses and not the code of
# other objectives, engines or readers: no torch.distributed.checkpoint (FSDP2's checkpoints, ~0.1 CPU-s), no
# run reader (`zerofit.trained`: a teacher's or an export's), teacher, RL, distillation, precomputed reference
# or `eval.harness` code. And transformers indexes its `models` package once, not twice (`import
# transformers` and `transformers.models` each read ~1,100 files; `zerofit.core.transformers_import`), with the
# same lazy namespace as transformers builds alone; its object-detection losses import scipy.optimize when
# their matcher first runs, not when any model loads, and match as scipy does. (benchmarks/startup.py
# measures what each saves.)
PLAIN_TRAIN = """
import json, sys, tempfile
import zerofit
zerofit.train("configs/demo.yaml", distributed__strategy="single", lora__enabled=False, train__max_steps=1,
              train__precision="fp32", batch__global_batch_size=2, batch__micro_batch_size=2,
              checkpoint__save_final=False, logging__wandb__mode="disabled", output_dir=tempfile.mkdtemp())
from transformers.utils import import_utils
from zerofit.core.transformers_import import FOLDER_KEYED
index = import_utils.create_import_structure_from_path
keyed = getattr(index, FOLDER_KEYED, False)
hits = (index.__wrapped__ if keyed else index).cache_info().hits
modules = sorted(sys.modules)
import importlib, pkgutil, numpy, scipy.optimize, transformers.loss
cost, matched = numpy.random.default_rng(0).random((6, 9)), {}
for info in pkgutil.iter_modules(transformers.loss.__path__, "transformers.loss."):
    solve = getattr(importlib.import_module(info.name), "linear_sum_assignment", None)
    if solve is not None:  # the losses' matcher answers as scipy's own
        matched[info.name] = [a.tolist() for a in solve(cost)] == [a.tolist() for a in scipy.optimize.linear_sum_assignment(cost)]
print(json.dumps({"modules": modules, "keyed": keyed, "index_hits": hits, "models": MODELS(), "matched": matched}))
"""
MODELS_NAMESPACE = """
def plain(x):  # dicts, sets and lists (built from sets: in hash order) of names as JSON, in one order
    if isinstance(x, dict):
        return sorted(([plain(k), plain(v)] for k, v in x.items()), key=json.dumps)
    if isinstance(x, (set, frozenset, list, tuple)):
        return sorted((plain(v) for v in x), key=json.dumps)
    return x
def MODELS():
    m = sys.modules["transformers.models"]
    return plain([m._import_structure, m._class_to_module, m._object_missing_backend, sorted(m.__all__), m._modules])
"""
TRANSFORMERS_ALONE = """
import json, sys
import transformers.models
print(json.dumps({"models": MODELS()}))
"""
NOT_IN_A_PLAIN_RUN = ("torch.distributed.checkpoint", "zerofit.trained", "zerofit.recipe.teacher", "zerofit.recipe.rl",
                      "zerofit.recipe.distill", "zerofit.loop.reference", "zerofit.harness", "scipy")  # fmt: skip


def _last_json(code: str) -> dict[str, object]:
    """The last line a fresh interpreter running `code` (with `MODELS_NAMESPACE`) printed, as JSON."""
    source = "import json, sys" + MODELS_NAMESPACE + code
    proc = subprocess.run(
        [sys.executable, "-c", source], capture_output=True, text=True, cwd=REPO, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


@pytest.mark.slow
def test_a_plain_run_imports_no_other_engines_readers_objectives_or_scipy_and_indexes_transformers_models_once() -> (
    None
):
    run = _last_json(PLAIN_TRAIN)
    modules = run["modules"]
    assert isinstance(modules, list) and "zerofit.loop.train" in modules  # the run really trained
    assert [m for m in modules if m.startswith(NOT_IN_A_PLAIN_RUN)] == []
    assert run["keyed"] and run["index_hits"] >= 1  # transformers.models: the first index's answer
    assert run["models"] == _last_json(TRANSFORMERS_ALONE)["models"]  # the namespace transformers builds
    matched = run["matched"]
    assert isinstance(matched, dict) and len(matched) >= 5 and all(matched.values()), matched


# bitsandbytes' CPU backend asks the Hub's `kernels` package for a kernel when it is imported and logs
# "Failed to load CPU gemm_4bit_forward from kernels-community ... Set trust_remote_code=True" when it cannot
# have it; a QLoRA build on CPU imports bitsandbytes, after transformers' modeling stack has imported
# `kernels`. The import site itself keeps the message out, with a filter for that import alone.
QLORA_BUILD = """
import logging, sys
sys.path.insert(0, sys.argv[1])
logging.basicConfig(level=logging.WARNING)
from config_helpers import DEMO_DATA
from zerofit.config import load_config
from zerofit.models.build import build_model, load_tokenizer
cfg = load_config(None, ["quantization.load_in=4bit", "train.precision=fp32", f"data.path={DEMO_DATA}"])
build_model(cfg, tokenizer=load_tokenizer(cfg))
assert "bitsandbytes" in sys.modules
assert logging.getLogger("bitsandbytes.backends.cpu.ops").filters == []  # the filter was for that import only
"""


@pytest.mark.slow
def test_a_qlora_build_keeps_bitsandbytes_hub_kernel_message_out() -> None:
    from zerofit.core.lazy import BNB_HUB_KERNEL_MESSAGE

    proc = _script_ok(QLORA_BUILD)
    output = proc.stdout + proc.stderr
    assert BNB_HUB_KERNEL_MESSAGE not in output and "trust_remote_code" not in output
    assert "kernels-community" not in output  # no Hub kernel fetched or trust-checked either


# `zerofit plan` is what a user runs over and over while choosing a recipe: even its first plan of a model (an
# empty planner cache) reads the shapes, LoRA counts, LoRA report and FSDP block class of a dense,
# mixture-of-experts (Mixtral, Qwen-MoE) or Qwen2-VL / Qwen2.5-VL model from the config alone
# (`zerofit.catalogue.layouts`, `zerofit.planner.config_shapes`), and must not pay for peft, bitsandbytes,
# DeepSpeed, torch's compilers or transformers' modeling stack (~4 CPU-s of imports against ~2 for torch
# itself; benchmarks/plan_speed.py). A family without that rule builds the model on the meta device once and
# keeps the answer in `$ZEROFIT_CACHE/planner/` (`zerofit.core.derived_cache`); every later plan reads it.
PLAN_CONFIGS = (
    "configs/demo.yaml",
    "configs/qwen25-7b-grpo-qlora-3090.yaml",
    "configs/llama31-8b-qlora-longctx-3090.yaml",
    "configs/qwen15-moe-qlora-2x3090-fsdp.yaml",
    "configs/demo-vlm.yaml",
    "configs/demo-vlm-colours.yaml",
    "configs/qwen25-vl-7b-lora-3090.yaml",
    "configs/qwen25-vl-7b-qlora-3090.yaml",
)
PLANS = """
import contextlib, io, json, sys
from zerofit.cli import main
if sys.argv[1] == "built":  # no family read from its config: every answer from the meta-device build
    import zerofit.catalogue.layouts as layouts
    layouts._FAMILIES.clear()
    layouts.VISION_BLOCKS.clear()
out = io.StringIO()
for config in sys.argv[2:]:
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        assert main(["plan", "--config", config]) == 0
print(json.dumps({"output": out.getvalue(), "modules": sorted(sys.modules)}))
"""
NOT_IN_A_PLAN = ("peft", "bitsandbytes", "deepspeed", "torch._inductor", "torch._dynamo", "transformers.masking_utils",
                 "transformers.integrations.hub_kernels", "transformers.modeling_utils")  # fmt: skip


def _plans(cache: Path, how: str = "config") -> dict[str, object]:
    """The output and `sys.modules` of a fresh interpreter planning every `PLAN_CONFIGS` with the planner's cache
    at `cache`; `how`: `config` (the families `zerofit.catalogue.layouts` reads, from their configs) or `built` (every answer from a meta build
    or the cache, as for a family without the config rule)."""
    env = {**os.environ, "ZEROFIT_CACHE": str(cache)}
    proc = subprocess.run(
        [sys.executable, "-c", PLANS, how, *PLAN_CONFIGS],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.splitlines()[-1])


def _heavy(modules: object) -> list[str]:
    """The modules of `NOT_IN_A_PLAN`, transformers' model packages and modeling modules among `modules`."""
    assert isinstance(modules, list)
    return [
        m
        for m in modules
        if m.startswith(NOT_IN_A_PLAN) or m.startswith("transformers.models.") or ".modeling_" in m
    ]


@pytest.mark.slow
def test_a_cold_plan_imports_no_peft_bitsandbytes_or_modeling_stack_and_prints_the_built_plan(
    tmp_path: Path,
) -> None:
    built = _plans(
        tmp_path / "built", "built"
    )  # an empty cache: the meta-device builds, peft (bitsandbytes hidden)
    assert "peft" in built["modules"]  # that plan really built and adapted the models
    cold = _plans(tmp_path / "cold")  # an empty cache, the configs read alone
    assert cold["output"] == built["output"]  # the same plans, byte for byte
    assert _heavy(cold["modules"]) == []
    assert not (tmp_path / "cold" / "planner").exists()  # nothing to keep: no build was needed
    again = _plans(tmp_path / "built", "built")  # the meta-build answers, read back from the cache
    assert again["output"] == built["output"] and _heavy(again["modules"]) == []
    # bitsandbytes' "Failed to load CPU gemm_4bit_forward from kernels-community" never reaches a plan
    assert "gemm_4bit" not in built["output"] + cold["output"] + again["output"]


# A plan of a config that turns the trackers on checks they are installed without importing them (~1.5 CPU-s
# each): only the run's rank 0 imports them, when it opens its sinks.
TRACKED_PLAN = """
import contextlib, io, json, sys
from zerofit.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    assert main(["plan", "--config", "configs/demo.yaml", "logging.tensorboard=true", "logging.mlflow.enabled=true"]) == 0
print(json.dumps(sorted(sys.modules)))
"""


@pytest.mark.slow
def test_a_plan_with_the_trackers_on_imports_neither() -> None:
    (loaded,) = _modules_after(TRACKED_PLAN)
    assert "zerofit" in loaded and sorted(loaded & {"mlflow", "tensorboard"}) == []


# Commands that read configs, presets or finished runs: nothing of a model, so not even torch.
LIGHT_COMMANDS = """
import contextlib, io, json, sys, tempfile
from pathlib import Path
sys.path.insert(0, sys.argv[1])
from metrics_fixtures import make_run
from zerofit.cli import main
root = Path(tempfile.mkdtemp())
runs = [str(make_run(root, "a")), str(make_run(root, "b", micro=2))]
with contextlib.redirect_stdout(io.StringIO()):
    for argv in (["--help"], ["studio", "--help"], ["eval", "--help"], ["presets"], ["compare", *runs, "--out", str(root / "out")]):
        try:
            code = main(argv)
        except SystemExit as exc:  # --help
            code = exc.code
        assert code == 0, argv
assert (root / "out" / "compare.json").is_file()  # compare really read both runs
print(json.dumps(sorted(sys.modules)))
"""


def test_help_presets_and_compare_import_no_torch() -> None:
    (loaded,) = _modules_after(LIGHT_COMMANDS, str(REPO / "tests" / "unit"))
    assert "zerofit" in loaded and "yaml" in loaded
    # (compare draws its plots with matplotlib: the one optional library it uses; the studio's web stack is
    # imported by `zerofit studio` alone, not by its --help)
    heavy = {
        "torch",
        "transformers",
        "peft",
        "bitsandbytes",
        "deepspeed",
        "fastapi",
        "uvicorn",
        "starlette",
        "lm_eval",
    }
    assert sorted(loaded & heavy) == []


# A process that used zerofit goes on loading models with transformers' own defaults (HF's Trainer, TRL, a
# notebook after `zerofit.train`): zerofit changes no answer transformers caches for the process, such as
# whether the Hub's `kernels` package is installed (`from_pretrained`'s default `use_kernels=True` needs it).
AFTER_ZEROFIT = """
import sys
sys.path.insert(0, sys.argv[1])
from config_helpers import DEMO_DATA
from zerofit.config import load_config
from zerofit.core.messages import quiet_libraries
from zerofit.models.build import build_model, load_tokenizer, resolve_model_path
cfg = load_config(None, ["lora.enabled=false", "train.precision=fp32", f"data.path={DEMO_DATA}"])
quiet_libraries()
build_model(cfg, tokenizer=load_tokenizer(cfg))
from transformers import AutoModelForCausalLM
AutoModelForCausalLM.from_pretrained(resolve_model_path(cfg))
"""


@pytest.mark.slow
def test_transformers_defaults_still_load_a_model_after_zerofit_built_one() -> None:
    _script_ok(AFTER_ZEROFIT)


def _script_ok(source: str) -> subprocess.CompletedProcess[str]:
    """`source` run by a fresh interpreter from the repository root (tests/ its first argument); exit 0."""
    proc = subprocess.run(
        [sys.executable, "-c", source, str(REPO / "tests")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
