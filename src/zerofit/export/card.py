"""The model card (`README.md`) of an export: what was trained, on what, how, and how it ended.

It states the base model, the data, the training setup (method, split, engine, precision, optimizer), the
weights' source (final export or checkpoint step) and the final train loss and, when the run logged one, the
eval loss; then how to load the folder and the run's full resolved config. Front matter uses the Hugging
Face model-card keys (`base_model`, `library_name`, `tags`) so the hub renders it as such.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

import yaml

from zerofit.catalogue.models import PRETRAINED_HUB_IDS, is_tiny_model
from zerofit.config.rules.model import adaptation_method
from zerofit.trained.checkpoints import WeightsSource
from zerofit.trained.model import RunConfig

if TYPE_CHECKING:
    from zerofit.config.schema import ZerofitConfig
from zerofit.core.run_layout import RunLayout

__all__ = ["losses", "model_card"]


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    try:
        lines = RunLayout(run_dir).metrics.read_text().splitlines()
    except OSError:
        return []
    rows = []
    for line in lines:
        try:
            row = json.loads(line)
        except ValueError:
            continue  # a line cut short by a crash
        if isinstance(row, dict):
            rows.append(row)
    return rows


def _is_eval_loss(key: str) -> bool:
    # Read tolerantly: `eval_loss`, `eval/loss`, `eval.loss` all count.
    return key.startswith("eval") and key.endswith("loss")


def _finite(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and math.isfinite(value) else None


def losses(run_dir: Path, up_to_step: int | None = None) -> dict[str, tuple[int, float]]:
    """`train` and `eval` -> (step, loss) of the last logged row at or before `up_to_step` that has one."""
    found: dict[str, tuple[int, float]] = {}
    for row in _rows(run_dir):
        step = row.get("step")
        if not isinstance(step, int) or (up_to_step is not None and step > up_to_step):
            continue
        loss = _finite(row.get("loss"))
        if loss is not None:
            found["train"] = (step, loss)
        for key, value in row.items():
            if _is_eval_loss(key) and _finite(value) is not None:
                found["eval"] = (step, float(value))
    return found


def _steps(run_dir: Path, source: WeightsSource, planned: int | None) -> str:
    """The optimizer steps the weights were trained for, out of the run's planned count, and how the run
    ended short of it (early stopping, a signal; `summary.json`): never the planned count for steps not
    done (a run that early-stopped at step 7 of 300 trained 7)."""
    if source.step is None:
        return f"{planned} optimizer steps planned"
    done = (
        f"{source.step} of {planned} optimizer steps"
        if planned != source.step
        else f"{planned} optimizer steps"
    )
    try:
        summary = json.loads(RunLayout(run_dir).summary.read_text())
    except (OSError, ValueError):
        summary = {}
    reason = summary.get("stop_reason") if isinstance(summary, dict) else None
    if reason == "early_stopping":
        done += f" (early stopping ended the run after step {summary.get('last_step')})"
    elif isinstance(reason, str) and reason != "max_steps":
        done += f" (the run was stopped by {reason} after step {summary.get('last_step')})"
    return done


def _base_model(run: RunConfig) -> str:
    name = run.config.model.name_or_path
    if is_tiny_model(name):
        return f"{name} (zerofit's built-in random-init model, seed {run.config.seed})"
    if name in PRETRAINED_HUB_IDS:
        return f"{PRETRAINED_HUB_IDS[name]} (zerofit's built-in {name})"
    return name


def _base_model_entry(name: str) -> dict[str, str]:
    """The front matter's base_model: the hub id the weights came from (none for a random-init tiny model)."""
    return {} if is_tiny_model(name) else {"base_model": PRETRAINED_HUB_IDS.get(name, name)}


def _method(cfg: ZerofitConfig) -> str:
    """The adaptation method as the card names it, with the LoRA settings when adapters trained."""
    method = adaptation_method(cfg)
    lora = cfg.lora
    if lora.enabled:
        targets = (
            lora.target_modules if isinstance(lora.target_modules, str) else ", ".join(lora.target_modules)
        )
        method += f" (r {lora.r}, alpha {lora.alpha}, dropout {lora.dropout}, targets: {targets})"
    return method


def _data_description(run: RunConfig) -> str:
    """The training data as the card names it: path, detected format, sequence length, eval source."""
    cfg = run.config
    data = f"`{cfg.data.path}`"
    fmt = run.data_value("format")
    data += f" (format `{fmt}`)" if fmt else ""
    data += f", max_seq_len {cfg.data.max_seq_len}"
    eval_source = run.data_value("eval_path") or run.data_value("eval_split")
    if eval_source:
        data += f"; eval: `{eval_source}`"
    return data


def _load_snippet(kind: str) -> str:
    """The Python that loads the export: peft's auto class for an adapter (base, then adapter), else
    transformers'; the tokenizer from the same folder."""
    if kind == "adapter":
        load = (
            "from peft import AutoPeftModelForCausalLM\nfrom transformers import AutoTokenizer\n\n"
            'model = AutoPeftModelForCausalLM.from_pretrained("<this folder>")  # the base, then the adapter\n'
        )
    else:
        load = (
            "from transformers import AutoModelForCausalLM, AutoTokenizer\n\n"
            'model = AutoModelForCausalLM.from_pretrained("<this folder>")\n'
        )
    return load + 'tokenizer = AutoTokenizer.from_pretrained("<this folder>")\n'


def model_card(
    run: RunConfig, source: WeightsSource, kind: str, dtype: str | None, gguf_file: str | None = None
) -> str:
    """The README.md text for an export of `run` from `source`; `kind` is `adapter`, `merged`, `model` or
    `gguf` (then `dtype` is the GGUF type and `gguf_file` the file's name)."""
    cfg = run.config
    b, t, o, s = cfg.batch, cfg.train, cfg.optimizer, cfg.scheduler
    method = _method(cfg)
    micro, accum = int(b.micro_batch_size or 1), int(b.grad_accum_steps or 1)  # resolved: ints
    dp = int(b.global_batch_size or 0) // (micro * accum)
    split = f"global {b.global_batch_size} = micro {micro} x accum {accum} x dp {dp}"
    engine = cfg.distributed.strategy + (f" / {cfg.distributed.preset}" if cfg.distributed.preset else "")
    data = _data_description(run)
    what = {
        "adapter": "the LoRA adapter only (a peft folder; the base model is loaded separately)",
        "merged": f"the adapter merged into the base model, {dtype} safetensors",
        "model": f"the whole fine-tuned model, {dtype} safetensors",
        "gguf": f"`{gguf_file}`: the {'merged ' if cfg.lora.enabled else ''}model as GGUF ({dtype}) for "
        "llama.cpp, Ollama and LM Studio, and an Ollama `Modelfile`",
    }[kind]
    rows = [
        ("base model", _base_model(run)),
        ("method", method),
        ("data", data),
        (
            "training",
            f"{_steps(run.run_dir, source, t.max_steps)} of {split}, {engine}, {t.precision}, {o.name} "
            f"lr {o.lr:g}, "
            f"{s.name} schedule, warmup {s.warmup_steps}",
        ),
        ("weights", source.describe()),
        ("this folder", what),
    ]
    found = losses(run.run_dir, source.step)
    for name in ("train", "eval"):
        if name in found:
            step, value = found[name]
            rows.append((f"{name} loss", f"{value:.4f} (step {step})"))
    table = "\n".join(f"| {key} | {value} |" for key, value in rows)
    front = yaml.safe_dump(
        {
            **_base_model_entry(cfg.model.name_or_path),
            "library_name": {"adapter": "peft", "gguf": "gguf"}.get(kind, "transformers"),
            "tags": ["zerofit", method.split(" ")[0], *(["gguf"] if kind == "gguf" else [])],
        },
        sort_keys=False,
    )
    if kind == "gguf":
        return _gguf_card(front, cfg.run_name, run, table, str(gguf_file))
    load = _load_snippet(kind)
    config = yaml.safe_dump(run.raw, sort_keys=False)
    return (
        f"---\n{front}---\n\n# {cfg.run_name}\n\nFine-tuned with zerofit; exported by `zerofit export` from "
        f"`{run.run_dir}`.\n\n| | |\n|---|---|\n{table}\n\n## Load it\n\n```python\n{load}```\n\n"
        'Or sample from it: `zerofit generate <this folder> --prompt "..."`.\n\n'
        f"## Training config (as resolved by zerofit)\n\n```yaml\n{config}```\n"
    )


def _gguf_card(front: str, name: str, run: RunConfig, table: str, gguf_file: str) -> str:
    """The card of a GGUF export: how to run it in llama.cpp, Ollama and LM Studio."""
    config = yaml.safe_dump(run.raw, sort_keys=False)
    return (
        f"---\n{front}---\n\n# {name}\n\nFine-tuned with zerofit; exported by `zerofit export --format gguf` "
        f"from `{run.run_dir}`.\n\n| | |\n|---|---|\n{table}\n\n## Run it\n\n```bash\n"
        f'llama-cli -m {gguf_file} -p "..."          # llama.cpp\n'
        f"ollama create {name} -f Modelfile && ollama run {name}   # Ollama\n"
        f"lms import {gguf_file}                     # LM Studio\n```\n\n"
        f"## Training config (as resolved by zerofit)\n\n```yaml\n{config}```\n"
    )
