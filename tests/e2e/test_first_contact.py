"""First contact: 2-rank launches on a cold model cache build the built-in model once and never break.

Three launches in a row, each through torchrun (2 gloo ranks) on its own empty `ZEROFIT_CACHE`: every rank
resolves `tiny-llama` with the process group initialized, as a run does (`_cold_cache_ranks.py`). Before
the fix, transformers' `save_pretrained` wrote nothing on rank 1 under an initialized process group, so
whenever rank 1 won the build race it renamed a tokenizer-only folder into place and the launch failed
(half of such launches on a 2-core machine). So the first launch makes rank 1 build first (rank 0 starts
late), the second rank 0, and the third lets them race.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from launch_helpers import free_port

pytestmark = [pytest.mark.slow, pytest.mark.distributed]

SCRIPT = Path(__file__).with_name("_cold_cache_ranks.py")
BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]


def _launch(cache: Path, late_rank: int | None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "ZEROFIT_CACHE": str(cache), "PYTHONPATH": str(REPO / "src")}
    if late_rank is not None:
        env["ZEROFIT_TEST_LATE_RANK"] = str(late_rank)
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", "2", "--master_port", str(free_port()), str(SCRIPT)]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300, cwd=REPO)


def test_three_cold_cache_launches_in_a_row(tmp_path: Path) -> None:
    from zerofit.models.tiny import MARKER, ensure_tiny_llama, tiny_llama_path

    reference = load_file(ensure_tiny_llama(0) / "model.safetensors")  # this process's (warm) cache
    for attempt, late_rank in enumerate((0, 1, None)):
        cache = tmp_path / f"cache-{attempt}"
        cache.mkdir()
        result = _launch(cache, late_rank)
        assert result.returncode == 0, (
            f"launch {attempt + 1}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
        )
        folder = cache / tiny_llama_path(0).name
        assert sorted(line.split()[1] for line in result.stdout.splitlines() if line.startswith("RANK ")) == [
            "0",
            "1",
        ]
        assert "was incomplete" not in result.stderr  # built once, by one rank: nothing to repair
        listed = json.loads((folder / MARKER).read_text())["files"]
        assert {"config.json", "model.safetensors", "tokenizer.json"} <= listed.keys()
        weights = load_file(folder / "model.safetensors")
        assert weights.keys() == reference.keys()
        assert all(weights[k].equal(reference[k]) for k in reference)  # same seed, same weights
        # Only the folder and its lock file: no temporary build left behind.
        assert sorted(p.name for p in cache.iterdir()) == [f".{folder.name}.lock", folder.name]
