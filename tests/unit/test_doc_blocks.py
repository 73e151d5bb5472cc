"""tests/doc_blocks.py's reading of shown outputs and their comparison with a command's real output."""

from __future__ import annotations

from dataclasses import replace

import pytest

from doc_blocks import doc_blocks, exact_half_precision_figures, missing_shown, shown_commands

DOC = """# Title

```bash
zerofit plan --config c.yaml
```

```text
Verdict: FITS on rtx3090: 18.12 of 23.69 GiB
...
step 10/10  loss 4.5326  lr 2.73e-03  86 tok/s  peak 0.48 GiB  eta 0s
```

Prose.

```
$ zerofit compare runs/a   # needs: two runs
│ final loss            │        3.0889 │
```
"""


def test_a_text_block_right_below_a_bash_block_is_its_shown_output() -> None:
    (block,) = doc_blocks(DOC, "docs/guides/x.md")
    assert block.shown is not None and block.shown.command is None
    assert block.shown.lines[0].startswith("Verdict") and block.shown.lines[1] == "..."
    (named,) = shown_commands(DOC, "docs/guides/x.md")
    assert named.command == "zerofit compare runs/a   # needs: two runs" and len(named.lines) == 1


def test_shown_lines_must_appear_in_order_with_numbers_compared() -> None:
    (block,) = doc_blocks(DOC, "docs/guides/x.md")
    assert block.shown is not None
    output = (
        "zerofit plan\nVerdict: FITS on rtx3090: 18.12 of 23.69 GiB\nstep 1/10 ...\n"
        "step 10/10  loss 4.5326  lr 2.73e-03  105 tok/s  peak 0.51 GiB  eta 1s\n"
    )
    assert missing_shown(block.shown.lines, output) is None  # speed, memory and eta may differ
    stale = output.replace("18.12", "18.13")
    assert missing_shown(block.shown.lines, stale) == "Verdict: FITS on rtx3090: 18.12 of 23.69 GiB"
    other_loss = output.replace("4.5326", "4.6000")
    assert missing_shown(block.shown.lines, other_loss) is not None  # a loss is no timing: compared
    swapped = "step 10/10  loss 4.5326  lr 2.73e-03  1 tok/s  peak 1 GiB  eta 0s\nVerdict: FITS on rtx3090: 18.12 of 23.69 GiB\n"
    assert missing_shown(block.shown.lines, swapped) is not None  # order counts


def test_table_padding_and_rules_do_not_count() -> None:
    shown = ("┌────┬────┐", "│ final loss │ 3.0889 │")
    assert missing_shown(shown, "┌──────────┬──┐\n│ final loss      │    3.0889 │\n") is None


def test_a_warm_tokenization_cache_is_no_difference() -> None:
    shown = ("  data         data/demo.jsonl [prompt_response, detected]: 3,000 examples",)
    warm = "  data         data/demo.jsonl [prompt_response, detected; from the tokenization cache]: 3,000 examples\n"
    assert missing_shown(shown, warm) is None
    assert missing_shown(shown, warm.replace("3,000", "2,000")) is not None


BF16_DOC = """```bash
python launchers/launch_finetune.py --config configs/demo.yaml
```

```text ±0.01
  engine       single / single, precision bf16, clip 1.0
step 1/10  loss 4.8519  lr 2.73e-04  107 tok/s  peak 0.39 GiB  eta ?
│ loss, mean of the last 5 step(s)      │    4.6342 │
done: 10 steps, loss 4.8405 -> 4.6342 (mean of the first / last 5 steps)
```
"""
BF16_OUTPUT = (
    "  engine       single / single, precision bf16, clip 1.0\n"
    "step 1/10  loss 4.8520  lr 2.73e-04  58 tok/s  peak 0.46 GiB  eta ?\n"
    "│ loss, mean of the last 5 step(s)      │    4.6341 │\n"
    "done: 10 steps, loss 4.8405 -> 4.6341 (mean of the first / last 5 steps)\n"
)


def test_a_fence_states_a_tolerance_for_its_decimal_figures() -> None:
    """The same run on another CPU (AVX512-BF16 here, AVX2 in the doc) differs in a bf16 loss's 4th decimal:
    within the fence's ±0.01 it matches; the same doc without the tolerance does not; beyond it, it fails."""
    (block,) = doc_blocks(BF16_DOC, "docs/guides/x.md")
    assert block.shown is not None and block.shown.tolerance == 0.01
    assert missing_shown(block.shown.lines, BF16_OUTPUT, block.shown.tolerance) is None
    assert missing_shown(block.shown.lines, BF16_OUTPUT) is not None  # exact: 4.8519 is not 4.8520
    drifted = BF16_OUTPUT.replace("4.8520", "4.8700")
    assert (
        missing_shown(block.shown.lines, drifted, 0.01)
        == "step 1/10 loss 4.8519 lr 2.73e-04 # tok/s peak # GiB eta #"
    )


def test_a_tolerance_loosens_decimal_figures_only() -> None:
    """Counts, step numbers, figures in e-notation (an lr) and the words between figures stay exact."""
    shown = ("step 1/10  loss 4.8519  lr 2.73e-04",)
    assert missing_shown(shown, "step 1/10  loss 4.8529  lr 2.73e-04\n", 0.01) is None
    assert missing_shown(shown, "step 2/10  loss 4.8519  lr 2.73e-04\n", 0.01) is not None
    assert missing_shown(shown, "step 1/10  loss 4.8519  lr 2.74e-04\n", 0.01) is not None
    assert missing_shown(shown, "step 1/10  mean 4.8519  lr 2.73e-04\n", 0.01) is not None
    assert missing_shown(("reward -0.0001",), "reward 0.0001\n", 0.01) is None  # a sign near zero
    assert missing_shown(("done: 10 steps, loss 4.84",), "done: 10 steps, loss 4.8405 -> 4.6\n", 0.01) is None


def test_a_misspelt_tolerance_is_refused() -> None:
    with pytest.raises(ValueError, match=r"such as ±0\.01"):
        doc_blocks(BF16_DOC.replace("±0.01", "+-0.01"), "docs/guides/x.md")


def test_a_half_precision_run_compared_exactly_is_found() -> None:
    """A shown bf16 training output without a tolerance is named; with one, or a plan alone (it predicts,
    it does not measure), or an fp32 run, nothing is."""
    (block,) = doc_blocks(BF16_DOC, "docs/guides/x.md")
    assert block.shown is not None
    exact = replace(block.shown, tolerance=None)
    assert exact_half_precision_figures(exact, BF16_OUTPUT)[0].startswith("step 1/10")
    # the plan's lines predict: a bf16 run's shown plan alone is compared as shown
    plan_lines = replace(exact, lines=tuple(line for line in exact.lines if line.startswith(" ")))
    assert plan_lines.lines and exact_half_precision_figures(plan_lines, BF16_OUTPUT) == []
    assert exact_half_precision_figures(block.shown, BF16_OUTPUT) == []
    plan_only = "\n".join(line for line in BF16_OUTPUT.splitlines() if line.startswith(" "))
    assert exact_half_precision_figures(exact, plan_only) == []
    assert exact_half_precision_figures(exact, BF16_OUTPUT.replace("bf16", "fp32")) == []
