"""`export_gguf`: a run's trained model as a GGUF folder for llama.cpp, Ollama and LM Studio.

    DIR/<run_name>-<quant>.gguf   the merged model (`folder.merged_model`: LoRA merged in fp32, QLoRA
                                  dequantized first), tokenizer and chat template (`gguf_writer`)
    DIR/Modelfile                 for `ollama create NAME -f Modelfile` (`modelfile`), FROM the file above
    DIR/README.md                 the model card, with the llama.cpp / Ollama / LM Studio commands
    DIR/zerofit_export.json       source run, step, kind `gguf`, the file and its type, the run's config,
                                  and every file the GGUF exports into DIR wrote (`out_folder`)

The weights come from the same place as every export (the final `adapter/` / `model/` or a checkpoint of
any engine, `--step N|best`). Each file is written under a temporary name in DIR and renamed into place,
so a failure leaves the files of an earlier export as they were and never a partial one; several types can
share one DIR (`--quant f16`, then `--quant q8_0`: both files stay; the Modelfile names the newest). DIR
must be new, empty, or hold only GGUF exports of this run: anything else there is refused by name
(`out_folder.check_out`), never overwritten.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from zerofit.core.errors import ConfigError
from zerofit.core.progress import progress
from zerofit.export.card import model_card
from zerofit.export.folder import merged_model
from zerofit.export.gguf_writer import DEFAULT_QUANT, GGUFFile, check_architecture, check_quant, write_gguf
from zerofit.export.modelfile import modelfile
from zerofit.export.out_folder import (
    EXPORT_INFO,
    FILES_KEY,
    MODEL_CARD,
    MODELFILE,
    OutFolder,
    check_out,
    unwritable_out,
)
from zerofit.models.build import resolve_model_path
from zerofit.models.heads import refuse_reward_model
from zerofit.models.hub import hub_errors
from zerofit.trained.checkpoints import WeightsSource, find_weights
from zerofit.trained.model import RunConfig, read_run_config, tokenizer_for

__all__ = ["MODELFILE", "GGUFExportResult", "export_gguf"]


@dataclass(frozen=True)
class GGUFExportResult:
    """What `export_gguf` wrote."""

    out: Path
    file: GGUFFile
    source: WeightsSource


def _write_text(path: Path, text: str) -> None:
    """`text` as file `path`, through a temporary file renamed into place."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _check_base(run: RunConfig) -> None:
    """Refuse an unsupported architecture before anything heavy is loaded (the base's config.json only)."""
    from transformers import AutoConfig

    cfg = run.config
    path = resolve_model_path(cfg)
    with hub_errors(cfg.model.name_or_path, "config", path):
        config = AutoConfig.from_pretrained(path, trust_remote_code=cfg.model.trust_remote_code)
    check_architecture(config)


def _check_shared_folder(earlier: OutFolder, run: RunConfig) -> None:
    """A GGUF export adds its files to `out` (several types share a folder), so `out` may hold only GGUF
    exports of this same run: an export folder belongs to one run. Into an export of another run, or an
    hf export (whose weights would stay beside the new metadata), it would leave a folder whose
    zerofit_export.json, model card and Modelfile describe one run while other files come from another."""
    out, info = earlier.path, earlier.info
    if not earlier.files:
        return  # new or empty (`check_out` refused a folder of something else)
    this_run = str(run.run_dir.resolve())
    if info.get("kind") == "gguf" and info.get("source_run") == this_run:
        return
    what = f"a {info.get('kind', 'unreadable')} export of {info.get('source_run', 'an unknown run')}"
    raise ConfigError(
        [
            f"--out {out} holds {what} ({out / EXPORT_INFO}); a GGUF export adds its files to a folder, so it "
            f"goes into a new or empty folder, or one holding GGUF exports of this run ({this_run}) only: choose "
            "another --out"
        ]
    )


def export_gguf(
    run_dir: Path,
    out: Path,
    *,
    step: int | None = None,
    quant: str = DEFAULT_QUANT,
    trust_pickles: bool = False,
    trust_remote_code: bool = False,
) -> GGUFExportResult:
    """Export the trained model of `run_dir` as GGUF into folder `out` (module docstring); `trust_remote_code`:
    honour the run's `model.trust_remote_code` (`trained.settle_remote_code`)."""
    run = read_run_config(Path(run_dir), trust_remote_code)
    refuse_reward_model(run.config, run_dir, "llama.cpp / Ollama to generate with")
    out = Path(out)
    earlier = check_out(out, run.run_dir)
    _check_shared_folder(earlier, run)
    stem = run.config.run_name or run.run_dir.name
    quant = check_quant(quant, str(out / stem))
    _check_base(run)
    source = find_weights(run.run_dir, step, trust_pickles)
    with progress(f"exporting {run.run_dir} to {out} as GGUF") as shown:
        shown.update(status="merging")
        model = merged_model(run, source)
        tokenizer = tokenizer_for(run, source)
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # what `check_out` cannot see from here (a read-only filesystem as root)
            raise unwritable_out(out, exc) from None
        shown.update(status=f"writing {quant}")
        written = write_gguf(model, tokenizer, out / f"{stem}-{quant}.gguf", quant, stem, run.is_chat)
    _write_text(
        out / MODELFILE, modelfile(written.path.name, tokenizer, model.config.max_position_embeddings)
    )
    _write_text(out / MODEL_CARD, model_card(run, source, "gguf", quant, written.path.name))
    ours = {written.path.name, MODELFILE, MODEL_CARD, EXPORT_INFO}
    info = {
        "source_run": str(run.run_dir.resolve()),
        "source": source.describe(),
        "step": source.step,
        "kind": "gguf",
        "dtype": quant,
        "file": written.path.name,
        "config": run.raw,
        FILES_KEY: sorted(ours.union(earlier.files)),  # the earlier types' files stay, and stay listed
    }
    _write_text(out / EXPORT_INFO, json.dumps(info, indent=2) + "\n")
    return GGUFExportResult(out=out, file=written, source=source)
