"""tests/doc_blocks.py's reading of shown outputs and their comparison with a command's real output."""

from __future__ import annotations

from doc_blocks import doc_blocks, missing_shown, shown_commands

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
