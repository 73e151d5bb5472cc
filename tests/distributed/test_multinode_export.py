"""Two "nodes" on one machine train like one, and every engine's weights come back out as folders that
transformers and peft load.

One set of real launches (gloo, CPU, tiny-llama with LoRA, 4 steps of global batch 8, fp32 unless said):

    launch        launcher    what
    single        api         one process through the Python API (`zerofit.train`, in the test process;
                              micro 2 x accum 4): the single-node reference; checkpoints in state.pt
    zero3-2node   deepspeed   2 nodes x 1 rank: `deepspeed --hostfile H --no_ssh --node_rank N` (ZeRO-3
                              partitions)
    fsdp-2node    slurm       2 nodes x 1 rank: launchers/slurm_multinode.sbatch under a stand-in `srun` that
                              starts one task per node on this machine (torchrun, c10d rendezvous);
                              `distributed.preset=fsdp` alone switches the config's DeepSpeed engine to FSDP2
    not-shared    torchrun    2 nodes x 1 rank whose `output_dir`s differ: a filesystem that is not shared
    qlora-dsfile  python      QLoRA (4-bit base) in bf16 on DeepSpeed ZeRO-2 from a user JSON whose
                              WarmupDecayLR block must run; final `adapter/`

Asserted: the 2-node losses equal the single-node ones (fp32, within 1e-5); an output_dir that is not shared
fails on every rank with one paragraph; the adapters exported from state.pt, ZeRO-3 partitions and FSDP2 shards
agree (same training), and a ZeRO-3 or FSDP2 checkpoint gives the same GGUF as the final export of its
step; a merged export of each loads with `AutoModelForCausalLM` and its logits match the adapter model
built independently with peft (fp32: 1e-5 relative; QLoRA in bf16: within bf16 rounding); the user's
DeepSpeed schedule is the one that ran; `zerofit generate` prints the model's greedy continuation.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from launch_helpers import BIN, LAUNCHER, REPO, Launch, RunResult, free_port, run_launches, write_config
from zerofit.cli import main as zerofit
from zerofit.models.tiny import ensure_tiny_llama
from zerofit.strategies.optim import lr_multiplier

pytestmark = [pytest.mark.distributed, pytest.mark.slow]

SEED, STEPS, LR = 5, 4, 1e-2
TARGETS = ["q_proj", "v_proj", "lm_head"]
PROMPT = "add: 12+34\n"
BF16_EPS = 2.0**-8  # bf16's relative rounding step


@dataclass(frozen=True)
class TwoNodes(Launch):
    """2 "nodes" x 1 rank on this machine: one launcher process per node, meeting over loopback.

    `launcher`: `deepspeed` (hostfile, --no_ssh, --node_rank), `torchrun` (c10d rendezvous) or `slurm`
    (launchers/slurm_multinode.sbatch under a stand-in srun). `per_node` adds overrides to one node only.
    """

    per_node: tuple[tuple[str, ...], tuple[str, ...]] = ((), ())

    def command(self, config: Path, output_dir: Path) -> list[str]:
        port = free_port()
        args = ["--config", str(config), f"output_dir={output_dir}", f"run_name={self.name}", *self.overrides]
        if self.launcher == "slurm":
            script = [str(REPO / "launchers" / "slurm_multinode.sbatch"), *args[1:]]
            return ["bash", "-c", f"MASTER_PORT={port} {shlex.join(script)}"]
        nodes = []
        for node in (0, 1):
            if self.launcher == "deepspeed":
                head = [str(BIN / "deepspeed"), "--hostfile", str(output_dir / "hostfile"), "--no_ssh"]
                head += ["--node_rank", str(node), "--master_addr", "127.0.0.1", "--master_port", str(port)]
            else:
                head = [
                    str(BIN / "torchrun"),
                    "--nnodes",
                    "2",
                    "--nproc_per_node",
                    "1",
                    "--rdzv_backend",
                    "c10d",
                ]
                head += ["--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", self.name]
            nodes.append(shlex.join([*head, str(LAUNCHER), *args, *self.per_node[node]]))
        # Both nodes run at once; the launch fails if either does.
        return ["bash", "-c", f"{nodes[0]} & a=$!; {nodes[1]}; b=$?; wait $a; a=$?; exit $(( a ? a : b ))"]


# A stand-in for SLURM's srun on one machine: one task per node (SLURM_NNODES), in parallel, like
# `srun --ntasks-per-node=1` on a real allocation; srun's own options are skipped.
FAKE_SRUN = """#!/usr/bin/env bash
while [[ "$1" == -* ]]; do shift; done
pids=()
for node in $(seq 0 $((SLURM_NNODES - 1))); do SLURM_NODEID=$node SLURM_PROCID=$node "$@" & pids+=($!); done
rc=0; for pid in "${pids[@]}"; do wait "$pid" || rc=$?; done; exit $rc
"""
FAKE_SCONTROL = "#!/usr/bin/env bash\necho 127.0.0.1\n"

# The Hugging Face Trainer's style of DeepSpeed file: "auto" everywhere, and a WarmupDecayLR schedule.
DS_FILE = {
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 2},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {
            "warmup_min_lr": "auto",
            "warmup_max_lr": "auto",
            "warmup_num_steps": "auto",
            "total_num_steps": "auto",
        },
    },
    "train_batch_size": "auto",
    "train_micro_batch_size_per_gpu": "auto",
    "gradient_accumulation_steps": "auto",
    "gradient_clipping": "auto",
}


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("multinode")


@pytest.fixture(scope="module")
def runs(root: Path) -> dict[str, RunResult]:
    out = root / "runs"
    out.mkdir()
    (out / "hostfile").write_text("node0 slots=1\nnode1 slots=1\n")
    fake_bin = root / "bin"
    fake_bin.mkdir()
    for name, text in (("srun", FAKE_SRUN), ("scontrol", FAKE_SCONTROL)):
        (fake_bin / name).write_text(text)
        (fake_bin / name).chmod(0o755)
    data = root / "data.jsonl"
    data.write_text("\n".join((REPO / "data" / "demo.jsonl").read_text().splitlines()[:40]) + "\n")
    (root / "ds.json").write_text(json.dumps(DS_FILE))
    config = write_config(
        root / "config.yaml",
        {
            "seed": SEED,
            "model": {"name_or_path": "tiny-llama"},
            "batch": {"global_batch_size": 8, "micro_batch_size": 2},
            "distributed": {"strategy": "deepspeed", "preset": "zero3"},
            "train": {"max_steps": STEPS, "precision": "fp32"},
            "optimizer": {"lr": LR},
            "lora": {"enabled": True, "r": 8, "alpha": 16, "dropout": 0.0, "target_modules": TARGETS},
            "data": {"path": str(data), "max_seq_len": 64},
            "checkpoint": {"every_steps": 2, "save_final": False},
            "logging": {"console": False, "wandb": {"mode": "disabled"}},
        },
    )
    slurm_env = {
        "PATH": f"{fake_bin}:{BIN}:/usr/bin:/bin",
        "SLURM_NNODES": "2",
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node[0-1]",
        "VENV_BIN": str(BIN),
    }
    launches = [
        TwoNodes("zero3-2node", "deepspeed"),
        TwoNodes("fsdp-2node", "slurm", ("distributed.preset=fsdp",), env=slurm_env),
        TwoNodes(
            "not-shared",
            "torchrun",
            ("distributed.strategy=ddp",),
            per_node=((f"output_dir={out}/node0",), (f"output_dir={out}/node1",)),
        ),
        Launch(
            "qlora-dsfile",
            "python",
            (
                f"distributed.ds_config={root / 'ds.json'}",
                "distributed.preset=null",
                "quantization.load_in=4bit",
                "train.precision=bf16",
                "scheduler.warmup_steps=2",
                "checkpoint.save_final=true",
            ),
        ),
        Launch("single", "api", ("distributed.strategy=single",)),
    ]
    return run_launches(launches, config, out)


@pytest.fixture(scope="module")
def exports(runs: dict[str, RunResult], root: Path) -> dict[str, Path]:
    """Every export the tests read, written once through the CLI (in this process)."""
    out: dict[str, Path] = {}
    jobs = {
        "single-adapter": ("single", []),
        "single-merged": ("single", ["--merge"]),
        "zero3-adapter": ("zero3-2node", []),
        "zero3-merged": ("zero3-2node", ["--merge"]),
        "zero3-step2": ("zero3-2node", ["--step", "2"]),
        "fsdp-adapter": ("fsdp-2node", []),
        "fsdp-merged": ("fsdp-2node", ["--merge"]),
        "qlora-merged": ("qlora-dsfile", ["--merge"]),
        # GGUF (f32: no rounding to hide a difference) from the final adapter/ and from checkpoint step-4
        **{
            f"{engine}-gguf{tail}": (run, ["--format", "gguf", "--quant", "f32", *flags])
            for engine, run in (("zero3", "zero3-2node"), ("fsdp", "fsdp-2node"))
            for tail, flags in (("", []), ("-step4", ["--step", str(STEPS)]))
        },
    }
    for name, (run, flags) in jobs.items():
        folder = root / "exports" / name
        assert zerofit(["export", str(runs[run].check().run_dir), "--out", str(folder), *flags]) == 0
        out[name] = folder
    return out


def _adapter(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(folder / "adapter_model.safetensors")


def _logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def _ids() -> torch.Tensor:
    return torch.randint(3, 100, (2, 48), generator=torch.Generator().manual_seed(0))


def _peft_reference(adapter_dir: Path, dtype: torch.dtype, quantized: bool = False) -> Any:
    """The adapter model built with transformers + peft alone (no zerofit code): base as the run loaded it."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = (
        BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
        )
        if quantized
        else None
    )
    base = AutoModelForCausalLM.from_pretrained(
        ensure_tiny_llama(SEED), dtype=dtype, quantization_config=quant
    )
    model = PeftModel.from_pretrained(base, str(adapter_dir))
    # bitsandbytes repacks 4-bit weights for an AVX512-BF16 CPU kernel in eval mode, which needs layer widths
    # divisible by 32 (tiny-llama's are not); train mode computes as training did (no dropout here: 0.0).
    return model.train() if quantized else model.eval()


# ------------------------------------------------------------------------------------------------ multi-node


@pytest.mark.parametrize("name", ["zero3-2node", "fsdp-2node"])
def test_two_nodes_give_the_single_node_losses(runs: dict[str, RunResult], name: str) -> None:
    ref, run = runs["single"].check(), runs[name].check()
    assert [row["dp_size"] for row in run.metrics] == [2] * STEPS
    assert run.series("tokens") == ref.series("tokens")
    diff = max(abs(a - b) for a, b in zip(run.series("loss"), ref.series("loss"), strict=True))
    assert diff < 1e-5, (run.series("loss"), ref.series("loss"))
    # The plan is printed once, by rank 0 on node 0, and states the storage assumption.
    assert run.stdout.count("zerofit plan") == 1
    assert "shared by all 2 ranks" in run.stdout


def test_a_preset_alone_switches_the_engine_and_the_plan_says_so(runs: dict[str, RunResult]) -> None:
    run = runs["fsdp-2node"].check()
    assert "is a fsdp preset, so distributed.strategy = 'fsdp'" in run.stdout
    assert (run.run_dir / "fsdp.json").is_file() and not (run.run_dir / "ds_config.json").exists()


def test_an_output_dir_that_is_not_shared_fails_clearly_on_every_rank(runs: dict[str, RunResult]) -> None:
    run = runs["not-shared"]
    assert run.returncode != 0
    for rank in (0, 1):
        assert f"zerofit (rank {rank}): error: output_dir = " in run.stderr
    assert "rank 1 on" in run.stderr and "cannot see the file rank 0" in run.stderr and "Fix:" in run.stderr
    assert 'File "' + str(REPO / "src") not in run.stderr  # no traceback through zerofit's code
    assert not list((run.run_dir.parent / "node0").glob("*/metrics.jsonl"))  # nothing trained


# ------------------------------------------------------------------------------------------------ export


def test_adapters_from_state_zero3_and_fsdp_shards_agree(exports: dict[str, Path]) -> None:
    ref = _adapter(exports["single-adapter"])
    assert len(ref) == 2 * 5  # q_proj, v_proj on 2 layers + lm_head, A and B each
    for name in ("zero3-adapter", "fsdp-adapter"):
        other = _adapter(exports[name])
        assert set(other) == set(ref)
        worst = max(float((other[k] - ref[k]).abs().max()) for k in ref)
        assert worst < 1e-5, f"{name}: {worst:.3g}"
    # Training moved them: step 2 differs from step 4.
    step2 = _adapter(exports["zero3-step2"])
    assert max(float((step2[k] - ref[k]).abs().max()) for k in ref) > 1e-3


@pytest.mark.parametrize("engine", ["zero3", "fsdp"])
def test_a_zero3_or_fsdp_checkpoint_gives_the_same_gguf_as_the_final_export(
    exports: dict[str, Path], engine: str
) -> None:
    import numpy as np
    from gguf import GGUFReader

    final, checkpoint = (
        GGUFReader(next(exports[f"{engine}-gguf{tail}"].glob("*.gguf"))) for tail in ("", "-step4")
    )
    assert [t.name for t in final.tensors] == [t.name for t in checkpoint.tensors]
    for a, b in zip(final.tensors, checkpoint.tensors, strict=True):
        assert a.tensor_type == b.tensor_type, a.name
        worst = float(np.abs(np.asarray(a.data, np.float32) - np.asarray(b.data, np.float32)).max())
        assert worst < 1e-6, f"{engine} {a.name}: {worst:.3g}"
    info = json.loads((exports[f"{engine}-gguf-step4"] / "zerofit_export.json").read_text())
    assert info["source"].startswith(f"checkpoint step-{STEPS}")


@pytest.mark.parametrize("name", ["single-merged", "zero3-merged", "fsdp-merged"])
def test_merged_export_loads_in_transformers_and_matches_the_adapter(
    exports: dict[str, Path], name: str
) -> None:
    from transformers import AutoModelForCausalLM

    ids = _ids()
    merged = AutoModelForCausalLM.from_pretrained(exports[name]).eval()
    assert merged.dtype == torch.float32  # auto: the run's train.precision
    reference = _peft_reference(exports[name.replace("merged", "adapter")], torch.float32)
    got, want = _logits(merged, ids), _logits(reference, ids)
    with reference.disable_adapter():
        base = _logits(reference, ids)
    scale = float(want.abs().max())
    assert float((got - want).abs().max()) < 1e-5 * scale
    assert float((base - want).abs().max()) > 1e-2 * scale  # the adapter matters: a bare base would fail


def test_qlora_merge_is_bf16_and_matches_the_adapter_within_bf16_rounding(
    exports: dict[str, Path], runs: dict[str, RunResult]
) -> None:
    from transformers import AutoModelForCausalLM

    ids = _ids()
    merged = AutoModelForCausalLM.from_pretrained(exports["qlora-merged"]).eval()
    assert merged.dtype == torch.bfloat16
    assert not any("4bit" in type(m).__name__ for m in merged.modules())  # dequantized: plain Linear layers
    reference = _peft_reference(runs["qlora-dsfile"].run_dir / "adapter", torch.bfloat16, quantized=True)
    got, want = _logits(merged, ids), _logits(reference, ids)
    with reference.disable_adapter():
        base = _logits(reference, ids)
    scale = float(want.abs().max())
    tolerance = 4 * BF16_EPS * scale  # a few bf16 rounding steps of the largest logit
    assert float((got - want).abs().max()) < tolerance
    assert float((base - want).abs().max()) > 4 * tolerance


def test_export_folder_has_tokenizer_card_and_provenance(
    exports: dict[str, Path], runs: dict[str, RunResult]
) -> None:
    folder = exports["zero3-merged"]
    assert {"config.json", "model.safetensors", "tokenizer.json", "README.md", "zerofit_export.json"} <= {
        p.name for p in folder.iterdir()
    }
    info = json.loads((folder / "zerofit_export.json").read_text())
    assert (info["kind"], info["step"], info["dtype"]) == ("merged", STEPS, "float32")
    card = (folder / "README.md").read_text()
    final_loss = runs["zero3-2node"].series("loss")[-1]
    for text in (
        "tiny-llama",
        "data.jsonl",
        f"{STEPS} optimizer steps of global 8 = micro 2 x accum 2 x dp 2",
        "checkpoint step-4",
        f"{final_loss:.4f}",
    ):
        assert text in card, text
    assert "library_name: peft" in (exports["single-adapter"] / "README.md").read_text()


def test_export_errors_are_one_paragraph(
    runs: dict[str, RunResult], root: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = str(runs["zero3-2node"].run_dir)
    assert zerofit(["export", run_dir, "--step", "3", "--out", str(root / "x")]) == 2
    assert "no complete checkpoint step-3 (complete checkpoints: 2, 4)" in capsys.readouterr().err
    foreign = root / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    assert zerofit(["export", run_dir, "--out", str(foreign)]) == 2
    assert "not a zerofit export" in capsys.readouterr().err
    assert (foreign / "notes.txt").read_text() == "mine"


def test_a_failed_export_leaves_the_earlier_one_in_place(
    exports: dict[str, Path], runs: dict[str, RunResult], monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = exports["single-adapter"]
    before = {p.name: p.read_bytes() for p in folder.iterdir()}

    def broken(*args: Any, **kwargs: Any) -> str:
        raise RuntimeError("disk full")

    monkeypatch.setattr("zerofit.export.folder.model_card", broken)
    with pytest.raises(RuntimeError, match="disk full"):
        zerofit(["export", str(runs["single"].run_dir), "--out", str(folder)])
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before
    assert [p.name for p in folder.parent.iterdir() if ".tmp" in p.name] == []


# ------------------------------------------------------------------------------------------------ schedule


def test_the_users_deepspeed_schedule_is_the_one_that_runs(runs: dict[str, RunResult]) -> None:
    from deepspeed.runtime.lr_schedules import WarmupDecayLR

    run = runs["qlora-dsfile"].check()
    engine = json.loads((run.run_dir / "ds_config.json").read_text())
    assert engine["scheduler"]["type"] == "WarmupDecayLR"
    params = engine["scheduler"]["params"]
    assert (params["warmup_max_lr"], params["warmup_num_steps"], params["total_num_steps"]) == (LR, 2, STEPS)
    # DeepSpeed's own class, stepped once per optimizer step, is the reference.
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=LR)
    schedule = WarmupDecayLR(optimizer, **params)
    expected = []
    for _ in range(STEPS):
        expected.append(optimizer.param_groups[0]["lr"])
        schedule.step()
    assert run.series("lr") == pytest.approx(expected, rel=1e-9, abs=1e-12)
    cosine = [LR * lr_multiplier("cosine", 2, STEPS, 0.0)(step) for step in range(STEPS)]
    assert run.series("lr") != pytest.approx(cosine, rel=1e-3)  # zerofit's own schedule did not run
    assert (
        "DeepSpeed WarmupDecayLR schedule" in run.stdout
        and "scheduler.name 'cosine' is not used" in run.stdout
    )


# ------------------------------------------------------------------------------------------------ generate


def _greedy(model: Any, tokenizer: Any, prompt: str, n: int) -> str:
    """Greedy decoding written out by hand: argmax, append, repeat; stop at eos."""
    ids = [tokenizer.bos_token_id, *tokenizer.encode(prompt, add_special_tokens=False)]
    new: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            token = int(model(input_ids=torch.tensor([ids + new])).logits[0, -1].argmax())
        if token == tokenizer.eos_token_id:
            break
        new.append(token)
    return str(tokenizer.decode(new, skip_special_tokens=True))


def test_generate_prints_the_greedy_continuation(
    runs: dict[str, RunResult], exports: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = exports["single-merged"]
    want = _greedy(
        AutoModelForCausalLM.from_pretrained(folder).eval(), AutoTokenizer.from_pretrained(folder), PROMPT, 12
    )
    for path in (runs["single"].run_dir, folder, exports["single-adapter"]):
        assert zerofit(["generate", str(path), "--prompt", PROMPT, "--max-new-tokens", "12"]) == 0
        assert capsys.readouterr().out == want + "\n", path
