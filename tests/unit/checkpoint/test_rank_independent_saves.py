"""Model folders zerofit writes do not depend on the distributed state the libraries see.

transformers 5's `save_pretrained` writes nothing from a process that is not rank 0 of an initialized
process group. Two forked processes form a real gloo group; rank 1 writes through `save_pretrained_here`
(what the final export and `zerofit export` use) and the folder must hold the config and the weights.
"""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch


def _tiny_model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    from zerofit.catalogue.models import TINY_LLAMA_CONFIG

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY_LLAMA_CONFIG))


def _rank(rank: int, store: str, root: str, out: Any) -> None:
    import torch.distributed as dist

    from zerofit.checkpoint.final_export import save_pretrained_here
    from zerofit.models.lora import apply_lora, lora_config

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        if rank == 1:
            model = _tiny_model()
            save_pretrained_here(model, Path(root) / "model", safe_serialization=True)
            peft = apply_lora(_tiny_model(), lora_config(4, 8, 0.0, "all-linear", False))
            save_pretrained_here(peft, Path(root) / "adapter", safe_serialization=True)
            out.put(sorted(p.name for p in (Path(root) / "model").iterdir()))
            out.put(sorted(p.name for p in (Path(root) / "adapter").iterdir()))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_rank_1_of_a_process_group_writes_the_whole_folder(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    args = (str(tmp_path / "store"), str(tmp_path), out)
    procs = [ctx.Process(target=_rank, args=(rank, *args)) for rank in (0, 1)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=120)
    assert [p.exitcode for p in procs] == [0, 0]
    model_files, adapter_files = out.get(timeout=5), out.get(timeout=5)
    assert {"config.json", "model.safetensors"} <= set(model_files)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(adapter_files)


def test_a_save_that_writes_no_weights_is_refused(tmp_path: Path) -> None:
    from zerofit.checkpoint.final_export import save_pretrained_here

    class WritesNothing:
        def save_pretrained(self, folder: Path, **_: Any) -> None:
            Path(folder).mkdir(parents=True, exist_ok=True)

    with pytest.raises(RuntimeError, match="wrote no weights"):
        save_pretrained_here(WritesNothing(), tmp_path / "x")
