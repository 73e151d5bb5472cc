"""The training loop: one exact global batch per optimizer step, evaluation, DPO's precomputed reference,
and stop signals."""
