"""One owner per fact: every file name of the run directory is spelled in `zerofit.core.run_layout` only, each
engine's checkpoint layout in the strategy module that writes it only, the data-file suffixes in
`zerofit.core.data_files` only; the contract (docs/contracts.md, "Run directory") names what the layout names,
and every suffix is opened by its kind's reader and never taken for a hub dataset id."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from zerofit.config.rules.data import looks_like_hub_id
from zerofit.core import data_files, run_layout
from zerofit.data import records
from zerofit.strategies import deepspeed, fsdp_layout, single

REPO = Path(__file__).resolve().parents[3]
SRC = REPO / "src" / "zerofit"

# The names whose one spelling is the owner's (generic words such as "model" or "adapter", which are also
# dict keys and kinds, are held by the layout's use but not scanned for).
RUN_DIR_NAMES = {
    run_layout.CONFIG_FILE,
    run_layout.METRICS_FILE,
    run_layout.RUN_INFO_FILE,
    run_layout.SUMMARY_FILE,
    run_layout.CHECKPOINTS_DIR,
    run_layout.BEST_FILE,
    run_layout.LOCK_FILE,
    run_layout.WANDB_RUN_ID_FILE,
    *run_layout.ENGINE_FILES.values(),
}
OWNERS: dict[str, set[str]] = {
    "core/run_layout.py": RUN_DIR_NAMES,
    "strategies/deepspeed.py": {deepspeed.TAG},
    "strategies/fsdp_layout.py": {fsdp_layout.DCP_DIR, fsdp_layout.EXTRA_FILE},
    "strategies/single.py": {single.STATE_FILE},
    # (`.json` also names JSON caches, `.tsv` also picks the csv reader's delimiter.)
    "core/data_files.py": set(data_files.DATA_FILE_SUFFIXES) - {".json", ".tsv"},
}


def _string_constants(path: Path) -> set[str]:
    return {
        node.value
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.Constant) and isinstance(node.value, str)
    }


def test_each_name_is_spelled_by_its_owner_only() -> None:
    restated = []
    for path in sorted(SRC.rglob("*.py")):
        module = path.relative_to(SRC).as_posix()
        for owner, names in OWNERS.items():
            if module != owner:
                restated += [
                    f"{module}: {name!r} (owned by {owner})" for name in _string_constants(path) & names
                ]
    assert not restated, "\n".join(restated)


def test_the_contract_names_every_file_of_the_layout() -> None:
    text = (REPO / "docs" / "contracts.md").read_text(encoding="utf-8")
    section = text.split("## 3. Run directory", 1)[1].split("\n## ", 1)[0]
    quoted = set(re.findall(r"`([^`]+)`", section))
    names = RUN_DIR_NAMES | {run_layout.ADAPTER_DIR, run_layout.MODEL_DIR, run_layout.WANDB_DIR}
    missing = [name for name in sorted(names) if not any(name in q.strip("/").split("/") for q in quoted)]
    assert not missing, f"docs/contracts.md's run directory does not name {missing}"


@pytest.mark.parametrize("suffix", data_files.DATA_FILE_SUFFIXES)
def test_every_data_file_suffix_is_a_file_read_by_its_kind(tmp_path: Path, suffix: str) -> None:
    assert not looks_like_hub_id(f"org/data{suffix}")  # a missing local file, not a dataset on the hub
    path = tmp_path / f"data{suffix.upper()}"  # suffixes match in any case
    kind = data_files.DATA_FILE_KINDS[suffix]
    if kind == "parquet":  # its reader opens the file's footer at once
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": ["a"]}), path)
    else:
        path.write_text("")
    assert type(records.open_source(path)) is records._READERS[kind]
