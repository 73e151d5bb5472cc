"""The model to train: the build pipeline, the meta model, the built-in tiny models, LoRA and what its
targets mean per family, and hub access errors."""
