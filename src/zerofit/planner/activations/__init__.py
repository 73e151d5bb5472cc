"""Activations at the forward/backward peak: saved tensors per layer and token, logits, loss temporaries.

Activation bytes per token of one decoder layer are a sum of typed terms (`Term`: a `TermKind` saying what
it models, its bytes and its display label; see
`layer.layer_split`). Code selects terms by kind, never by label. The rules
come from which tensors autograd saves for backward:
  - RMSNorm saves its fp32 upcast input and the per-token rstd (and its normalized output when its weight
    trains); the lean RMSNorm (train.lean_norm, zerofit.levers.norms) its input as it is and the rstd;
  - a linear saves its input only when its weight trains; a frozen base linear saves nothing, its LoRA
    adapter saves its own input: the same storage as the base's input when the dtypes agree, else its own
    cast copy (fp32 adapters under a bf16 base, or a bf16 copy under autocast), plus the rank-r output of A;
  - attention (sdpa) saves q, k, v, the output and a per-head logsumexp; eager attention also keeps the
    S x S probabilities (fp32 softmax output and its half copy);
  - SwiGLU saves gate and up outputs and the activation's output;
  - dropout keeps a one-byte mask per element (CUDA).

Per family (the shapes come from the model class, `ModelShape`): every RMSNorm of a layer counts
(Gemma's 4, Qwen3's and Gemma 3's q/k norms over each head); a fused `qkv_proj` (Phi-3/4) keeps its whole
output alive through v; sliding-window layers attend through a saved mask when the window is shorter than
the sequence; Gemma 2's soft-capping keeps the tanh output of the attention scores (eager: transformers has
no soft-capped sdpa) and of the final logits; a mixture of experts routes k rows per token through an expert
MLP (`layer.moe_saves`) and, when peft adapts the fused 3-D expert weights, each layer saves their merged copy
W + BA (a per-layer constant, not per token).

Selective checkpointing (the first n of L layers recomputed) keeps n layer inputs and L - n layers of saved
tensors; the loss's temporaries depend on `train.cross_entropy` (`zerofit.token_loss.sums`): unchunked holds fp32
log-probabilities and two fp32 (tokens x vocab) gradients, chunked a gradient in the logits' dtype and one
fp32 chunk.

Preference tuning (`Scenario.rows`): a micro-batch of m pairs is one forward of 2m sequences, so every
per-token term counts 2m x seq_len tokens; DPO's reference with the adapters off is one more moment, a
no-grad forward of the same rows before the policy's (`moments.reference_moments`).

One module per term family: `terms` (what a term is), `dtypes` (element sizes), `norms`, `attention`,
`linears` and `layer` (one decoder layer's saves), `transients` (working sets, the tiled MLP), `step` (what
the moments share), `loss`, `moments`, and `peak` (`activation_terms`, the entry).
"""
