"""lm-eval (EleutherAI's evaluation harness) on a model zerofit holds in memory: the offline tasks zerofit ships
(`tasks/`, their verdicts in `checks.py`, resolved by `shipped.py`), one evaluation through lm-eval's Python
API (`evaluate.py`), and where its scores go (`results.py`: `eval/harness-step-N.json`, a `metrics.jsonl`
row, the W&B run's summary). `zerofit eval` and `eval.harness` during training both run through here."""
