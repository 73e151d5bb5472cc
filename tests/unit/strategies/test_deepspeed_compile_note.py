"""The one line a DeepSpeed launch prints before it JIT-compiles an op: which, where, and that it is once."""

from __future__ import annotations

from pathlib import Path

from zerofit.strategies.deepspeed import compile_note, jit_ops, ops_to_compile


def test_a_cpu_launch_announces_the_allreduce_build_until_it_is_built(tmp_path: Path) -> None:
    assert jit_ops("cuda", cpu_adam=False) == [] and jit_ops("cpu", cpu_adam=False) == ["deepspeed_shm_comm"]
    assert jit_ops("cuda", cpu_adam=True) == ["cpu_adam"]
    assert ops_to_compile(["deepspeed_shm_comm"], tmp_path) == ["deepspeed_shm_comm"]
    assert compile_note(["deepspeed_shm_comm"], tmp_path) == (
        f"zerofit: DeepSpeed compiles its CPU shared-memory allreduce once into {tmp_path} (a minute or two; "
        "later launches reuse it; TORCH_EXTENSIONS_DIR moves it)"
    )
    (tmp_path / "deepspeed_shm_comm").mkdir()
    (tmp_path / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").write_bytes(b"")
    assert ops_to_compile(["deepspeed_shm_comm"], tmp_path) == []  # built once: no note on later launches
