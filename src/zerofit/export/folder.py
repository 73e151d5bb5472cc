"""`export_run`: a run's trained weights as a folder other tools load, written atomically.

    LoRA, default    the adapter as a peft folder (`PeftModel` / `AutoPeftModelForCausalLM` load it)
    LoRA, merge      the adapters merged into the base (peft's `merge_and_unload`, in fp32, QLoRA
                     dequantized first), saved as Hugging Face safetensors in `--dtype`, which
                     `AutoModelForCausalLM.from_pretrained` loads with no peft and no zerofit
    full fine-tune   the whole model, as Hugging Face safetensors in `--dtype`

Every export also holds the tokenizer, a model card (`README.md`) and `zerofit_export.json` (the source run,
step, kind and the run's config, which `zerofit generate` reads, and the list of the files the export
wrote). The folder is written under a temporary name next to `--out` and swapped into place only when
complete, so an interrupted export never replaces a good one; `--out` must be new, empty, or hold only the
files of earlier zerofit exports, and only those are deleted (`zerofit.export.out_folder`).
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from zerofit.checkpoint.final_export import record_base_model, save_pretrained_here
from zerofit.core.errors import ConfigError
from zerofit.core.file_modes import follow_umask
from zerofit.core.precision import DTYPES, torch_dtype
from zerofit.core.progress import progress
from zerofit.export.card import model_card
from zerofit.export.out_folder import (
    EXPORT_INFO,
    FILES_KEY,
    MODEL_CARD,
    check_out,
    replace_folder,
    unwritable_out,
    written_files,
)
from zerofit.models.build import resolve_model_path
from zerofit.models.vision import save_image_processor
from zerofit.objectives.registry import objective_of
from zerofit.trained.checkpoints import WeightsSource, find_weights, read_checkpoint
from zerofit.trained.model import RunConfig, build_trained, read_run_config, tokenizer_for, with_run_adapters

__all__ = [
    "EXPORT_INFO",
    "ExportResult",
    "export_run",
    "merged_model",
    "output_dtype",
]

_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


@dataclass(frozen=True)
class ExportResult:
    """What `export_run` wrote: the folder, its kind (`adapter`, `merged`, `model`), source and dtype."""

    out: Path
    kind: str
    source: WeightsSource
    dtype: str | None  # torch name of the weights' dtype (None: the adapter as trained)
    # A reward model's (train.objective: reward): a sequence classifier with a score head.
    reward: bool = False

    @property
    def size_bytes(self) -> int:
        """Bytes of the weight files."""
        return sum(p.stat().st_size for p in self.out.glob("*.safetensors"))


def output_dtype(run: RunConfig, requested: str) -> str:
    """The dtype merged / full weights are saved in: `auto` = the run's `train.precision` (bf16 runs, QLoRA
    included, give bf16), else the requested `bf16`, `fp16` or `fp32`."""
    name = run.config.train.precision if requested == "auto" else requested
    if name not in DTYPES:
        raise ConfigError([f"--dtype {requested!r}: expected auto, {', '.join(DTYPES)}"])
    return DTYPES[name].torch_name


def _adapter_from_checkpoint(run: RunConfig, source: WeightsSource, folder: Path) -> None:
    """Write a checkpoint's LoRA tensors as a peft folder, through peft, with no base weights loaded: the
    wrapper is built on the meta device and the checkpoint's tensors are assigned into it."""
    from zerofit.models.heads import meta_head_model

    # A reward model's meta model has its score head too; a vision-language model's adapters go where its
    # training put them.
    model: Any = with_run_adapters(meta_head_model(run.config, resolve_model_path(run.config)), run.config)
    state = read_checkpoint(source.path, source.trust_pickles)
    result = model.load_state_dict(state, strict=False, assign=True)
    meta = [n for n, p in model.named_parameters() if p.requires_grad and p.is_meta]
    if result.unexpected_keys or meta:
        problem = result.unexpected_keys[:3] or meta[:3]
        raise ConfigError(
            [
                f"{source.describe()} of {run.run_dir} does not fit the LoRA config in its config.yaml ({problem}); "
                "was config.yaml edited after the run?"
            ]
        )
    # The folder names the base it adapts, as a run's own export does.
    model.peft_config["default"].base_model_name_or_path = resolve_model_path(run.config)
    save_pretrained_here(model, folder, safe_serialization=True, save_embedding_layers=False)
    record_base_model(folder, run.config)


def merged_model(run: RunConfig, source: WeightsSource) -> Any:
    """The trained model as one Hugging Face model in fp32: a LoRA run's adapters merged into its base (peft's
    `merge_and_unload`; QLoRA dequantized first), a full fine-tune as it is. Merging happens in fp32 (bf16
    base weights upcast exactly; adapters are fp32), so a caller casts once, to what it writes."""
    trained = build_trained(run, source)
    model: Any = trained.model.merge_and_unload() if trained.is_lora else trained.model
    model.config.use_cache = True  # training switched the KV cache off; generation wants it
    return model


def _write_weights(run: RunConfig, source: WeightsSource, folder: Path, merge: bool, dtype: str) -> str:
    """The weights into `folder`; returns the export's kind."""
    if run.config.lora.enabled and not merge:
        if source.kind == "adapter":
            for name in _ADAPTER_FILES:
                shutil.copy2(source.path / name, folder / name)
            record_base_model(folder, run.config)  # also for a run's adapter/ from before the record
        else:
            _adapter_from_checkpoint(run, source, folder)
        return "adapter"
    model = merged_model(run, source).to(torch_dtype(dtype))
    save_pretrained_here(model, folder, safe_serialization=True)
    return "merged" if run.config.lora.enabled else "model"


def export_run(
    run_dir: Path,
    out: Path,
    *,
    merge: bool = False,
    step: int | None = None,
    dtype: str = "auto",
    trust_pickles: bool = False,
    trust_remote_code: bool = False,
) -> ExportResult:
    """Export the trained weights of `run_dir` into `out` (see the module docstring); returns what was written.
    `trust_pickles`: let DeepSpeed / DCP unpickle a checkpoint naming globals beyond zerofit's allow-list;
    `trust_remote_code`: honour the run's `model.trust_remote_code`, which a saved config alone never turns
    on (`trained.settle_remote_code`): only then does a merged export carry the base model's own code."""
    run = read_run_config(Path(run_dir), trust_remote_code)
    out = Path(out)
    check_out(out, run.run_dir)
    source = find_weights(run.run_dir, step, trust_pickles)
    out_dtype = output_dtype(run, dtype)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    except OSError as exc:  # what `check_out` cannot see from here (a read-only filesystem as root)
        raise unwritable_out(out, exc) from None
    try:
        with progress(f"exporting {run.run_dir} to {out}"):  # loading, merging, writing: minutes on a 7B
            kind = _write_weights(run, source, tmp, merge, out_dtype)
        tokenizer_for(run, source).save_pretrained(tmp)
        save_image_processor(resolve_model_path(run.config), tmp)  # a vision-language model's processor
        weights_dtype = None if kind == "adapter" else out_dtype
        (tmp / MODEL_CARD).write_text(model_card(run, source, kind, weights_dtype))
        info = {
            "source_run": str(run.run_dir.resolve()),
            "source": source.describe(),
            "step": source.step,
            "kind": kind,
            "dtype": weights_dtype,
            "config": run.raw,
            FILES_KEY: written_files(tmp),  # what a later export into `out` may replace (`out_folder`)
        }
        (tmp / EXPORT_INFO).write_text(json.dumps(info, indent=2) + "\n")
        follow_umask(tmp)  # safetensors writes its files 0600 (and copy2 keeps an older export's mode)
        replace_folder(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    reward = objective_of(run.config).score_head
    return ExportResult(out=out, kind=kind, source=source, dtype=weights_dtype, reward=reward)
