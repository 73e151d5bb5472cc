"""What a micro-batch contributes to the loss, as token sums: SFT's (chunked, or fused inside lm_head)
and the preference objectives (DPO, SimPO, ORPO)."""
