"""`zerofit export RUN_DIR --out DIR [--merge] [--step N] [--dtype D] [--format hf|gguf] [--quant Q]`: a run's
weights as a folder other tools load.

Without `--merge`, a LoRA run exports its adapter as a peft folder; with `--merge`, the adapter merged into the
base model (QLoRA: dequantized first) as Hugging Face safetensors that `AutoModelForCausalLM.from_pretrained`
loads. A full fine-tune always exports the whole model. The weights come from the run's final export or, when
that is missing or older, its newest complete checkpoint of any engine (ZeRO-3 partitions and FSDP2 shards are
merged on the CPU); `--step N` picks checkpoint step-N. Tokenizer and model card included; see
`zerofit.export.folder`.

`--format gguf` writes the merged model as one GGUF file for llama.cpp, Ollama and LM Studio (`--quant`
f16 (default), bf16, f32 or q8_0; llama.cpp's llama-quantize makes q4_k_m and the other k-quants from the
f16 file), with an Ollama Modelfile and the model card; see `zerofit.export.gguf_export`.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from zerofit.core.errors import ConfigError
from zerofit.core.messages import quiet_deepspeed_on_cpu, quiet_libraries, say


def step_arg(value: str) -> int | str:
    """A `--step` argument: a step number, or `best` (the checkpoint of the best evaluation)."""
    if value == "best":
        return value
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{value!r} is neither a step number nor 'best'") from None


def add_step_flag(parser: argparse.ArgumentParser, default_is: str = "") -> None:
    """`--step N|best`: which checkpoint of a run directory a command reads (export, generate, score, eval);
    `default_is` says what it reads without one."""
    parser.add_argument(
        "--step",
        type=step_arg,
        default=None,
        metavar="N|best",
        help="a run directory's checkpoint step-N, or `best`: the best evaluation's (checkpoints/best.json: the "
        f"lowest eval/loss, an RL run's highest eval/reward or eval.harness.best_metric){default_is}",
    )


def add_trust_flags(parser: argparse.ArgumentParser) -> None:
    """`--trust-pickles` and `--trust-remote-code`: what a command reading a run folder (export, generate,
    score) may let that folder run, each only on the user's own command line."""
    parser.add_argument(
        "--trust-pickles",
        action="store_true",
        help="let DeepSpeed / torch.distributed.checkpoint unpickle a checkpoint that names code beyond "
        "zerofit's allow-list (only for a run folder whose source you trust: unpickling can run its code)",
    )
    add_trust_remote_code(parser)


def add_trust_remote_code(parser: argparse.ArgumentParser) -> None:
    """`--trust-remote-code`: the user's own opt-in to the base model's code (export and generate)."""
    parser.add_argument(
        "--trust-remote-code",
        action="store_true",
        help="honour the run's model.trust_remote_code: let transformers import the Python files its base "
        "model's auto_map names (only for a model whose source you trust: a saved config alone never does)",
    )


def register(subparsers: Any) -> None:
    """Add the `export` subcommand."""
    parser = subparsers.add_parser(
        "export",
        help="export a run's adapter (peft), or the model merged into its base (HF safetensors)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (output_dir/run_name)")
    parser.add_argument(
        "--out",
        required=True,
        metavar="DIR",
        help="the folder to write: new, empty, or holding only earlier zerofit exports (whose files it replaces; "
        "anything else there is refused, never deleted)",
    )
    parser.add_argument("--merge", action="store_true", help="merge the LoRA adapter into the base model")
    add_step_flag(parser, " (default: the newest weights)")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=("auto", "bf16", "fp16", "fp32"),
        help="dtype of merged / full weights (default auto: the run's train.precision)",
    )
    parser.add_argument(
        "--format",
        default="hf",
        choices=("hf", "gguf"),
        help="hf: a peft / Hugging Face folder (default); gguf: the merged model as GGUF for llama.cpp / Ollama",
    )
    parser.add_argument(
        "--quant",
        default=None,
        metavar="TYPE",
        help="with --format gguf: f16 (default), bf16, f32 or q8_0; q4_k_m and other k-quants: llama-quantize",
    )
    add_trust_flags(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Export, then say what was written and how to load it."""
    quiet_deepspeed_on_cpu()
    quiet_libraries()
    from zerofit.checkpoint.policy import resolve_step
    from zerofit.export import export_run
    from zerofit.models.vision import folder_model_class

    step = resolve_step(Path(args.run_dir), args.step)
    if args.format == "gguf":
        return _run_gguf(args, step)
    if args.quant is not None:
        raise ConfigError([f"--quant {args.quant}: only with --format gguf (an hf export takes --dtype)"])
    result = export_run(
        Path(args.run_dir),
        Path(args.out),
        merge=args.merge,
        step=step,
        dtype=args.dtype,
        trust_pickles=args.trust_pickles,
        trust_remote_code=args.trust_remote_code,
    )
    what = {
        "adapter": "LoRA adapter (peft)",
        "merged": f"model with the adapter merged in, {result.dtype}",
        "model": f"full model, {result.dtype}",
    }[result.kind]
    if args.merge and result.kind == "model":
        say("note: a full fine-tune has no adapter to merge; the export is the whole model either way")
    load = (
        "peft.AutoPeftModelForCausalLM.from_pretrained"
        if result.kind == "adapter"
        else f"transformers.{folder_model_class(result.out).__name__}.from_pretrained"  # image-text-to-text: a VLM
    )
    if result.reward:  # a reward model (train.objective: reward): a sequence classifier, scored not sampled
        load = "peft.AutoPeft" if result.kind == "adapter" else "transformers.Auto"
        load += "ModelForSequenceClassification.from_pretrained"
    _note_remote_code(result.out)
    extra = ", num_labels=1" if result.reward and result.kind == "adapter" else ""  # the base's config has 2
    loader = f"{load}('{result.out}'{extra})"
    if result.kind == "adapter" and not result.reward:
        loader = _vision_adapter_loader(result.out) or loader
    say(
        f"exported {what} from {result.source.describe()} of {args.run_dir}\n"
        f"  -> {result.out} ({result.size_bytes / 2**20:.2f} MiB of weights, tokenizer, README.md model card)\n"
        f"  load it with {loader}, or try it: zerofit "
        + (
            f'score {args.run_dir if result.kind == "adapter" else result.out} --prompt "..." --response "..."'
            if result.reward
            else f'generate {result.out} --prompt "..."'
        )
    )
    return 0


def _vision_adapter_loader(out: Path) -> str | None:
    """How to load a vision-language model's adapter folder `out` (peft has no Auto class for
    image-text-to-text: the base through transformers, then the adapter), None for another model's."""
    import json

    from zerofit.models.vision import folder_config, is_vision_config

    base = json.loads((out / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not base or not is_vision_config(folder_config(str(base))):
        return None
    return (
        f"peft.PeftModel.from_pretrained(transformers.AutoModelForImageTextToText.from_pretrained('{base}'), "
        f"'{out}')"
    )


def _note_remote_code(out: Path) -> None:
    """Say so when the export carries the base model's own code onward (only ever with --trust-remote-code)."""
    from zerofit.models.hub import remote_code

    found = [code.file for code in remote_code(str(out)) if Path(code.file).is_file()]
    if found:
        say(
            f"note: the export carries the base model's own code ({', '.join(found)}); whoever loads it runs that "
            "code and needs trust_remote_code=True (zerofit generate: --trust-remote-code)"
        )


def _run_gguf(args: argparse.Namespace, step: int | None) -> int:
    """`--format gguf`: write the GGUF folder, then say what was written and how to run it."""
    from zerofit.export import export_gguf
    from zerofit.export.gguf_writer import DEFAULT_QUANT

    if args.dtype != "auto":
        raise ConfigError(
            [f"--dtype {args.dtype}: with --format gguf the file's type is --quant (f16, bf16, f32, q8_0)"]
        )
    result = export_gguf(
        Path(args.run_dir),
        Path(args.out),
        step=step,
        quant=args.quant or DEFAULT_QUANT,
        trust_pickles=args.trust_pickles,
        trust_remote_code=args.trust_remote_code,
    )
    file = result.file
    lines = [
        f"exported the trained model (adapters merged) as GGUF {file.quant} from "
        f"{result.source.describe()} of {args.run_dir}",
        f"  -> {file.path} ({file.size_bytes / 2**20:.2f} MiB, {file.tensors} tensors), Modelfile, README.md",
    ]
    if file.kept_f16:
        lines.append(
            f"  note: {len(file.kept_f16)} tensor(s) with rows not in blocks of 32 kept in f16 "
            f"({', '.join(file.kept_f16[:3])}{', ...' if len(file.kept_f16) > 3 else ''}), as llama.cpp's converter does"
        )
    name = file.path.stem.rsplit("-", 1)[0]
    lines += [
        f'  llama.cpp: llama-cli -m {file.path} -p "..."',
        f"  Ollama:    cd {result.out} && ollama create {name} -f Modelfile && ollama run {name}",
        f"  LM Studio: lms import {file.path}",
    ]
    say("\n".join(lines))
    return 0
