"""The memory and speed levers applied to a loaded model: selective recomputation, activation offload,
tiled MLP, lean norm, variable-length attention, fused kernels, compile, and Ulysses sequence parallelism's
data side."""
