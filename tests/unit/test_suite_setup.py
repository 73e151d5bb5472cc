"""How `make test` shares 2 cores between two pytest-xdist workers without the workers disturbing each other:
the per-worker thread share (tests/conftest.py), a side-by-side launch's share (`_cpu_share`), disjoint
rendezvous ports per worker (`free_port`, `worker_ports`: a test that watches DeepSpeed's shared memory counts
only its own worker's segments), and a serial phase for the tests that watch every process of the machine."""

from __future__ import annotations

import importlib.util
import os
import re
import runpy
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import launch_helpers
from launch_helpers import Launch, _cpu_share, free_port

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent
CORES = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _recipe(target: str) -> list[str]:
    """The lines of a Makefile target's recipe (up to the blank line after it)."""
    lines = (REPO / "Makefile").read_text().splitlines()
    start = lines.index(f"{target}: setup") + 1
    return lines[start : lines.index("", start)]


def test_make_test_runs_two_workers_then_the_serial_tests_alone() -> None:
    makefile = (REPO / "Makefile").read_text()
    (xdist,) = re.findall(r"^XDIST \?= (.*)$", makefile, re.M)
    assert "-n 2" in xdist and "--dist loadfile" in xdist  # whole modules: a module's launches run once
    runs = [line for line in _recipe("test") if "pytest" in line]
    assert len(runs) == 2 and "--durations=25" in runs[0] and "--durations=25" in runs[1]
    assert '$(XDIST) -m "not serial"' in runs[0] and "XDIST" not in runs[1]
    assert "-m serial $(SERIAL_FILES) $(PYTEST_ARGS)" in runs[1]
    assert "|| rc=" in runs[0]  # a failure in the parallel phase still lets the serial phase run
    assert re.search(r'^dev = \[.*"pytest-xdist', (REPO / "pyproject.toml").read_text(), re.M)


def test_a_test_that_watches_shared_memory_counts_only_its_own_workers_segments() -> None:
    # test_engines checks that DeepSpeed's CPU launches leave nothing in /dev/shm while the other worker's
    # DeepSpeed launches run and have their segments there: it counts only the segments named with its own
    # worker's rendezvous ports (`worker_ports`), so it needs no serial phase.
    watching = [p for p in TESTS.rglob("test_*.py") if "deepspeed_shm_segments()" in p.read_text()]
    assert watching, "no test reads /dev/shm any more: drop this check"
    reading = [p.name for p in TESTS.rglob("*.py") if '"/dev/shm"' in p.read_text() and p != Path(__file__)]
    assert reading == ["launch_helpers.py"]  # every test reads it through `deepspeed_shm_segments`


def test_a_worker_counts_the_segments_on_its_own_ports(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    own, other = launch_helpers.worker_ports()[3], launch_helpers.worker_ports().start - 5
    for port in (own, other):
        (tmp_path / f"deepspeed_allreduce_buffer_0_127.0.0.1_{port}_0").write_bytes(b"")
    (tmp_path / "unrelated").write_bytes(b"")
    assert launch_helpers.deepspeed_shm_segments(tmp_path) == {
        tmp_path / f"deepspeed_allreduce_buffer_0_127.0.0.1_{own}_0"
    }


def test_each_worker_rendezvouses_on_its_own_band_of_ports(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    bands = {}
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setattr(launch_helpers, "_next_port", [])
        bands[worker] = launch_helpers.worker_ports()
        assert all(free_port() in bands[worker] for _ in range(20))
    assert not set(bands["gw0"]) & set(bands["gw1"])


def test_each_worker_gets_its_share_of_the_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", os.environ["PATH"])  # (conftest prepends the venv to it again)
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    runpy.run_path(str(TESTS / "conftest.py"))
    assert os.environ["OMP_NUM_THREADS"] == str(max(1, CORES // 2))
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # a user's own setting wins
    runpy.run_path(str(TESTS / "conftest.py"))
    assert os.environ["OMP_NUM_THREADS"] == "3"


def test_this_worker_runs_torch_on_its_share() -> None:
    import torch

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT") or 1)
    if workers < 2 or os.environ["OMP_NUM_THREADS"] != str(max(1, CORES // workers)):
        pytest.skip("not under pytest-xdist workers that conftest.py set the threads of")
    assert torch.get_num_threads() == max(1, CORES // workers)


def test_a_one_process_launch_shares_the_cores_with_the_other_worker() -> None:
    python, ranks = Launch("a", "python"), Launch("b", "deepspeed")
    xdist = {"PYTEST_XDIST_WORKER_COUNT": "2"}
    # Alone in its module, but beside the other worker: half the cores (on main: all of them).
    assert _cpu_share(python, 1, xdist) == {"OMP_NUM_THREADS": str(max(1, CORES // 2))}
    assert _cpu_share(python, 2, xdist) == {"OMP_NUM_THREADS": str(max(1, CORES // 4))}
    assert _cpu_share(python, 2, {}) == {"OMP_NUM_THREADS": str(max(1, CORES // 2))}
    assert _cpu_share(python, 1, {}) == {}  # alone on the machine: torch's default
    assert _cpu_share(python, 2, {"OMP_NUM_THREADS": "1"}) == {"OMP_NUM_THREADS": "1"}  # never more than set
    assert _cpu_share(ranks, 2, xdist) == {}  # zerofit splits the cores between a launch's ranks itself


def test_two_workers_never_offer_the_same_rendezvous_port(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "2")
    offered: dict[str, set[int]] = {}
    for worker in ("gw0", "gw1"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", worker)
        monkeypatch.setattr(launch_helpers, "_next_port", [])
        offered[worker] = {free_port() for _ in range(50)}
    assert len(offered["gw0"]) == len(offered["gw1"]) == 50 and not offered["gw0"] & offered["gw1"]
    # Below the kernel's ephemeral range, where bind(0) and outgoing connections (gloo's) take ports from.
    assert all(launch_helpers.PORTS.start <= port < 32768 for port in offered["gw0"] | offered["gw1"])
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", free_port()))  # free when offered


def test_the_suite_uses_the_caches_a_launch_uses(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # The caches of checkout-local .cache/ made a fresh clone's `make test` compile DeepSpeed's CPU ops again
    # (~135 CPU-s on 2 cores) and rebuild every model `make demo` had just built.
    from zerofit.core.cache_dirs import cache_root, extensions_dir

    monkeypatch.setenv("PATH", os.environ["PATH"])  # (conftest prepends the venv to it again)
    for name in ("ZEROFIT_CACHE", "TORCH_EXTENSIONS_DIR"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    runpy.run_path(str(TESTS / "conftest.py"))
    assert os.environ["ZEROFIT_CACHE"] == str(cache_root()) == str(tmp_path / ".cache" / "zerofit")
    assert (
        os.environ["TORCH_EXTENSIONS_DIR"] == str(extensions_dir()) == str(cache_root() / "torch_extensions")
    )
    monkeypatch.setenv("ZEROFIT_CACHE", str(tmp_path / "mine"))  # a user's (or CI's) own cache is kept
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    runpy.run_path(str(TESTS / "conftest.py"))
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(tmp_path / "mine" / "torch_extensions")


def test_ci_runs_the_suite_on_the_cache_the_demo_filled() -> None:
    # As a newcomer's `make demo` and `make test` share ~/.cache/zerofit: the demo starts empty, the suite reuses it.
    ci = (REPO / ".ci" / "run").read_text()
    demo = re.search(r'^make demo ZEROFIT_CACHE="\$(\w+)"', ci, re.M)
    assert demo and re.search(rf'^ZEROFIT_CACHE="\${demo.group(1)}" make test$', ci, re.M)
    assert re.search(rf"^{demo.group(1)}=\$\(mktemp -d\)$", ci, re.M)  # empty for the demo


def _stale_or_missing_bytecode(folder: Path) -> list[str]:
    """The modules under `folder` whose cached bytecode is missing or was compiled from an older source."""
    stale = []
    for source in sorted(folder.rglob("*.py")):
        cached = Path(importlib.util.cache_from_source(str(source)))
        # A timestamp .pyc's header: magic, flags 0, then the mtime (seconds, 32 bits) of its source.
        header = cached.read_bytes()[:16] if cached.is_file() else b""
        compiled_from = int.from_bytes(header[8:12], "little") if header[4:8] == bytes(4) else None
        if compiled_from != int(source.stat().st_mtime) & 0xFFFFFFFF:
            stale.append(str(source.relative_to(REPO)))
    return stale


@pytest.mark.skipif(
    Path(sys.prefix).resolve() != (REPO / ".venv").resolve(), reason="runs in the Makefile's venv"
)
def test_make_setup_writes_the_bytecode_every_launched_process_loads() -> None:
    """With PYTHONDONTWRITEBYTECODE set, no process caches what it compiles: `make setup` (which `make test` and
    `make demo` run first) writes the bytecode of src/, launchers/, benchmarks/ and tests/ instead, so the
    suite's launched processes load zerofit's modules compiled."""
    probe = REPO / "src" / "zerofit" / "core" / "__init__.py"
    cached = Path(importlib.util.cache_from_source(str(probe)))
    cached.unlink(missing_ok=True)  # as after an edit with PYTHONDONTWRITEBYTECODE set
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}
    made = subprocess.run(["make", "-s", "setup"], cwd=REPO, env=env, capture_output=True, text=True)
    assert made.returncode == 0, made.stdout + made.stderr
    assert cached.is_file()
    for folder in ("src", "launchers", "benchmarks", "tests"):
        assert _stale_or_missing_bytecode(REPO / folder) == [], folder


def test_the_serial_phase_collects_the_files_that_hold_serial_tests() -> None:
    """SERIAL_FILES (the files the serial phase collects) holds the W&B process-tree test; tests/conftest.py
    refuses a serial test whose file the Makefile's grep would miss."""
    shown = subprocess.run(
        [
            "make",
            "-s",
            "--no-print-directory",
            "--eval",
            "show-serial: ; @echo $(SERIAL_FILES)",
            "show-serial",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert shown.returncode == 0, shown.stderr
    files = set(shown.stdout.split())
    assert "tests/unit/metrics/test_metrics_sinks.py" in files
    assert all(Path(f).name.startswith("test_") and "mark.serial" in (REPO / f).read_text() for f in files)
    subset = ["make", "-s", "--no-print-directory", "PYTEST_ARGS=tests/unit/config", "--eval"]
    shown = subprocess.run(
        [*subset, "show-serial: ; @echo $(SERIAL_FILES)", "show-serial"],
        cwd=REPO,
        capture_output=True,
        text=True,
    )
    assert shown.stdout.split() == []  # a subset's serial phase collects only what PYTEST_ARGS names


def test_a_serial_test_its_file_does_not_name_is_refused_at_collection(tmp_path: Path) -> None:
    (tmp_path / "conftest.py").write_text(
        "import pytest\nserial = pytest.mark.serial\n"
        f"from importlib.util import spec_from_file_location, module_from_spec\n"
        f"spec = spec_from_file_location('zconf', {str(TESTS / 'conftest.py')!r})\n"
        "module = module_from_spec(spec); spec.loader.exec_module(module)\n"
        "pytest_collection_modifyitems = module.pytest_collection_modifyitems\n"
    )
    (tmp_path / "test_alias.py").write_text(
        "from conftest import serial\n\n@serial\ndef test_x():\n    pass\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "serial", str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 4 and "marked serial but its file never says" in proc.stdout + proc.stderr
