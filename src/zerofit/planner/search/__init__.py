"""Will it fit? The verdict for a GPU, the micro-batch table, `micro_batch_size=auto`, and remedies.

Everything here keeps the global batch fixed: a micro-batch size is a candidate only if it divides the
samples each rank processes per optimizer step (global / dp), so gradient accumulation stays whole and the
training is the same whichever candidate is chosen (docs/design.md: "one global batch").

The fastest plan: every (micro-batch, checkpointed layers) pair that fits is scored by the cost model of
`speed.py` (recomputation FLOPs per checkpointed layer against the per-micro-step overhead a bigger
micro-batch amortizes); for each micro-batch the fewest checkpointed layers that fit is the fastest, and
the best micro-batch wins. `auto` keys (`batch.micro_batch_size`, `batch.tokens_per_micro_batch`,
`train.activation_checkpointing`) take that plan. `train.tiled_mlp` / `train.activation_offload` /
`train.lean_norm` = `auto` add their settings as variants (`lever_variants`): a lever costs time (speed.py), so it is chosen only
where it makes a plan fit or lets a faster one fit (a tie keeps it off).

Verdicts, for the card's usable memory M (torch's `total_memory`):
  - fits:          total (tensors + allowance) <= (1 - headroom) x M    (headroom: planner.headroom, 5%)
  - tight:         fits in M but inside the headroom: may OOM on an unlucky allocation pattern
  - does not fit:  total > M

By concern: `budget` (the budget and the verdict), `table` (the micro-batch table), `options` (the
plans and their speed), `remedies`, `report` (`plan_memory`, what `zerofit plan` shows) and `auto` (the
`auto` choice, `choose_plan`).
"""
