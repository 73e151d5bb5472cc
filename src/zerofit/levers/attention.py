"""Variable-length attention (`model.attn_implementation=varlen`): packed rows and padded micro-batches without
a dense (B, 1, S, S) mask.

transformers' sdpa path turns packed rows (restarting position ids) and padded micro-batches of several
sequences into a dense 4-D mask: 4 GiB of bool per micro-batch row at 64k tokens, kept by every checkpointed
layer. This module plugs a variable-length path into transformers' own interfaces (no model code patched):

- a mask function (`AttentionMaskInterface`, called once per forward by `create_causal_mask`) that finds the
  documents, a `Documents` of flat offsets (cu_seqlens), instead of building a mask. It reads them off the
  mask function transformers hands it (packed rows: token i starts a document where it cannot see token i - 1)
  and the 2-D padding mask (a run of padding is a segment of its own), in O(B x S);
- an attention function (`AttentionInterface`) that runs one kernel over those documents, chosen once at load
  (`choose_kernel`): FlashAttention-2's `flash_attn_varlen_func` where installed, else PyTorch's own
  `torch.nn.attention.varlen.varlen_attn` (both CUDA, half precision, sm80+), else exact per-document
  `scaled_dot_product_attention(is_causal=True)` over each document's slice (CPU, and CUDA in fp32): memory
  O(document), never S x S.

Exact: each real token attends to the tokens of its own document before it, exactly the keys the dense
block-diagonal (or padding) mask lets through; padded queries (no label) attend within their padding run, so
their outputs stay finite. What does not fit that pattern falls back to transformers' own sdpa path, which is
today's behaviour: a KV cache (generation), a sliding window, an unpadded micro-batch of single documents
(plain `is_causal`, no mask at all). A sliding-window layer (Mistral) gets its documents with the window:
the varlen kernels take it as their (window - 1, 0) window, the per-document sdpa builds a document-local
mask only for a document longer than the window. A 2-D mask with a gap inside a row is refused (it is not
zerofit's collate output and the segments could not express it).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass, replace
from itertools import pairwise
from typing import Any

import torch

from zerofit.core.errors import ConfigError

__all__ = [
    "HF_VARLEN",
    "KERNELS",
    "Documents",
    "choose_kernel",
    "describe_attention",
    "find_documents",
    "hf_attn_implementation",
    "install_kernel",
    "installed_kernels",
    "module_kernel",
    "uniform_documents",
    "varlen_attention",
    "varlen_mask",
]

# The name the variable-length path is registered under with transformers (config value: `varlen`).
HF_VARLEN = "zerofit_varlen"
FLASH_ATTN = "flash_attn"  # FlashAttention-2's flash_attn_varlen_func
TORCH_VARLEN = "torch_varlen"  # torch.nn.attention.varlen.varlen_attn
PER_DOCUMENT = "sdpa_per_document"  # F.scaled_dot_product_attention(is_causal=True) per document
KERNELS = (FLASH_ATTN, TORCH_VARLEN, PER_DOCUMENT)
_HALF = (torch.float16, torch.bfloat16)
_KERNEL_ATTR = "zerofit_varlen_kernel"  # set on each attention module by `install_kernel`


@dataclass(frozen=True)
class Documents:
    """The documents of one micro-batch: flat offsets into its B x S tokens (row-major), one forward's worth.

    `cu_seqlens` (int32, on the tokens' device) is what the varlen kernels take; `bounds` is its host copy
    (the per-document kernel slices by it); `max_len` the longest document. No row boundary is crossed: every
    row starts a document.
    """

    cu_seqlens: torch.Tensor
    bounds: tuple[int, ...]
    max_len: int
    batch_size: int
    seq_len: int
    # A sliding-window layer's window (each token sees itself and the window - 1 tokens before it, within
    # its document), as transformers' sliding mask: None for full attention.
    window: int | None = None


def installed_kernels() -> dict[str, bool]:
    """Which variable-length kernels this install has (importable, not yet whether the device can run them)."""
    return {
        FLASH_ATTN: importlib.util.find_spec("flash_attn") is not None,
        TORCH_VARLEN: importlib.util.find_spec("torch.nn.attention.varlen") is not None,
        PER_DOCUMENT: True,
    }


def choose_kernel(
    asked: str,
    device_type: str,
    dtype: torch.dtype,
    capability: tuple[int, int] | None,
    installed: dict[str, bool],
) -> str:
    """The kernel a varlen run uses: `asked` (`auto` or one of `KERNELS`) on this device and compute dtype.

    `auto`, best first: FlashAttention-2, then PyTorch's varlen, where installed and runnable (CUDA, fp16/bf16,
    compute capability 8.0 or newer: both are FlashAttention-2 kernels), else the per-document sdpa. An explicit
    kernel that cannot run here is refused as one paragraph (field, value, rule, fix).
    """
    runnable = device_type == "cuda" and dtype in _HALF and capability is not None and capability >= (8, 0)
    usable = {k: installed.get(k, False) and (runnable or k == PER_DOCUMENT) for k in KERNELS}
    if asked == "auto":
        return next(k for k in KERNELS if usable[k])
    if asked not in KERNELS:
        raise ConfigError([f"model.varlen_kernel = {asked!r}: must be auto or one of {', '.join(KERNELS)}"])
    if usable[asked]:
        return asked
    why = (
        "is not installed"
        if not installed.get(asked, False)
        else "needs CUDA, fp16/bf16 and compute capability 8.0+"
    )
    where = f"{device_type}, {str(dtype).removeprefix('torch.')}, capability {capability}"
    fix = "pip install flash-attn (CUDA)" if asked == FLASH_ATTN else "a torch with torch.nn.attention.varlen"
    raise ConfigError(
        [
            f"model.varlen_kernel = {asked!r}: the kernel {why} (this run: {where}); set model.varlen_kernel=auto "
            f"(the best kernel that runs here, {PER_DOCUMENT} at worst: exact, O(document) memory), or install "
            f"it ({fix}) and train in bf16/fp16 on an Ampere or newer GPU"
        ]
    )


def hf_attn_implementation(value: str) -> str:
    """The `attn_implementation` to hand transformers for a resolved `model.attn_implementation` (registering
    the varlen path with transformers first when it is asked for)."""
    if value == "varlen":
        register()
        return HF_VARLEN
    if value == "auto":
        raise ValueError(
            "model.attn_implementation = 'auto' must be resolved (resolve()) before a model loads"
        )
    return value


def register() -> None:
    """Register the varlen attention and mask functions with transformers (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(HF_VARLEN, varlen_attention)
    AttentionMaskInterface.register(HF_VARLEN, varlen_mask)


def install_kernel(model: torch.nn.Module, kernel: str) -> int:
    """Record `kernel` on every attention module of `model` (a plain attribute, not state): the attention
    function reads it per call. Returns how many modules got it."""
    n = 0
    for module in model.modules():
        if hasattr(module, "num_key_value_groups") or type(module).__name__.endswith("Attention"):
            setattr(module, _KERNEL_ATTR, kernel)
            n += 1
    return n


def describe_attention(implementation: str, kernel: str | None, masked: bool) -> str:
    """What attention runs, for plans and the run's plan: the path, its kernel, and whether a dense mask
    exists (`masked`: packed rows or padded micro-batches of several sequences)."""
    if implementation == "varlen" and masked:
        return f"varlen, {kernel} kernel (documents as cu_seqlens, no dense mask)"
    if implementation == "varlen":
        return f"varlen (one sequence per micro-batch: sdpa's causal path, no mask; {kernel} kernel for documents)"
    if not masked:
        return f"{implementation} (one sequence per micro-batch: causal, no mask)"
    return f"{implementation} (a dense (B, 1, S, S) mask for packed rows / padding)"


def module_kernel(model: torch.nn.Module) -> str | None:
    """The kernel `install_kernel` put on `model`'s attention modules (None: not the varlen path)."""
    return next((getattr(m, _KERNEL_ATTR) for m in model.modules() if hasattr(m, _KERNEL_ATTR)), None)


# ------------------------------------------------------------------------------------- the documents


def _segment_starts(
    batch_size: int, seq_len: int, mask_function: Callable, attention_mask: torch.Tensor | None, device: Any
) -> torch.Tensor:
    """(B, S) bool: True where a token starts a segment. Token i > 0 starts one when the mask transformers
    built the forward's pattern with does not let it see token i - 1 (a packed row's document boundary),
    or when the padding mask changes value there (a run of padding is its own segment)."""
    starts = torch.zeros(batch_size, seq_len, dtype=torch.bool, device=device)
    starts[:, 0] = True
    if seq_len == 1:
        return starts
    b = torch.arange(batch_size, device=device)[:, None]
    q = torch.arange(1, seq_len, device=device)[None, :]
    sees_previous = torch.as_tensor(mask_function(b, 0, q, q - 1), device=device).expand(
        batch_size, seq_len - 1
    )
    starts[:, 1:] = ~sees_previous
    if attention_mask is not None:
        valid = attention_mask[:, -seq_len:].to(device=device, dtype=torch.bool)
        starts[:, 1:] |= valid[:, 1:] != valid[:, :-1]
        # One run of real tokens per row (left and/or right padding): a gap would need keys across segments.
        rises = (valid[:, 1:] & ~valid[:, :-1]).sum(-1) + valid[:, 0].long()
        if bool((rises > 1).any()):
            raise ValueError(
                "varlen attention takes right- or left-padded rows (one run of real tokens per row); this "
                "attention_mask has a gap inside a row. Use model.attn_implementation=sdpa for such masks."
            )
    return starts


def find_documents(starts: torch.Tensor) -> Documents:
    """The `Documents` of a (B, S) segment-start map: flat cu_seqlens (one host sync per forward)."""
    batch_size, seq_len = starts.shape
    offsets = torch.nonzero(starts.reshape(-1)).reshape(-1)
    total = torch.tensor([batch_size * seq_len], device=starts.device)
    cu = torch.cat([offsets, total]).to(torch.int32)
    bounds = tuple(int(x) for x in cu.tolist())
    max_len = max(b - a for a, b in pairwise(bounds))
    return Documents(cu_seqlens=cu, bounds=bounds, max_len=max_len, batch_size=batch_size, seq_len=seq_len)


def varlen_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: Any = 0,
    kv_offset: int = 0,
    mask_function: Callable | None = None,
    attention_mask: torch.Tensor | None = None,
    local_size: int | None = None,
    device: Any = "cpu",
    **kwargs: Any,
) -> Documents | torch.Tensor | None:
    """transformers' mask hook for the varlen path: the forward's `Documents` (with the window of a
    sliding-window layer, `local_size`), or None where a plain causal sdpa needs no mask (one document per
    row, no padding, no window shorter than the row), or sdpa's own mask under a KV cache (q shorter than
    kv, or offset: generation), so that runs exactly as today."""
    from transformers.masking_utils import causal_mask_function, sdpa_mask

    plain = q_length == kv_length and kv_offset == 0
    plain = plain and not (isinstance(q_offset, torch.Tensor) or q_offset != 0)
    if not plain:
        return sdpa_mask(
            batch_size=batch_size,
            q_length=q_length,
            kv_length=kv_length,
            q_offset=q_offset,
            kv_offset=kv_offset,
            mask_function=mask_function or causal_mask_function,
            attention_mask=attention_mask,
            local_size=local_size,
            device=device,
            **kwargs,
        )
    docs = _documents(batch_size, q_length, mask_function or causal_mask_function, attention_mask, device)
    if local_size is None or (docs is None and q_length <= local_size):
        return docs
    return replace(docs or uniform_documents(batch_size, q_length, device), window=local_size)


def _documents(
    batch_size: int, seq_len: int, mask_function: Callable, attention_mask: torch.Tensor | None, device: Any
) -> Documents | None:
    """The forward's documents, or None for one document per row without padding (sdpa's is_causal path, no
    mask at all). The planner's trace replaces it: fake tensors have no values to find documents in."""
    starts = _segment_starts(batch_size, seq_len, mask_function, attention_mask, device)
    if not bool(starts[:, 1:].any()):
        return None
    return find_documents(starts)


def uniform_documents(batch_size: int, seq_len: int, device: Any = "cpu") -> Documents:
    """One document per row (what the planner's trace runs: the kernels' saved bytes depend on the tokens,
    not on where the documents end)."""
    bounds = tuple(range(0, batch_size * seq_len + 1, seq_len))
    cu = torch.tensor(bounds, dtype=torch.int32, device=device)
    return Documents(cu_seqlens=cu, bounds=bounds, max_len=seq_len, batch_size=batch_size, seq_len=seq_len)


# --------------------------------------------------------------------------------------------- kernels


def _flat(x: torch.Tensor) -> torch.Tensor:
    """(B, H, S, D) -> (B x S, H, D), the layout the varlen kernels take (a copy: heads leave the front)."""
    b, h, s, d = x.shape
    return x.transpose(1, 2).reshape(b * s, h, d)


def _flash_attn(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, scale: float
) -> torch.Tensor:
    """FlashAttention-2's varlen kernel over flat (T, H, D) tensors (GQA native; a sliding window as its
    (window - 1, 0) window)."""
    from flash_attn import flash_attn_varlen_func

    cu, n = docs.cu_seqlens, docs.max_len
    window = (-1, -1) if docs.window is None else (docs.window - 1, 0)
    return flash_attn_varlen_func(
        q, k, v, cu, cu, n, n, dropout_p=0.0, softmax_scale=scale, causal=True, window_size=window
    )


def _torch_varlen(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents, scale: float
) -> torch.Tensor:
    """PyTorch's varlen kernel over flat (T, H, D) tensors; causal is its (-1, 0) window, a sliding one
    (window - 1, 0)."""
    from torch.nn.attention.varlen import varlen_attn

    cu, n = docs.cu_seqlens, docs.max_len
    gqa = q.shape[1] != k.shape[1]
    window = (-1, 0) if docs.window is None else (docs.window - 1, 0)
    return varlen_attn(q, k, v, cu, cu, n, n, scale=scale, window_size=window, enable_gqa=gqa)


_FLAT_KERNELS: dict[str, Callable[..., torch.Tensor]] = {FLASH_ATTN: _flash_attn, TORCH_VARLEN: _torch_varlen}


def _per_document(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    docs: Documents,
    dropout: float,
    scaling: float | None,
) -> torch.Tensor:
    """Exact causal sdpa over each document's slice of its row, through transformers' own sdpa function
    (GQA, scaling, dropout as it does them); (B, S, H, D) out, like transformers' attention functions."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    s = docs.seq_len
    outs = []
    for start, end in pairwise(docs.bounds):
        row, a = divmod(start, s)
        b = a + (end - start)
        piece = (slice(row, row + 1), slice(None), slice(a, b))
        mask = _window_mask(end - start, docs.window, query.device)
        out, _ = sdpa_attention_forward(
            module,
            query[piece],
            key[piece],
            value[piece],
            mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=mask is None,
        )
        outs.append(out)
    return torch.cat(outs, dim=1).reshape(docs.batch_size, s, *outs[0].shape[2:])


def _window_mask(length: int, window: int | None, device: Any) -> torch.Tensor | None:
    """A document's (1, 1, L, L) sliding-window causal mask, only where the window is shorter than it
    (otherwise it is plain causal: every earlier token of the document is within the window)."""
    if window is None or length <= window:
        return None
    q = torch.arange(length, device=device)[:, None]
    k = torch.arange(length, device=device)[None, :]
    return ((k <= q) & (k > q - window))[None, None]


def _autocast(*qkv: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v in autocast's dtype when it is on for their device, as sdpa (on autocast's lower-precision
    list) gets them: fp32 rotary tables promote q and k to fp32 under autocast (fp32 weights), which the
    varlen kernels refuse. (The per-document path calls sdpa, which autocast casts itself.)"""
    device = qkv[0].device.type
    if not torch.is_autocast_enabled(device):
        return qkv
    half = torch.get_autocast_dtype(device)
    return tuple(t.to(half) for t in qkv)


def _runnable(kernel: str, query: torch.Tensor) -> str:
    """`kernel` when these tensors can take it, else the per-document sdpa (e.g. fp32 evaluation, CPU)."""
    if kernel in _FLAT_KERNELS and query.is_cuda and query.dtype in _HALF:
        return kernel
    return PER_DOCUMENT


def varlen_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Documents | torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention hook for the varlen path: (B, H, S, D) q/k/v in, (B, S, H, D) out.

    Given `Documents` (from `varlen_mask`) it runs the module's kernel (`install_kernel`; the per-document sdpa
    where none was installed or the tensors cannot take it); given None or a tensor mask it is transformers'
    own sdpa function, unchanged (no documents to find, or a KV cache / sliding window)."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if kwargs.get("softcap") is not None:
        # Neither sdpa nor these kernels cap the attention logits: running them would silently change the
        # model (Gemma-2). `resolve()` plans eager for such models; this guards every other way in.
        raise ValueError(
            f"model.attn_implementation = 'varlen': {type(module).__name__} soft-caps its attention logits "
            f"(softcap={kwargs['softcap']}), which varlen attention does not compute; set "
            "model.attn_implementation=eager"
        )
    if not isinstance(attention_mask, Documents):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout, scaling, **kwargs)
    kernel = getattr(module, _KERNEL_ATTR, PER_DOCUMENT)
    if kernel in _FLAT_KERNELS:
        query, key, value = _autocast(query, key, value)
    kernel = _runnable(kernel, query)
    if kernel == PER_DOCUMENT or (dropout > 0.0 and module.training):
        return _per_document(module, query, key, value, attention_mask, dropout, scaling), None
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = _FLAT_KERNELS[kernel](_flat(query), _flat(key), _flat(value), attention_mask, scale)
    return out.reshape(attention_mask.batch_size, attention_mask.seq_len, *out.shape[1:]), None
