"""A reward model end to end, in this process: `configs/demo-reward.yaml` (the built-in tiny Llama with a
one-output score head, LoRA + the head in full, 24 steps on data/demo_reward.jsonl) trained once and shared:

- the held-out ranking (data/demo_reward_heldout.jsonl, 100 pairs never trained on): the untrained model
  (its seeded head) ranks chosen above rejected for about half of them, the trained one for at least 95%
  (measured 2026-12-02: 0.38 -> 1.00; mean margin -0.02 -> 4.28), and zerofit's end-of-run evaluation agrees;
- `zerofit export --merge` writes a folder transformers' AutoModelForSequenceClassification loads, with the
  tokenizer, giving the trained model's scores;
- `zerofit score` prints that score; `zerofit generate` refuses a reward model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import zerofit
from zerofit.cli import main
from zerofit.core.errors import ConfigError
from zerofit.export import export_run
from zerofit.objectives.reward_model.loss import pair_rewards
from zerofit.trained.generate import load_generator
from zerofit.trained.score import Scorer, load_scorer

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[3]
HELD_OUT = REPO / "data" / "demo_reward_heldout.jsonl"


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("reward")
    zerofit.train(
        str(REPO / "configs" / "demo-reward.yaml"),
        output_dir=str(out),
        **{
            "data.path": str(REPO / "data" / "demo_reward.jsonl"),
            "data.eval_path": str(HELD_OUT),
            "logging.console": False,
            "logging.wandb.mode": "disabled",
            "checkpoint.every_minutes": 0,
        },
    )
    return out / "demo-reward"


def _held_out() -> list[dict[str, str]]:
    return [json.loads(line) for line in HELD_OUT.read_text().splitlines()]


def _accuracy(scorer: Scorer) -> float:
    """Held-out pairs whose chosen response out-scores the rejected one: one padded forward of them all."""
    pairs = _held_out()
    rows = [scorer.input_ids(p["prompt"], p[side]) for side in ("chosen", "rejected") for p in pairs]
    pad, width = scorer.tokenizer.pad_token_id, max(map(len, rows))
    ids = torch.tensor([row + [pad] * (width - len(row)) for row in rows])
    mask = torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in rows])
    with torch.no_grad():
        scores = pair_rewards(scorer.model, {"input_ids": ids, "attention_mask": mask})
    return float((scores[: len(pairs)] > scores[len(pairs) :]).double().mean())


def test_the_trained_model_ranks_held_out_pairs(run_dir: Path) -> None:
    from zerofit.api import read_result
    from zerofit.models.build import build_model
    from zerofit.trained.model import read_run_config

    cfg = read_run_config(run_dir).config
    untrained = build_model(cfg)
    before = _accuracy(Scorer(untrained.model.eval(), untrained.tokenizer, cfg.data.max_seq_len))
    after = _accuracy(load_scorer(run_dir))
    assert 0.3 <= before <= 0.7, before  # chance, for the seeded head
    assert after >= 0.95, (before, after)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows[-1]["eval/rewards/accuracies"] == pytest.approx(after, abs=0.02)
    assert {"rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins"} <= set(rows[-1])
    assert read_result(run_dir).steps == 24


def test_merged_export_is_a_sequence_classifier_with_the_same_scores(run_dir: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    result = export_run(run_dir, tmp_path / "rm", merge=True)
    assert result.kind == "merged" and result.reward
    config = json.loads((result.out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1
    model = AutoModelForSequenceClassification.from_pretrained(result.out).eval()
    tokenizer = AutoTokenizer.from_pretrained(result.out)
    assert model.config.pad_token_id == tokenizer.pad_token_id
    trained = load_scorer(run_dir)
    exported = Scorer(model, tokenizer, 64)
    for pair in _held_out()[:5]:
        for response in (pair["chosen"], pair["rejected"]):
            assert exported(pair["prompt"], response) == pytest.approx(
                trained(pair["prompt"], response), abs=1e-5
            )
    # A batch padded on the right scores each row at its last real token, as transformers pools it.
    ids = [trained.input_ids(p["prompt"], p["chosen"]) for p in _held_out()[:3]]
    width = max(map(len, ids))
    batch = torch.tensor([row + [tokenizer.pad_token_id] * (width - len(row)) for row in ids])
    with torch.no_grad():
        scores = model(input_ids=batch, attention_mask=(batch != tokenizer.pad_token_id).long()).logits[:, 0]
    alone = [exported(p["prompt"], p["chosen"]) for p in _held_out()[:3]]
    assert scores.tolist() == pytest.approx(alone, abs=1e-5)


def test_score_prints_the_reward(run_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pair = _held_out()[0]
    expected = load_scorer(run_dir)(pair["prompt"], pair["chosen"])
    assert main(["score", str(run_dir), "--prompt", pair["prompt"], "--response", pair["chosen"]]) == 0
    assert float(capsys.readouterr().out.strip()) == pytest.approx(expected, abs=1e-6)


def test_generate_refuses_a_reward_model(run_dir: Path) -> None:
    with pytest.raises(ConfigError, match="reward model"):
        load_generator(run_dir)


def test_a_checkpoints_adapter_export_loads_with_peft(run_dir: Path, tmp_path: Path) -> None:
    """The LoRA adapter written from a checkpoint's tensors is peft's SEQ_CLS folder, score head included."""
    from peft import AutoPeftModelForSequenceClassification
    from transformers import AutoTokenizer

    result = export_run(run_dir, tmp_path / "adapter", step=24)
    assert result.kind == "adapter" and result.source.kind == "checkpoint"
    model = AutoPeftModelForSequenceClassification.from_pretrained(result.out, num_labels=1).eval()
    tokenizer = AutoTokenizer.from_pretrained(result.out)
    model.get_base_model().config.pad_token_id = tokenizer.pad_token_id
    pair = _held_out()[1]
    expected = load_scorer(run_dir)(pair["prompt"], pair["chosen"])
    assert Scorer(model, tokenizer, 64)(pair["prompt"], pair["chosen"]) == pytest.approx(expected, abs=1e-5)
