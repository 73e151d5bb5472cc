"""What differs between runs, and how they turned out: the tables and plots of `zerofit compare`.

The config table lists only keys whose values differ (the run name is the column header), so a sweep over
presets shows one `distributed.preset` row and a split sweep one `split` row; the identity keys that are
equal everywhere are named in the caption, so the reader still knows what was held fixed. The outcome
table comes from each run's per-step rows through `RunSummary`, exactly as the end-of-run summary.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rich.console import Group
from rich.table import Table
from rich.text import Text

from zerofit.config.loader import flatten
from zerofit.metrics.keys import EVAL_LOSS, MEM_SOURCE, PEAK_GIB, REWARD, harness_task_metric, rank_field
from zerofit.metrics.runs import LoadedRun

# Keys that never explain a difference in outcome (names, where files go, W&B bookkeeping).
# The batch keys are summarized by the derived `split` row (g{global}-m{micro}x{gas}x{dp}).
_IGNORED_PREFIXES = (
    "run_name",
    "output_dir",
    "run_dir",
    "logging.wandb.",
    "logging.console",
    "git.dirty",
    "batch.",
)
# Shown in the caption when equal in every run: what a comparison usually holds fixed.
IDENTITY_KEYS = (
    "model.name_or_path",
    "method",
    "distributed.strategy",
    "distributed.preset",
    "split",
    "train.precision",
    "optimizer.name",
    "data.max_seq_len",
)
_MISSING = "-"
_RANK_STYLES = ("-", "--", ":", "-.")
_RUN_STYLES = ("-", "--", "-.", ":")
# The x label of the plots against optimizer steps (whole-number ticks).
STEP_AXIS = "optimizer step"
# Legend text in points: matplotlib's axis-label size (its "x-small" was unreadable in a 640 px PNG).
LEGEND_FONT_SIZE = 10
# (label, xs, ys) or (label, xs, ys, matplotlib line style kwargs)
_Series = tuple[Any, ...]
_EXTRA_PREFIXES = ("versions.", "git.")


def comparable_config(run: LoadedRun) -> dict[str, Any]:
    """A run's flat config plus derived identity: method, split (`g16-m4x2x2`), versions and commit."""
    flat = flatten(run.config)
    extra = run.extra
    batch = run.config.get("batch", {}) if isinstance(run.config.get("batch"), dict) else {}
    plan = extra.get("batch_plan") if isinstance(extra.get("batch_plan"), dict) else {}
    first = run.rows[0] if run.rows else {}
    dp = plan.get("dp_size") or first.get("dp_size") or extra.get("world_size")
    micro = plan.get("micro_batch_size") or batch.get("micro_batch_size") or first.get("micro_batch_size")
    gas = plan.get("grad_accum_steps") or batch.get("grad_accum_steps") or first.get("grad_accum_steps")
    glob = plan.get("global_batch_size") or batch.get("global_batch_size")
    flat["split"] = f"g{glob}-m{micro}x{gas}x{dp}"
    lora = run.config.get("lora", {})
    quant = run.config.get("quantization", {})
    if "method" not in flat and isinstance(lora, dict):
        load_in = quant.get("load_in", "none") if isinstance(quant, dict) else "none"
        flat["method"] = (
            "full"
            if not lora.get("enabled", True)
            else {"4bit": "qlora", "8bit": "lora-8bit"}.get(load_in, "lora")
        )
    for source in ("versions", "git"):
        if isinstance(extra.get(source), dict) and source not in run.config:
            flat.update(flatten(extra[source], f"{source}."))
    return {k: v for k, v in flat.items() if not k.startswith(_IGNORED_PREFIXES)}


def config_differences(runs: list[LoadedRun]) -> tuple[list[tuple[str, list[Any]]], list[str]]:
    """Rows `(key, [value per run])` for keys that differ, and the identity keys equal in all runs.

    Library versions and the git commit are compared only between runs that recorded them (runs made
    before the metrics sinks existed, or by hand, have none): a missing record is not a difference.
    """
    configs = [comparable_config(r) for r in runs]
    recorded = [c for c in configs if any(k.startswith(_EXTRA_PREFIXES) for k in c)]
    keys = sorted({k for c in configs for k in c}, key=_key_order)
    rows = []
    same = []
    for key in keys:
        values = [c.get(key, _MISSING) for c in configs]
        if key.startswith(_EXTRA_PREFIXES):
            present = [_display(c.get(key, _MISSING)) for c in recorded]
            if len(set(present)) > 1:
                rows.append((key, values))
            continue
        if any(_display(v) != _display(values[0]) for v in values[1:]):
            rows.append((key, values))
        elif key in IDENTITY_KEYS:
            same.append(f"{key}={_display(values[0])}")
    return rows, same


def _key_order(key: str) -> tuple[int, str]:
    # Identity keys first, in their stated order; then everything else alphabetically.
    return (IDENTITY_KEYS.index(key), "") if key in IDENTITY_KEYS else (len(IDENTITY_KEYS), key)


def _display(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, list):
        return ",".join(_display(v) for v in value)
    return str(value)


def _fmt(value: Any, spec: str, unit: str = "") -> str:
    return _MISSING if value is None else format(value, spec) + unit


def outcome_rows(runs: list[LoadedRun]) -> list[tuple[str, list[str]]]:
    """Rows `(metric, [formatted value per run])`: loss, memory per rank, throughput, time."""
    summaries = [r.summary() for r in runs]
    max_rank = max((max(r.ranks(), default=-1) for r in runs), default=-1)
    rows: list[tuple[str, list[str]]] = [
        ("optimizer steps", [str(s["steps"]) for s in summaries]),
        ("final loss", [_fmt(s["final_loss"], ".4f") for s in summaries]),
        ("min loss", [_fmt(s["min_loss"], ".4f") for s in summaries]),
    ]
    if any(s.get("eval_loss") is not None for s in summaries):
        rows += [
            ("final eval loss", [_fmt(s.get("eval_loss"), ".4f") for s in summaries]),
            ("min eval loss", [_fmt(s.get("min_eval_loss"), ".4f") for s in summaries]),
        ]
    rows += preference_rows(runs)
    rows += harness_rows(runs)
    rows += [
        ("tokens seen", [_fmt(s["tokens_seen"], ",.0f") for s in summaries]),
        ("mean tokens/s", [_fmt(s["mean_tokens_per_s"], ",.1f") for s in summaries]),
        ("peak memory, max rank", [_fmt(s["peak_gib"], ".3f", " GiB") for s in summaries]),
    ]
    for rank in range(max_rank + 1):
        rows.append(
            (f"  rank {rank} peak", [_fmt(s.get(f"peak_gib_rank{rank}"), ".3f", " GiB") for s in summaries])
        )
    rows.append(("memory source", [str(s.get("mem_source") or _MISSING) for s in summaries]))
    # The planner predicts device tensor memory: comparable only with CUDA runs, not with process RSS.
    if any(s.get("predicted_peak_gib") is not None and s.get("mem_source") == "cuda" for s in summaries):
        rows.append(
            (
                "planner predicted peak (tensors)",
                [_fmt(s.get("predicted_peak_gib"), ".3f", " GiB") for s in summaries],
            )
        )
    rows.append(("wall time", [_fmt(s["wall_s"], ".1f", " s") for s in summaries]))
    rows.append(("read from", [r.source for r in runs]))
    return rows


# A preference run's (`train.objective` dpo / simpo / orpo / kto) or a GRPO run's per-step metrics, TRL's names: the last value
# of each is shown (and rewards/accuracies plotted) when any run logged it.
PREFERENCE_KEYS = (
    "rewards/accuracies",
    "rewards/margins",
    "rewards/chosen",
    "rewards/rejected",
    "logps/chosen",
    "logps/rejected",
    "eval/rewards/accuracies",
    "eval/rewards/margins",
    "kl",  # KTO's reference point z0 (`zerofit.objectives.kto.loss`); GRPO's KL to the reference
    "eval/kl",
    # GRPO's (`train.objective: grpo`, zerofit.loop.rollout): the step's mean reward and its completions
    REWARD,
    "reward_std",
    "completions/mean_length",
    "completions/truncated_fraction",
    "clip_ratio",
    "entropy",
)


def _last(run: LoadedRun, key: str) -> Any:
    values = run.series(key)[1]
    return values[-1] if values else None


def preference_rows(runs: list[LoadedRun]) -> list[tuple[str, list[str]]]:
    """`final rewards/accuracies` and the other preference metrics, for the keys any run logged."""
    return [
        (f"final {key}", [_fmt(_last(run, key), ".4f") for run in runs])
        for key in PREFERENCE_KEYS
        if any(run.series(key)[0] for run in runs)
    ]


def harness_rows(runs: list[LoadedRun]) -> list[tuple[str, list[str]]]:
    """Each lm-eval score `harness/<task>/<metric>` any run logged (`zerofit eval`, `eval.harness`), its
    newest value per run, with the step it scored."""
    keys = sorted({key for run in runs for row in run.rows for key in row if harness_task_metric(key)})
    rows = []
    for key in keys:
        cells = []
        for run in runs:
            steps, values = run.series(key)
            cells.append(f"{values[-1]:.4f} (step {steps[-1]:.0f})" if values else _MISSING)
        rows.append((key, cells))
    return rows


def unique_labels(runs: list[LoadedRun]) -> list[str]:
    """Run labels, made unique with a `#n` suffix where two runs share a name."""
    labels: list[str] = []
    for run in runs:
        label = run.label
        n = 2
        while label in labels:
            label = f"{run.label}#{n}"
            n += 1
        labels.append(label)
    return labels


def build_tables(runs: list[LoadedRun]) -> tuple[Group, Table]:
    """The config-difference table (with the held-fixed keys below it) and the outcome table.

    Runs are columns, so a comparison of two to four runs reads left to right.
    """
    labels = unique_labels(runs)
    diffs, same = config_differences(runs)
    config_table = Table(title="Config: what differs")
    config_table.add_column("key", style="bold")
    for label in labels:
        config_table.add_column(label, overflow="fold")
    if not diffs:
        config_table.add_row("(no differences)", *[""] * len(labels))
    for key, values in diffs:
        config_table.add_row(key, *[_display(v) for v in values])
    held = Text("same in all: " + (", ".join(same) if same else "-"), style="dim")
    outcome_table = Table(title="Outcome")
    outcome_table.add_column("metric", style="bold")
    for label in labels:
        outcome_table.add_column(label, justify="right", overflow="fold")
    for name, values in outcome_rows(runs):
        outcome_table.add_row(name, *values)
    return Group(config_table, held), outcome_table


def _draw(plt: Any, path: Path, titles: tuple[str, str, str], series: list[_Series]) -> list[str]:
    """Draw one figure (`titles`: title, x label, y label) of the series that have data, write it to
    `path`, and return the labels it plotted (a series with no points is left out of the legend too; a
    label starting with `_`, a raw series drawn faint under its smoothed one, is matplotlib's no-legend)."""
    fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    plotted = []
    for label, xs, ys, *style in series:
        if xs:
            ax.plot(xs, ys, label=label, marker="." if len(xs) < 30 else None, **(style[0] if style else {}))
            plotted.append(label)
    title, xlabel, ylabel = titles
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    style_axes(ax, integer_x=xlabel == STEP_AXIS)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return [label for label in plotted if not str(label).startswith("_")]


def style_axes(ax: Any, integer_x: bool) -> None:
    """A grid, a legend at the axis labels' size (LEGEND_FONT_SIZE: readable in a 640 px PNG, unlike
    matplotlib's x-small), and whole-number ticks on a step axis (a 10-step run otherwise shows 2.5)."""
    from matplotlib.ticker import MaxNLocator

    ax.grid(alpha=0.3)
    if integer_x:
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    if any(not str(line.get_label()).startswith("_") for line in ax.get_lines()):
        ax.legend(fontsize=LEGEND_FONT_SIZE)


def smoothing_window(points: int) -> int:
    """How many steps the throughput curve averages: a tenth of the run, 1 to 20 (a 10-step run is raw)."""
    return max(1, min(20, points // 10))


def trailing_mean(values: list[float], window: int) -> list[float]:
    """Each value replaced by the mean of it and up to `window - 1` values before it."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def _throughput_series(runs: list[LoadedRun], labels: list[str]) -> tuple[list[_Series], int]:
    """tokens/s per run: the raw per-step values faint (no legend entry), their trailing mean over
    `smoothing_window` steps on top (one step's tokens/s jumps with its batch's lengths and the host's load);
    returns the series and the longest window used."""
    series: list[_Series] = []
    widest = 1
    for i, (label, run) in enumerate(zip(labels, runs, strict=True)):
        xs, ys = run.series("tokens_per_s")
        window = smoothing_window(len(xs))
        widest = max(widest, window)
        color = {"color": f"C{i % 10}"}
        if window > 1:
            series.append((f"_{label} per step", xs, ys, {**color, "alpha": 0.25, "linewidth": 0.8}))
        series.append((label, xs, trailing_mean([float(y) for y in ys], window), {**color, "linewidth": 1.8}))
    return series, widest


def _per_run_series(runs: list[LoadedRun], labels: list[str], key: str, x: str) -> list[_Series]:
    """One series of `key` against `x` per run. Runs often overlap exactly (same global batch, different
    engine): earlier runs are drawn thicker and later ones dashed on top, so every curve stays visible."""
    return [
        (
            label,
            *run.series(key, x=x),
            {"linewidth": max(1.0, 2.6 - 0.7 * i), "linestyle": _RUN_STYLES[i % 4]},
        )
        for i, (label, run) in enumerate(zip(labels, runs, strict=True))
    ]


def _memory_series(runs: list[LoadedRun], labels: list[str]) -> list[_Series]:
    """Peak memory per rank: one colour per run, one line style per rank, so runs stay apart and the
    ranks of a run stay together."""
    memory_series: list[_Series] = []
    for index, (label, run) in enumerate(zip(labels, runs, strict=True)):
        for rank in run.ranks():
            style = {"color": f"C{index % 10}", "linestyle": _RANK_STYLES[rank % len(_RANK_STYLES)]}
            memory_series.append((f"{label} rank{rank}", *run.series(rank_field(rank, PEAK_GIB)), style))
    return memory_series


def plot_runs(runs: list[LoadedRun], out_dir: str | Path) -> dict[Path, list[str]]:
    """Write the comparison PNGs into `out_dir`; returns each file with the labels of its plotted series.

    loss_vs_step.png, eval_loss_vs_step.png (when a run has evaluations), rewards_accuracies_vs_step.png and
    eval_rewards_accuracies_vs_step.png (preference runs), loss_vs_tokens.png,
    peak_memory_per_rank.png (one line per run and rank), tokens_per_s.png. Series with no data are left out
    (and so not returned).
    """
    import matplotlib

    matplotlib.use("Agg")  # files only; never needs a display
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    labels = unique_labels(runs)
    written: dict[Path, list[str]] = {}

    def figure(name: str, title: str, xlabel: str, ylabel: str, series: list[_Series]) -> None:
        path = out / name
        written[path] = _draw(plt, path, (title, xlabel, ylabel), series)

    def per_run(key: str, x: str = "step") -> list[_Series]:
        return _per_run_series(runs, labels, key, x)

    figure("loss_vs_step.png", "Loss (token-weighted, global batch)", STEP_AXIS, "loss", per_run("loss"))
    if any(run.series(EVAL_LOSS)[0] for run in runs):
        figure(
            "eval_loss_vs_step.png",
            "Eval loss (token-weighted, whole eval set)",
            STEP_AXIS,
            "eval loss",
            per_run(EVAL_LOSS),
        )
    for key in ("rewards/accuracies", "eval/rewards/accuracies", REWARD):
        if any(run.series(key)[0] for run in runs):
            name = key.replace("/", "_") + "_vs_step.png"
            over = "completions" if key == REWARD else "pairs"
            figure(name, f"{key} (global batch mean over {over})", STEP_AXIS, key, per_run(key))
    figure(
        "loss_vs_tokens.png",
        "Loss vs tokens seen",
        "valid label tokens seen",
        "loss",
        per_run("loss", x="tokens_seen"),
    )
    memory_series = _memory_series(runs, labels)
    sources = sorted({str(r.rows[0].get(MEM_SOURCE, "?")) for r in runs if r.rows})
    figure(
        "peak_memory_per_rank.png",
        f"Peak memory per rank since last log ({', '.join(sources)})",
        STEP_AXIS,
        "GiB",
        memory_series,
    )
    throughput, window = _throughput_series(runs, labels)
    smoothed = f" (mean of the last {window} steps; per step faint)" if window > 1 else ""
    figure("tokens_per_s.png", f"Throughput{smoothed}", STEP_AXIS, "tokens/s", throughput)
    return written
