"""Memory planning: model shapes, per-rank peak memory, GPU catalogue, micro-batch search."""
