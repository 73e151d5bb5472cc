"""A run's lifecycle: assemble (engine, run directory, data, model, optimizer), the launch entry point,
what a run prints about itself, and `zerofit plan --probe`'s real steps."""
