"""Training objectives, one slice each (sft, pairwise: dpo / simpo / orpo / cpo, kto, reward_model, grpo), and
the registry that maps `train.objective` to its slice's spec (`registry.py`, `spec.py`): the one place an
objective's name means anything."""
