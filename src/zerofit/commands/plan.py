"""`zerofit plan --config FILE [--world-size N] [--json] [--max-context] [key=value ...]`: everything decided before launch.

Loads and resolves the config exactly as the launcher does, renders its engine spec once, then shows the
batch plan (every factor, samples and tokens per optimizer step), the memory verdict for that spec and
the engine config the run would write. Nothing is loaded or launched (unless `--probe` asks for real steps
on a GPU), so a bad split or a conflicting DeepSpeed file fails here in a second.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import Any

from rich.console import Console
from rich.table import Table

from zerofit.config import load_config
from zerofit.config.schema import RLSection, ZerofitConfig
from zerofit.core.errors import ConfigError, LaunchError
from zerofit.engine_spec import EngineSpec, render_spec
from zerofit.objectives.spec import ObjectiveSpec
from zerofit.planner import choose_fastest_plan
from zerofit.recipe.run_report import describe_levers
from zerofit.resolution import ResolvedConfig, resolve


def default_world_size() -> int:
    """The launcher's world size (`WORLD_SIZE`, as set by torchrun / deepspeed), else 1."""
    raw = os.environ.get("WORLD_SIZE")
    if raw is None or raw.strip() == "":
        return 1
    try:
        return int(raw)
    except ValueError:
        raise LaunchError(
            f"WORLD_SIZE = {raw!r} in the environment is not an integer; unset it or pass --world-size N"
        ) from None


def default_device() -> str:
    """The device a plan is made for, without importing torch: a machine with the NVIDIA driver tool is assumed
    to train on CUDA."""
    return "cuda" if shutil.which("nvidia-smi") else "cpu"


def batch_report(resolved: ResolvedConfig) -> dict[str, Any]:
    """The plan's four factors plus what they mean per optimizer step."""
    plan, objective = resolved.batch, resolved.objective
    # The objective's unit: its noun, its sequences in a forward (a pair's two; KTO's KL pass is no-grad,
    # unplanned here) and its longest training sequence (a completion's: its prompt and itself).
    sequences, samples = objective.unit.rows, objective.unit.noun
    max_seq_len, length = objective.max_tokens_per_unit(resolved.config)
    return {
        "objective": objective.name,
        "samples": samples,
        "sequences_per_sample": sequences,
        "global_batch_size": plan.global_batch_size,
        "micro_batch_size": plan.micro_batch_size,
        "grad_accum_steps": plan.grad_accum_steps,
        "dp_size": plan.dp_size,
        "formula": plan.describe(),
        "samples_per_optimizer_step": plan.global_batch_size,
        "samples_per_rank_per_optimizer_step": plan.samples_per_rank,
        "max_tokens_per_optimizer_step": plan.global_batch_size * sequences * max_seq_len,
        "tokens_per_micro_batch": resolved.config.batch.tokens_per_micro_batch,
        "tokens_note": (
            f"upper bound: global_batch_size x {length} ({plan.global_batch_size} x {max_seq_len}"
            f"{'' if sequences == 1 else ', x 2 sequences per pair'}); "
            "the loss averages over the valid label tokens actually present, which padding and prompt masking "
            "make fewer"
        ),
    }


def build_plan_report(
    resolved: ResolvedConfig, spec: EngineSpec, *, probe: bool = False, **memory_options: Any
) -> dict[str, Any]:
    """Everything `zerofit plan` shows, as one JSON-able dict (what `--json` prints).

    Keys: `batch`, `strategy`, `preset`, `engine_config` (the exact dict the engine receives),
    `engine_config_file`, `run_dir`, `world_size`, `lora` (what the adapters reach: mapped names, counts;
    None without LoRA), `notes` (what resolve decided for the user, e.g. an engine
    switch), `schedule` (the LR schedule that runs), `config` (the resolved config), `memory` (the planner's
    verdict for `spec`; memory_options: gpu, gpu_mem, trace; with `probe`, the probe's measurements).
    """
    from zerofit.checkpoint.rundir import planned_run_dir
    from zerofit.planner.lora_report import lora_targets_report

    cfg = resolved.config
    # The folder a launch now would write: a new run beside a taken name gets `-2` (said in the notes).
    run_dir, taken = planned_run_dir(cfg.output_dir, str(cfg.run_name), cfg.checkpoint.resume)
    report: dict[str, Any] = {
        "batch": batch_report(resolved),
        "strategy": spec.strategy,
        "preset": spec.preset,
        "ds_config": cfg.distributed.ds_config,
        "world_size": resolved.world_size,
        "engine_config": spec.to_json(),
        "engine_config_file": str(run_dir / spec.filename),
        "run_dir": str(run_dir),
        "notes": [*resolved.notes, *([taken] if taken else [])],
        "schedule": spec.describe_schedule(cfg.scheduler.name, cfg.scheduler.warmup_steps),
        "config": cfg.model_dump(mode="json"),
        "memory": _memory(resolved, spec, memory_options),
        "lora": lora_targets_report(cfg),
    }
    if resolved.objective.generates:  # the rollouts' prompts, completions and tokens
        report["rl"] = rl_report(resolved)
    if probe:
        report["memory"]["probe"] = probe_report(resolved, report["memory"])
    return report


def _memory(resolved: ResolvedConfig, spec: Any, memory_options: Any) -> dict[str, Any]:
    """`memory_report`, counting the image tokens of the run's data for a vision-language model
    (`zerofit.data.image_rows`; the worst case without readable data)."""
    from zerofit.planner.images import observed_images, vision_dims
    from zerofit.planner.plan_report import memory_report

    images = None
    if vision_dims(resolved.config.model.name_or_path) is not None:  # a language model reads no data here
        from zerofit.data.image_rows import plan_images

        images = plan_images(resolved.config)
    with observed_images(images):
        return memory_report(resolved, spec, **memory_options)


def rl_report(resolved: ResolvedConfig) -> dict[str, Any]:
    """A GRPO run's global batch in prompts, completions and tokens, and every reward function it would call
    (a `module:function` named, never imported: a launch with this config imports it)."""
    from zerofit.objectives.grpo import describe_reward
    from zerofit.objectives.grpo.rewards import reward_spec_problems
    from zerofit.planner.rl import rl_batch

    rewards = resolved.config.rl.rewards
    step = rl_batch(resolved.config, resolved.batch.dp_size)
    if resolved.batch.global_batch_size != step["completions_per_step"]:
        step["batch_note"] = (
            f"batch.global_batch_size = {resolved.batch.global_batch_size} is not the step's "
            f"{step['completions_per_step']} completions (rl.prompts_per_step x rl.num_generations)"
        )
    return {
        **step,
        "rewards": [describe_reward(spec) for spec in rewards],
        "imports": launch_imports(resolved.config.rl),
        "reward_problems": reward_spec_problems(rewards),
    }


def launch_imports(rl: RLSection) -> list[str]:
    """The modules of the user's own code a launch imports for `rl` (its reward functions, tools and
    environment named as `module:name`, in that order, each once); zerofit's own modules are not listed."""
    names = [*(spec.function for spec in rl.rewards), *(tool.function for tool in rl.tools), rl.environment]
    modules = [name.split(":")[0] for name in names if name and ":" in name]
    return [module for module in dict.fromkeys(modules) if module.split(".")[0] != "zerofit"]


def print_rl(rl: dict[str, Any], console: Console, environment: str | None = None) -> None:
    """The `rl` block in words: the step in prompts, completions and tokens, then the rewards (those of
    `rl.environment`, `environment`, after the reward functions')."""
    from zerofit.objectives.grpo import describe_environment_reward

    console.print(
        f"GRPO step: {rl['prompts_per_step']} prompts x {rl['num_generations']} generations = "
        f"{rl['completions_per_step']} completions ({rl['completions_per_rank']} per rank), at most "
        f"{rl['max_tokens_per_step']:,} tokens ({rl['max_prompt_length']} prompt + {rl['max_completion_length']} "
        f"completion each; {rl['max_completion_tokens_per_step']:,} completion tokens); loss {rl['loss_type']}, "
        f"beta {rl['beta']:g}, {rl['num_iterations']} update(s) per generation batch",
        highlight=False,
    )
    if rl.get("batch_note"):
        console.print(f"Note: {rl['batch_note']}", highlight=False)
    rewards = [*rl["rewards"], *([describe_environment_reward(environment)] if environment else [])]
    for line in rewards or ["none (a launch refuses a GRPO run without rl.rewards)"]:
        console.print(f"Reward: {line}", highlight=False)
    if rl["imports"]:
        console.print(
            f"A launch imports: {', '.join(rl['imports'])} (your code; nothing imported now)", highlight=False
        )
    for problem in rl["reward_problems"]:
        console.print(f"Reward problem: {problem}", highlight=False)


def probe_report(resolved: ResolvedConfig, memory: dict[str, Any]) -> dict[str, Any]:
    """`--probe`: real steps on the GPU for the micro-batches the analytic plan does not rule out."""
    from zerofit.recipe.probe import probe_micro_batches

    per_rank = resolved.batch.samples_per_rank
    table = memory.get("micro_batch_table") or []
    # Each candidate loads the model in a fresh process: skip sizes predicted far beyond the card.
    gpu = memory.get("gpu")
    limit = gpu["memory_gib"] * 1.15 if gpu else float("inf")
    candidates = [row["micro_batch_size"] for row in table if row["total_gib"] <= limit]
    candidates = candidates or [min((row["micro_batch_size"] for row in table), default=1)]
    results = probe_micro_batches(
        resolved.config.model_dump(mode="json"), resolved.world_size, candidates, per_rank
    )
    return {
        "results": [r.as_dict() for r in results],
        "micro_batch_size": next((r.micro_batch_size for r in results if r.ok), None),
    }


def _batch_units(b: dict[str, Any]) -> tuple[str, str]:
    """What the global batch and a micro-batch count, in words: examples, preference pairs or completions."""
    if b.get("samples") == "pairs":
        return (
            f"preference pairs per optimizer step (train.objective {b['objective']}: 2 sequences each)",
            f"pairs per forward/backward, per rank ({2 * b['micro_batch_size']} sequences)",
        )
    if b.get("samples") == "completions":
        return (
            "completions trained on per optimizer step (rl.prompts_per_step x rl.num_generations)",
            "completions per forward/backward, per rank",
        )
    return "samples per optimizer step", "samples per forward/backward, per rank"


def print_report(report: dict[str, Any], objective: ObjectiveSpec, console: Console) -> None:
    """Human-readable form of `build_plan_report`'s dict."""
    b = report["batch"]
    table = Table(title=f"Batch plan: {b['formula']}", show_header=True)
    table.add_column("factor")
    table.add_column("value", justify="right")
    table.add_column("meaning")
    unit, per_forward = _batch_units(b)
    table.add_row("global_batch_size", str(b["global_batch_size"]), unit)
    if b.get("tokens_per_micro_batch"):
        table.add_row(
            "tokens_per_micro_batch",
            str(b["tokens_per_micro_batch"]),
            f"token budget: whole examples packed into {b['micro_batch_size']} rows of data.max_seq_len",
        )
        table.add_row(
            "micro_batch_size", str(b["micro_batch_size"]), "packed rows per forward/backward, per rank"
        )
        table.add_row(
            "grad_accum_steps", str(b["grad_accum_steps"]), "micro-steps per optimizer step, at most"
        )
    else:
        table.add_row("micro_batch_size", str(b["micro_batch_size"]), per_forward)
        table.add_row("grad_accum_steps", str(b["grad_accum_steps"]), "micro-steps per optimizer step")
    table.add_row("dp_size", str(b["dp_size"]), "data-parallel ranks (the launcher's world size)")
    table.add_row(
        "samples / rank / step", str(b["samples_per_rank_per_optimizer_step"]), "micro x accum, on each rank"
    )
    table.add_row("tokens / step (max)", str(b["max_tokens_per_optimizer_step"]), b["tokens_note"])
    console.print(table)
    if "rl" in report:
        print_rl(report["rl"], console, report["config"]["rl"]["environment"])
    if "memory" in report:
        from zerofit.planner.plan_report import print_memory

        print_memory(report["memory"], objective, console)
    lora = report.get("lora")
    if lora:
        console.print(f"LoRA: {lora.get('described') or lora.get('error')}", highlight=False)
    train = report["config"]["train"]
    levers = describe_levers(train["tiled_mlp"], train["activation_offload"], train["lean_norm"])
    if levers:
        console.print(f"Memory levers: {levers}", highlight=False)
    engine = report["preset"] or report["strategy"]
    if report.get("ds_config"):
        engine = f"{report['strategy']} (your file {report['ds_config']}, autos filled)"
    console.print(f"Engine: {engine}; run directory: {report['run_dir']}")
    console.print(f"LR schedule: {report['schedule']}", highlight=False)
    for note in report.get("notes", []):
        console.print(f"Note: {note}", highlight=False)
    console.print(f"Engine config (written to {report['engine_config_file']} at launch):")
    console.print_json(json.dumps(report["engine_config"]))


def max_context_report(
    config: ZerofitConfig, world_size: int, gpu: str | None, gpu_mem: str | None
) -> dict[str, Any]:
    """`--max-context`: the longest context at micro-batch 1 that fits the budget, and its levers."""
    from zerofit.planner.context import max_context
    from zerofit.planner.search.budget import resolve_budget

    budget = resolve_budget(config, gpu=gpu, gpu_mem=gpu_mem)
    if budget is None:
        raise ConfigError(
            [
                "--max-context needs the GPU's memory and none is known here: pass --gpu NAME (e.g. rtx3090) "
                "or --gpu-mem 24GiB, or set planner.gpu / planner.gpu_memory_gib"
            ]
        )
    return max_context(config, world_size, budget).as_dict()


def print_max_context(mc: dict[str, Any], console: Console) -> None:
    """The `--max-context` answer in words."""
    if mc["tokens"] is None:
        console.print(
            f"Longest context: not even {mc['step_tokens']} tokens fit {mc['limit_gib']} GiB at micro 1"
        )
        return
    console.print(
        f"Longest context at micro-batch 1: {mc['tokens']:,} tokens (limited by {mc['limited_by']}; memory "
        f"alone allows {mc['memory_tokens']:,}), {mc['total_gib']:.2f} of {mc['limit_gib']:.2f} GiB, host RAM "
        f"{mc['host_ram_gib']:.1f} GiB, ~{mc['tokens_per_s']:,.0f} tokens/s (speed model)",
        highlight=False,
    )
    console.print(f"  overrides: {' '.join(mc['levers'])}", highlight=False)
    for label, gib in mc["largest_terms"].items():
        console.print(f"  {gib:7.2f} GiB  {label}", highlight=False)
    console.print(f"  assumes: {'; '.join(mc['assumptions'])}", highlight=False)


def plan_report(
    config_file: str | None,
    overrides: list[str],
    world_size: int,
    *,
    gpu: str | None = None,
    gpu_mem: str | None = None,
    device: str = "cpu",
    **options: bool,
) -> tuple[dict[str, Any], ResolvedConfig]:
    """What `zerofit plan --json` prints for this config, overrides, world size and card, and the resolution it
    came from: the one path of the command line and of `zerofit studio`'s plan page (options: trace, probe,
    max_context)."""
    from zerofit.planner.plan_report import check_gpu_options

    check_gpu_options(gpu, gpu_mem)
    overrides = list(overrides)
    if gpu is not None:  # the target `batch.micro_batch_size=auto` plans for (a visible GPU wins)
        overrides.append(f"planner.gpu={gpu}")
    if gpu_mem is not None:
        from zerofit.catalogue.gpus import parse_memory_gib

        overrides.append(f"planner.gpu_memory_gib={parse_memory_gib(gpu_mem)}")
    config = load_config(config_file, overrides)
    resolved = resolve(config, world_size, choose_fastest_plan)
    spec = render_spec(resolved, device_type=device)
    report = build_plan_report(
        resolved,
        spec,
        gpu=gpu,
        gpu_mem=gpu_mem,
        trace=options.get("trace", False),
        probe=options.get("probe", False),
    )
    if options.get("max_context"):
        report["max_context"] = max_context_report(config, world_size, gpu, gpu_mem)
    return report, resolved


def run(args: argparse.Namespace) -> int:
    """Resolve the config for the given world size and print (or `--json` dump) the plan."""
    world_size = args.world_size if args.world_size is not None else default_world_size()
    report, resolved = plan_report(
        args.config,
        args.overrides,
        world_size,
        gpu=args.gpu,
        gpu_mem=args.gpu_mem,
        device=args.device,
        trace=args.trace,
        probe=args.probe,
        max_context=args.max_context,
    )
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print_report(report, resolved.objective, Console())
        if "max_context" in report:
            print_max_context(report["max_context"], Console())
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `plan` subcommand."""
    parser = subparsers.add_parser(
        "plan",
        help="show the batch plan and the engine config a run would use (nothing is launched)",
        description="Resolve a run config for a world size and show the exact batch split and engine config.",
    )
    parser.add_argument("--config", required=True, metavar="FILE", help="run config (YAML)")
    parser.add_argument(
        "--world-size",
        type=int,
        default=None,
        metavar="N",
        help="data-parallel size to plan for (default: $WORLD_SIZE, else 1)",
    )
    parser.add_argument(
        "--device",
        choices=("cpu", "cuda"),
        default=default_device(),
        help="device the FSDP mesh is planned on (default: cuda where nvidia-smi exists, else cpu)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    parser.add_argument("--gpu", default=None, metavar="NAME", help="plan memory for this GPU (e.g. rtx3090)")
    parser.add_argument(
        "--gpu-mem", default=None, metavar="SIZE", help="plan memory for this much GPU memory (24GiB)"
    )
    parser.add_argument(
        "--trace", action="store_true", help="also trace one step tensor by tensor (CPU, seconds)"
    )
    parser.add_argument(
        "--max-context",
        action="store_true",
        help="also find the longest data.max_seq_len at micro-batch 1 that fits, and the levers it needs",
    )
    parser.add_argument(
        "--probe", action="store_true", help="find the largest fitting micro-batch with real steps (GPU)"
    )
    parser.add_argument(
        "overrides", nargs="*", metavar="key=value", help="dotted overrides, e.g. batch.micro_batch_size=2"
    )
    parser.set_defaults(func=run)
