"""The reward model's score head as transformers names it: where the model builds it (`zerofit.models.heads`)
and where a packed micro-batch's per-token scores are read from (`zerofit.objectives.reward_model.loss`)."""

__all__ = ["SCORE_HEAD"]

SCORE_HEAD = "score"  # transformers' name of a decoder's sequence-classification head
