"""`zerofit compare RUN_DIR ... [--out DIR]`: what differs between runs, how they turned out, and plots.

Reads each run's `config.yaml` and `metrics.jsonl` (or, when `metrics.jsonl` is absent, its W&B offline
run file, else its TensorBoard event files: a run's `tensorboard/` folder can be passed itself), prints two tables (config differences, outcomes) and writes PNG plots plus `compare.json`.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console

from zerofit.core.errors import DataError


def register(subparsers: Any) -> None:
    """Add the `compare` subcommand."""
    parser = subparsers.add_parser(
        "compare",
        help="compare runs: config differences, loss, memory per rank, throughput, plots",
        description=__doc__,
    )
    parser.add_argument("runs", nargs="+", metavar="RUN_DIR", help="run directories (output_dir/run_name)")
    parser.add_argument(
        "--out",
        default=None,
        help="folder for the plots and compare.json (default: RUN_DIR/compare-<timestamp> of the first run, "
        "beside what it compares and out of the working tree)",
    )
    parser.add_argument("--no-plots", action="store_true", help="print the tables only")
    parser.set_defaults(func=run)


def default_out(first_run: Path) -> Path:
    """Where a comparison goes without `--out`: a `compare-<timestamp>` folder inside the first run's folder
    (not the working directory, where each comparison left a folder; not beside the runs, where a later
    `zerofit compare runs/*` would take it for a run)."""
    return Path(first_run) / f"compare-{time.strftime('%Y%m%d-%H%M%S')}"


def load_runs(paths: list[str | Path]) -> list[Any]:
    """The runs to compare (`zerofit.metrics.runs.LoadedRun`); a DataError when none logged a step."""
    from zerofit.metrics.runs import load_run

    runs = [load_run(p) for p in paths]
    empty = [str(r.path) for r in runs if not r.rows]
    if len(empty) == len(runs):
        raise DataError(
            f"no logged steps in {', '.join(empty)}: metrics.jsonl is empty (did the runs reach their first "
            "optimizer step?)"
        )
    return runs


def write_comparison(runs: list[Any], out: Path) -> dict[str, Any]:
    """The plots and `compare.json` in `out`; returns what compare.json holds (`zerofit compare` and `zerofit
    studio`'s compare page both show it)."""
    from zerofit.metrics.compare import config_differences, outcome_rows, plot_runs, unique_labels

    written = plot_runs(runs, out)
    diffs, same = config_differences(runs)
    report = {
        "runs": [
            {"label": label, "path": str(r.path), "source": r.source}
            for label, r in zip(unique_labels(runs), runs, strict=True)
        ],
        "config_differences": {key: [str(v) for v in values] for key, values in diffs},
        "same_in_all": same,
        "outcome": {name: values for name, values in outcome_rows(runs)},
        "summaries": [r.summary() for r in runs],
        "plots": {str(path): series for path, series in written.items()},
    }
    (out / "compare.json").write_text(json.dumps(report, indent=2, default=str) + "\n", encoding="utf-8")
    return report


def run(args: argparse.Namespace) -> int:
    """Load the runs, print the tables, write plots and `compare.json`."""
    from zerofit.metrics.compare import build_tables

    runs = load_runs(args.runs)
    console = Console()
    for table in build_tables(runs):
        console.print(table)
    if args.no_plots:
        return 0
    out = Path(args.out) if args.out else default_out(runs[0].path)
    report = write_comparison(runs, out)
    console.print(f"wrote {out / 'compare.json'}", highlight=False)
    for path in report["plots"]:
        console.print(f"wrote {path}", highlight=False)
    return 0
