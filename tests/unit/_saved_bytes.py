"""Bytes one real Llama-2-7B-width decoder layer saves for backward, counted by autograd itself.

An independent reference for the planner's no-checkpointing activation model (`zerofit.planner.activations`):
one `LlamaDecoderLayer` (hidden 4096, MLP 11008, 32 heads, sdpa) with a bf16 base and peft LoRA r16 on its
seven linears (adapters in fp32, peft's default), one sequence of SEQ tokens through it on the CPU, and
every tensor autograd keeps for backward recorded by `torch.autograd.graph.saved_tensors_hooks`, storages
deduplicated, parameters excluded. Nothing of zerofit is used to build or count.

Built on the meta device and materialized in bf16 (one layer: 0.4 GB); a run takes seconds.

    python tests/unit/_saved_bytes.py SEQ LORA_DROPOUT     # e.g. 128 0.05: prints bytes/(token x hidden)

(docs/platform.md: 67.1 bytes per token per hidden unit without LoRA dropout, 101.9 with dropout 0.05,
whose mask on the CPU is one fp32 per element where CUDA keeps one byte.)
"""

from __future__ import annotations

import sys

import torch

HIDDEN, INTERMEDIATE, HEADS = 4096, 11008, 32
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def saved_bytes_per_layer(seq: int, lora_dropout: float) -> int:
    """Bytes saved for backward by one 7B-width layer over `seq` tokens (parameters excluded)."""
    from peft import LoraConfig, inject_adapter_in_model
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    config = LlamaConfig(
        hidden_size=HIDDEN,
        intermediate_size=INTERMEDIATE,
        num_hidden_layers=1,
        num_attention_heads=HEADS,
        num_key_value_heads=HEADS,
        vocab_size=32000,
    )
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("meta"):
        layer = LlamaDecoderLayer(config, 0)
    layer = layer.to_empty(device="cpu").to(torch.bfloat16)
    for param in layer.parameters():
        torch.nn.init.normal_(param, std=0.02)
        param.requires_grad_(False)
    lora = LoraConfig(r=16, lora_alpha=32, lora_dropout=lora_dropout, target_modules=TARGETS)
    layer = inject_adapter_in_model(lora, layer)
    for name, param in layer.named_parameters():
        if "lora_" in name:  # peft keeps adapters in fp32 under a half-precision base
            param.data = param.data.float()
            param.requires_grad_(True)
    layer.train()

    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return t

    hidden = torch.randn(1, seq, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(seq)[None]
    rope = LlamaRotaryEmbedding(config)(hidden, positions)
    params = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        layer(hidden, position_embeddings=rope, attention_mask=None, position_ids=positions)
    return sum(n for ptr, n in saved.items() if ptr not in params)


if __name__ == "__main__":
    seq, dropout = int(sys.argv[1]), float(sys.argv[2])
    total = saved_bytes_per_layer(seq, dropout)
    print(
        f"seq {seq} dropout {dropout}: {total / 2**20:.1f} MiB = {total / (seq * HIDDEN):.1f} bytes/(token x h)"
    )
