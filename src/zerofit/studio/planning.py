"""The plan page's answer: `zerofit plan --json`'s report for the form, through the command line's own function
(`zerofit.commands.plan.plan_report`), with the figures the page draws (the per-rank memory as stacked
segments) and the equivalent terminal commands. A user error comes back as the CLI's paragraph, keyed by the
form field it names (`form.field_of`), never as a page-side rule.
"""

from __future__ import annotations

from typing import Any

from zerofit.commands.plan import default_device, plan_report
from zerofit.core.errors import ConfigError, ZerofitError
from zerofit.studio.form import CommandLine, PlanForm, base_form, field_of
from zerofit.studio.security import Workspace

# The stacked bar's segments, in drawing order, and the words of the planner's breakdown that pick each
# (the first match wins, so "fp32 master weights" is optimizer state, not weights); what matches none is a
# buffer (ZeRO buckets, the CUDA context, cuBLAS workspace, fragmentation).
SEGMENTS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("optimizer", ("optimizer", "master weights")),
    ("gradients", ("gradient",)),
    ("activations", ("activations",)),
    ("weights", ("weights",)),
)
BUFFERS, HEADROOM = "buffers", "headroom"


def segment_of(label: str) -> str:
    """The bar segment a breakdown line belongs to."""
    return next((name for name, words in SEGMENTS if any(w in label for w in words)), BUFFERS)


def memory_bars(memory: dict[str, Any]) -> dict[str, Any]:
    """Each rank's memory as stacked segments in GiB (every line of the breakdown and the allowance counted
    once) and the headroom left under the card's limit; the lines of each segment kept for its tooltip."""
    segments: dict[str, float] = {name: 0.0 for name, _ in SEGMENTS} | {BUFFERS: 0.0}
    lines: dict[str, list[str]] = {name: [] for name in segments}
    for part in ("breakdown", "allowance"):
        for label, gib in (memory.get(part) or {}).items():
            name = segment_of(label)
            segments[name] += gib
            lines[name].append(f"{gib:.2f} GiB {label}")
    gpu = memory.get("gpu")
    limit = gpu["limit_gib"] if gpu else None
    headroom = max(limit - memory["total_gib"], 0.0) if limit is not None else None
    return {
        "segments": [
            {"name": name, "gib": round(gib, 4), "lines": lines[name]} for name, gib in segments.items()
        ],
        HEADROOM: None if headroom is None else round(headroom, 4),
        "total_gib": memory["total_gib"],
        "limit_gib": limit,
        "card_gib": gpu["memory_gib"] if gpu else None,
    }


def problems_by_field(exc: ZerofitError) -> dict[str, list[str]]:
    """The error's paragraphs by the form field each names (a ConfigError's problems one by one, each as the
    CLI would print it alone)."""
    texts = [str(ConfigError([p])) for p in exc.problems] if isinstance(exc, ConfigError) else [str(exc)]
    out: dict[str, list[str]] = {}
    for text in texts:
        out.setdefault(field_of(text), []).append(text)
    return out


def plan_form(workspace: Workspace, form: PlanForm) -> dict[str, Any]:
    """The page's answer for `form`: the report, the bars and the commands, or the error by field."""
    try:
        config = workspace.path(form.config, "config")
        workspace.model(form.model)  # a local model folder stays inside the workspace too
        args = CommandLine.of(form, base_form(str(config)))
        report, _ = plan_report(
            str(config), args.overrides, args.world_size, gpu=args.gpu, device=default_device()
        )
    except ZerofitError as exc:
        return {"form": form.as_dict(), "error": str(exc), "problems": problems_by_field(exc)}
    return {
        "form": form.as_dict(),
        "report": report,
        "bars": memory_bars(report["memory"]),
        "commands": args.lines(),
        "overrides": args.overrides,
    }
