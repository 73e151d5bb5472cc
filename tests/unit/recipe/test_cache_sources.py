"""A cache whose digest was recomputed is not trusted: runs on the built-in tiny model, in this
process, against the tokenization cache and DPO's precomputed reference, poisoned with a matching digest.

    tokenization   input_ids.npy remapped through a permutation of the vocabulary, meta.json's digest
                   rewritten with zerofit's own `_content_digest`: every structural check passes
    reference      the chosen column of the table shifted by -50 (step 1's DPO loss went to 0.0067, reward
                   accuracy 1.0), the metadata's sha256 rewritten with zerofit's own `_table_digest`

Each poisoned cache is caught by its sample check: the run rebuilds it with one line naming the cache, and
its losses are the genuine run's. A genuine cache is read (the plan says so) with the same losses as the
run that wrote it, and no note.

    launch           launcher   what
    genuine          api        writes the cache (tokenization, then DPO's reference)
    hit              api        reads the genuine cache
    poisoned         api        meets the poisoned cache and rebuilds it
    after            api        reads what the poisoned run rebuilt
    zero3-hit        torchrun   DeepSpeed ZeRO-3, 2 ranks: both read the reference table
    zero3-poisoned   warm       DeepSpeed ZeRO-3, 2 ranks: both recompute the poisoned table (its ranks
                                forked warm, tests/warm_launch.py: what it shows is zerofit's agreement)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from config_helpers import REPO
from launch_helpers import Launch, RunResult, run_in_process, run_one, write_config
from zerofit.data.cache import entry_problem
from zerofit.models.tiny import tiny_model_path

pytestmark = pytest.mark.slow

MISMATCH = "does not match its source ("
BASE: dict[str, Any] = {
    "seed": 7,
    "model": {"name_or_path": "tiny-llama"},
    "batch": {"global_batch_size": 8, "micro_batch_size": 4},
    "distributed": {"strategy": "single", "preset": None},
    "train": {"max_steps": 2, "precision": "fp32"},
    "optimizer": {"lr": 1e-3},
    "lora": {"enabled": False},
    "data": {"max_seq_len": 64, "eval_split": None},
    "checkpoint": {"every_steps": 0},
    "logging": {"console": False, "wandb": {"mode": "disabled"}},
}


def _head(source: str, path: Path, n: int) -> Path:
    """The first `n` records of a bundled data file."""
    path.write_text("".join((REPO / "data" / source).read_text().splitlines(keepends=True)[:n]))
    return path


class Runs:
    """Launches of one config, each in this process, sharing one $ZEROFIT_CACHE of their own."""

    def __init__(self, root: Path, config: dict[str, Any]) -> None:
        self.root, self.cache = root, root / "cache"
        self.config = write_config(root / "config.yaml", config)
        (root / "runs" / "_logs").mkdir(parents=True)

    def tokenizer(self) -> Any:
        """The tiny model's tokenizer, as these runs built it in their cache."""
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.cache / tiny_model_path(seed=BASE["seed"]).name)

    def run(self, name: str, *overrides: str, launcher: str = "torchrun") -> RunResult:
        """Launch `name` in this process, or with `overrides` on 2 ranks through `launcher`."""
        env = {"ZEROFIT_CACHE": str(self.cache)}
        if overrides:
            launch = Launch(name, launcher, overrides)
            return run_one(launch, self.config, self.root / "runs", env=env).check()
        return run_in_process(Launch(name, "api"), self.config, self.root / "runs", env).check()


def _losses(result: RunResult) -> list[float]:
    return result.series("loss")


# ---------------------------------------------------------------- the tokenization cache


def _remap_ids_fresh_digest(entry: Path) -> None:
    """The issue's poisoning: every id through a seeded permutation of the vocabulary, the digest rewritten."""
    from zerofit.data import cache as cache_module

    ids = np.load(entry / "input_ids.npy")
    vocab = int(ids.max()) + 1
    permutation = np.random.default_rng(0).permutation(vocab).astype(np.int32)
    np.save(entry / "input_ids.npy", permutation[ids])
    meta = json.loads((entry / "meta.json").read_text())
    claimed = {k: v for k, v in meta.items() if k != "digest"}
    meta["digest"] = cache_module._content_digest(entry, claimed)
    (entry / "meta.json").write_text(json.dumps(meta))


@pytest.fixture(scope="module")
def sft(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("sft-cache")
    config = {**BASE, "data": {**BASE["data"], "path": str(_head("demo.jsonl", root / "train.jsonl", 48))}}
    runs = Runs(root, config)
    out: dict[str, Any] = {"genuine": runs.run("genuine"), "hit": runs.run("hit")}
    (entry,) = (runs.cache / "tokenized").iterdir()
    _remap_ids_fresh_digest(entry)
    out["problem"] = entry_problem(entry, len(runs.tokenizer()))  # what the digest-era checks say of it
    out["poisoned"] = runs.run("poisoned")
    out["after"] = runs.run("after")
    out["entry"] = entry
    return out


def test_a_remapped_tokenization_cache_with_a_fresh_digest_is_rebuilt(sft: dict[str, Any]) -> None:
    genuine, poisoned = sft["genuine"], sft["poisoned"]
    assert sft["problem"] is None  # the poisoned entry passes the digest and every structural check
    assert _losses(poisoned) == _losses(genuine)  # step 1 included: trained on the source's ids
    lines = [line for line in poisoned.stderr.splitlines() if MISMATCH in line]
    assert lines == [line for line in lines if line.startswith(f"zerofit: {sft['entry']} {MISMATCH}")]
    assert len(lines) == 1 and lines[0].endswith("; rebuilding it"), poisoned.stderr
    assert "from the tokenization cache" not in poisoned.stdout
    after = sft["after"]  # the rebuilt entry serves the next run
    assert "from the tokenization cache" in after.stdout and MISMATCH not in after.stderr
    assert _losses(after) == _losses(genuine)


def test_a_genuine_tokenization_cache_is_read_with_the_same_losses(sft: dict[str, Any]) -> None:
    genuine, hit = sft["genuine"], sft["hit"]
    assert "from the tokenization cache" not in genuine.stdout
    assert "from the tokenization cache" in hit.stdout and MISMATCH not in hit.stderr
    assert _losses(hit) == _losses(genuine)


# ---------------------------------------------------------------- DPO's precomputed reference


def _shift_chosen_fresh_digest(path: Path) -> None:
    """The issue's poisoning: the chosen column shifted by -50, the metadata's sha256 rewritten to match."""
    from safetensors.torch import load_file, save_file

    from zerofit.loop.reference import _table_digest

    table = load_file(str(path))["reference_logps"]
    table[:, 0] -= 50.0
    save_file({"reference_logps": table}, str(path), metadata={"sha256": _table_digest(table)})


@pytest.fixture(scope="module")
def dpo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("reference-cache")
    data = _head("demo_preference.jsonl", root / "pairs.jsonl", 16)
    config = {
        **BASE,
        "train": {**BASE["train"], "objective": "dpo"},
        "preference": {"beta": 0.1, "reference": "precomputed"},
        "data": {**BASE["data"], "path": str(data)},
    }
    runs = Runs(root, config)
    out: dict[str, Any] = {"genuine": runs.run("genuine"), "hit": runs.run("hit")}
    (table,) = (runs.cache / "reference").iterdir()
    _shift_chosen_fresh_digest(table)
    out["poisoned"], out["after"], out["table"] = runs.run("poisoned"), runs.run("after"), table
    out["runs"] = runs
    return out


READ, PASS = "read from the cache, no pass", "computed in one pass before training"


def test_a_shifted_reference_table_with_a_fresh_digest_is_recomputed(dpo: dict[str, Any]) -> None:
    genuine, poisoned = dpo["genuine"], dpo["poisoned"]
    assert _losses(genuine)[0] == pytest.approx(0.6931, abs=1e-4)  # ln 2: the policy is the reference
    assert _losses(poisoned) == _losses(genuine)  # not 0.0067 at step 1
    accuracies = "rewards/accuracies"
    assert poisoned.series(accuracies) == genuine.series(accuracies)  # not 1.0 at step 1
    lines = [line for line in poisoned.stderr.splitlines() if MISMATCH in line]
    assert len(lines) == 1 and lines[0].startswith(f"zerofit: {dpo['table']} {MISMATCH}"), poisoned.stderr
    assert lines[0].endswith("; rebuilding it") and "recomputed by the model" in lines[0]
    assert PASS in poisoned.stdout
    after = dpo["after"]  # the recomputed table replaced the file
    assert READ in after.stdout and MISMATCH not in after.stderr and _losses(after) == _losses(genuine)


def test_a_genuine_reference_table_is_read_and_checked_without_changing_a_loss(dpo: dict[str, Any]) -> None:
    """The sample the check recomputes runs forwards before training: the run trains exactly as the one
    that computed the table (which ran no check)."""
    genuine, hit = dpo["genuine"], dpo["hit"]
    assert PASS in genuine.stdout and READ in hit.stdout and MISMATCH not in hit.stderr
    assert _losses(hit) == _losses(genuine)
    assert hit.series("rewards/accuracies") == genuine.series("rewards/accuracies")


@pytest.mark.distributed
def test_two_zero3_ranks_agree_on_reading_or_recomputing_the_reference(dpo: dict[str, Any]) -> None:
    """Under ZeRO-3 the sample's forwards are collectives (the layers are gathered): both ranks run them on
    rank 0's table, and rank 0's verdict is both ranks' (a split verdict would hang in the pass). A genuine
    table is read; a poisoned one is recomputed by both, with one note; the losses are the one-process
    run's."""
    runs, table, genuine = dpo["runs"], dpo["table"], dpo["genuine"]
    zero3 = ("distributed.strategy=deepspeed", "distributed.preset=zero3", "batch.micro_batch_size=2")
    hit = runs.run("zero3-hit", *zero3)
    _shift_chosen_fresh_digest(table)
    poisoned = runs.run("zero3-poisoned", *zero3, launcher="warm")  # the verdict is zerofit's, not torchrun's
    for result in (hit, poisoned):
        assert _losses(result) == pytest.approx(_losses(genuine), abs=2e-5)
    assert READ in hit.stdout and MISMATCH not in hit.stderr
    assert PASS in poisoned.stdout and poisoned.stderr.count(f"zerofit: {table} {MISMATCH}") == 1
