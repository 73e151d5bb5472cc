"""`zerofit presets [--json]`: the engine presets shipped in ds_configs/ (name, strategy, description)."""

from __future__ import annotations

import argparse
import json
from typing import Any

from rich.console import Console
from rich.table import Table

from zerofit.catalogue.presets import list_presets


def presets_listing() -> list[dict[str, Any]]:
    """One row per preset, sorted by name: what `--json` prints."""
    return [
        {"name": p.name, "strategy": p.strategy, "description": p.description}
        for p in list_presets().values()
    ]


def run(args: argparse.Namespace) -> int:
    """Print the presets as a table, or as a JSON list with `--json`."""
    rows = presets_listing()
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    table = Table(title="zerofit presets (distributed.preset=NAME)")
    table.add_column("name", style="bold")
    table.add_column("strategy")
    table.add_column("description")
    for row in rows:
        table.add_row(row["name"], row["strategy"], row["description"])
    Console().print(table)
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the `presets` subcommand."""
    parser = subparsers.add_parser("presets", help="list the DeepSpeed / FSDP presets")
    parser.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    parser.set_defaults(func=run)
