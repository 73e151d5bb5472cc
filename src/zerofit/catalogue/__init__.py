"""What zerofit knows before it sees a model: config.json of known families at real sizes, GPUs, and the
DeepSpeed / FSDP2 presets shipped in `ds_configs/`."""
