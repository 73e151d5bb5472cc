"""The memory part of `zerofit plan`: one JSON-able block and its human-readable rendering.

`memory_report` is what `build_plan_report` stores under `memory`; `print_memory` prints it after the
batch table: the breakdown (GiB lines that add up to the tensor peak), the allowance, the verdict for the
GPU with its headroom, the micro-batch table, the host RAM, the fastest plans that fit (the chosen one,
the runner-up and the predicted speed-up), and remedies when the run does not fit.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from rich.table import Table
from rich.text import Text

from zerofit.core.errors import ConfigError

if TYPE_CHECKING:
    from rich.console import Console

    from zerofit.engine_spec.spec import EngineSpec
    from zerofit.objectives.spec import ObjectiveSpec
    from zerofit.resolution import ResolvedConfig


def memory_report(
    resolved: ResolvedConfig,
    spec: EngineSpec,
    gpu: str | None = None,
    gpu_mem: str | None = None,
    trace: bool = False,
) -> dict[str, Any]:
    """Analytic estimate + verdict (+ the `--trace` result) for a resolved run and its spec, as a dict."""
    from zerofit.planner.scenario import scenario_for
    from zerofit.planner.search.budget import resolve_budget
    from zerofit.planner.search.report import plan_memory

    budget = resolve_budget(resolved.config, gpu=gpu, gpu_mem=gpu_mem)
    try:
        plan = plan_memory(resolved, spec, budget)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        # A local model transformers cannot build on the meta device: the batch plan still stands.
        return {"error": f"memory planner: {type(exc).__name__}: {exc}"}
    out = plan.as_dict()
    out["attention"] = attention_plan(scenario_for(resolved.config, spec))
    if trace:
        from zerofit.planner.trace import trace_memory

        try:
            traced = trace_memory(scenario_for(resolved.config, spec))
        except ValueError as exc:
            out["notes"] = [*out.get("notes", []), f"--trace skipped: {exc}"]
        else:
            out["trace"] = traced.as_dict()
            out["trace"]["analytic_vs_trace"] = round(plan.estimate.tensors_gib / traced.tensors_gib - 1.0, 4)
    return out


def attention_plan(scn: Any) -> dict[str, Any]:
    """The attention path and kernel the plan counts (`memory.attention` of `zerofit plan --json`)."""
    from zerofit.levers.attention import describe_attention

    return {
        "implementation": scn.attn_implementation,
        "kernel": scn.varlen_kernel,
        "dense_mask": scn.dense_mask,
        "text": describe_attention(scn.attn_implementation, scn.varlen_kernel, scn.masked_attention),
    }


def _gib(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def print_memory(memory: dict[str, Any], objective: ObjectiveSpec, console: Console) -> None:
    """Render `memory_report`'s dict of a run of `objective`."""
    if "error" in memory:
        console.print(f"Memory: not estimated ({memory['error']})")
        return
    _print_objective(memory, objective, console)
    _print_breakdown(memory, console)
    if memory.get("attention"):
        console.print(f"Attention: {memory['attention']['text']}")
    _print_verdict(memory, console)
    _print_remedies(memory, console)  # a run that does not fit leads with what to change
    _print_micro_table(memory, console)
    if memory.get("speed"):
        print_speed(memory["speed"], console)
    _print_checks(memory, console)
    for note in memory.get("notes") or []:
        console.print(f"Note: {note}")


def _print_objective(memory: dict[str, Any], objective: ObjectiveSpec, console: Console) -> None:
    """What the estimate plans for the objective (`ObjectiveSpec.planned_line`; nothing for SFT)."""
    line = objective.planned_line(memory)
    if line is not None:
        console.print(line, highlight=False)


def _print_breakdown(memory: dict[str, Any], console: Console) -> None:
    """The peak's components, the allowance, the total and one layer's bytes per token."""
    table = Table(title=f"Memory per rank (peak: {memory['peak_phase']})", show_header=True)
    table.add_column("component")
    table.add_column("GiB", justify="right")
    for name, gib in memory["breakdown"].items():
        table.add_row(name, f"{gib:.3f}")
    table.add_row("[b]tensors at peak[/b]", f"[b]{memory['tensors_gib']:.2f}[/b]")
    for name, gib in memory["allowance"].items():
        table.add_row(f"+ {name}", f"{gib:.2f}")
    table.add_row("[b]total[/b]", f"[b]{memory['total_gib']:.2f}[/b]")
    console.print(table)
    per_token = memory.get("activation_bytes_per_token_per_layer") or {}
    if per_token:
        terms = ", ".join(f"{k} {v:,}" for k, v in per_token.items())
        console.print(f"Activation bytes per token per layer: {sum(per_token.values()):,} = {terms}")


def _print_verdict(memory: dict[str, Any], console: Console) -> None:
    """The verdict against the GPU (or how to give one) and the host RAM the run needs."""
    gpu = memory.get("gpu")
    if gpu is None:
        console.print("Verdict: no GPU given (use --gpu NAME or --gpu-mem 24GiB, or set planner.gpu)")
    else:
        label = gpu["name"] or f"{gpu['memory_gib']:.2f} GiB"
        console.print(
            f"Verdict: [b]{memory['verdict'].upper()}[/b] on {label} ({gpu['source']}): {memory['total_gib']:.2f} of "
            f"{gpu['memory_gib']:.2f} GiB, headroom {memory['headroom_gib']:.2f} GiB (fits = at most "
            f"{gpu['limit_gib']:.2f} GiB, keeping {gpu['headroom_fraction']:.0%} free)"
        )
    if memory.get("host_ram_gib"):
        lines = ", ".join(f"{k} {v:.1f}" for k, v in memory["host_breakdown"].items())
        console.print(f"Host RAM needed: {memory['host_ram_gib']:.1f} GiB ({lines})")


def _print_micro_table(memory: dict[str, Any], console: Console) -> None:
    """The micro-batch sizes that keep the global batch, marking the configured and the auto one."""
    rows = memory.get("micro_batch_table") or []
    if not rows:
        return
    t = Table(title="Micro-batch sizes that keep the global batch (divisors of global / dp)")
    for col in ("micro", "accum", "tensors GiB", "total GiB", "verdict"):
        t.add_column(col, justify="right")
    for row in rows:
        mark = " <- auto" if row["micro_batch_size"] == memory.get("auto_micro_batch_size") else ""
        if row["micro_batch_size"] == memory.get("micro_batch_size"):
            mark += " <- configured"
        t.add_row(
            str(row["micro_batch_size"]),
            str(row["grad_accum_steps"]),
            _gib(row["tensors_gib"]),
            _gib(row["total_gib"]),
            (row["verdict"] or "-") + mark,
        )
    console.print(t)


def _print_remedies(memory: dict[str, Any], console: Console) -> None:
    """The remedies, when the run does not fit: one per entry, the smallest change first, its overrides on
    a line of their own that is never cut or broken (soft wrap: the terminal folds it, a copy is whole)."""
    if not memory.get("remedies"):
        return
    console.print("What to change, the smallest change first (each alone):", highlight=False)
    for i, r in enumerate(memory["remedies"], 1):
        said = Table.grid(padding=(0, 1))
        said.add_column(width=4, justify="right", no_wrap=True)
        said.add_column()
        said.add_row(
            f"{i}.",
            Text(
                f"{r['remedy']}: {_gib(r['total_gib'])} GiB at micro {r['micro_batch_size']} "
                f"({r['verdict'] or '-'}); costs: {r['cost']}"
            ),
        )
        console.print(said)
        console.print(f"     {r['how']}", soft_wrap=True, highlight=False, markup=False)


def _print_checks(memory: dict[str, Any], console: Console) -> None:
    """The FakeTensor trace and the on-device probe, when they ran."""
    if "trace" in memory:
        tr = memory["trace"]
        console.print(
            f"Trace (FakeTensor, 1 and 2 layers extrapolated): {tr['tensors_gib']:.3f} GiB of tensors "
            f"(analytic {memory['tensors_gib']:.3f} GiB, {tr['analytic_vs_trace']:+.1%})"
        )
    if "probe" in memory:
        for r in memory["probe"]["results"]:
            status = "ok" if r["ok"] else ("OOM" if r["oom"] else f"failed: {r['error']}")
            console.print(
                f"Probe micro {r['micro_batch_size']} x {r['grad_accum_steps']}: {status}, "
                f"peak allocated {_gib(r['peak_allocated_gib'])} GiB, reserved {_gib(r['peak_reserved_gib'])} GiB"
            )


def _plan_line(option: dict[str, Any]) -> str:
    n, layers = option["checkpointed_layers"], option["num_layers"]
    ckpt = "all layers" if n >= layers else ("none" if n == 0 else f"first {n} of {layers} layers")
    return (
        f"micro {option['micro_batch_size']} x accum {option['grad_accum_steps']}, checkpointing {ckpt}: "
        f"{option['tokens_per_s']:,.0f} tokens/s, {option['total_gib']:.2f} GiB"
    )


def print_speed(speed: dict[str, Any], console: Console) -> None:
    """The fastest plans that fit (`memory.speed` of `zerofit plan --json`), the chosen one, the runner-up and
    the predicted speed-up."""
    rates = speed["rates_of"] + (
        " (no GPU named: reference rates, only ratios mean something)" if speed["reference_rates"] else ""
    )
    t = Table(
        title=f"Fastest plans that fit: fewest checkpointed layers per micro-batch (speed model: {rates})"
    )
    for col in ("micro", "accum", "checkpointed layers", "total GiB", "predicted tokens/s", "recompute"):
        t.add_column(col, justify="right")
    for o in speed["options"]:
        t.add_row(
            str(o["micro_batch_size"]),
            str(o["grad_accum_steps"]),
            f"{o['checkpointed_layers']} of {o['num_layers']}",
            f"{o['total_gib']:.2f}",
            f"{o['tokens_per_s']:,.0f}",
            f"{o['recompute_fraction']:.0%}",
        )
    console.print(t)
    if speed.get("speed_levers"):
        console.print(f"Speed levers on: {speed['speed_levers']}")
    chosen, runner_up, base = speed["chosen"], speed["runner_up"], speed["baseline"]
    if chosen is None:
        console.print("Chosen plan: none fits")
        return
    configured = speed["configured"]
    same = (configured["micro_batch_size"], configured["checkpointed_layers"]) == (
        chosen["micro_batch_size"],
        chosen["checkpointed_layers"],
    )
    if configured.get("verdict") not in (None, "fits"):
        return  # the run does not fit: what to change leads (`_print_remedies`), not a speed suggestion
    # Which line runs is said on the line: the fastest plan runs only when the config leaves it to `auto`.
    if same:
        console.print(f"Chosen plan: {_plan_line(chosen)}; this run uses it")
    else:
        console.print(f"Fastest plan: {_plan_line(chosen)}; a suggestion: this run uses the configured plan")
    if runner_up is not None:
        console.print(f"Runner-up:   {_plan_line(runner_up)}")
    if base is not None and same:  # one speed-up a screen: the configured plan's, where it is not the fastest
        console.print(
            f"Predicted speed-up: {speed['speedup_vs_baseline']:.2f}x over full checkpointing with the unchunked "
            f"loss at the largest micro-batch that fits (micro {base['micro_batch_size']}: "
            f"{base['tokens_per_s']:,.0f} tokens/s)"
        )
    if not same:
        ratio = chosen["tokens_per_s"] / configured["tokens_per_s"]
        console.print(
            f"Configured:  {_plan_line(configured)}; this run uses it (the fastest plan is {ratio:.2f}x "
            "faster: set batch.micro_batch_size=auto train.activation_checkpointing=auto to run it)"
        )


def check_gpu_options(gpu: str | None, gpu_mem: str | None) -> None:
    """`--gpu` and `--gpu-mem` are alternatives; both at once is a user error."""
    if gpu is not None and gpu_mem is not None:
        raise ConfigError([f"--gpu {gpu} and --gpu-mem {gpu_mem}: give one of them, not both"])
