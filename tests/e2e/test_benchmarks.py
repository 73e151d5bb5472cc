"""Every script in benchmarks/ runs as a user runs it, at its smallest size, so none can rot unnoticed.

Each is started as a subprocess from the repository root (CPU, tiny-llama, one or two timed steps) and must
exit 0 and print or write its result: the ratios it exists to report, its JSON. Nothing here looks at the
numbers themselves (tests never assert on time). gpu_fit.py runs once, with every case its tests read.
`workloads.py` is the module they share: it feeds zerofit's real training loop (`assemble` + `train_loop`),
which is what broke when the loop's checkpointer protocol gained an argument.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow]

REPO = Path(__file__).resolve().parents[2]
BENCH = REPO / "benchmarks"


def _command(*args: str) -> dict[str, Any]:
    """A benchmark command: this interpreter, `args`, and one thread per process (the suite shares a small
    CPU, and these measure nothing here), with no rendezvous of an outer launch."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO / "src")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    return {"args": [sys.executable, *args], "env": env}


def _finished(args: list[str], result: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    assert result.returncode == 0, f"{args}\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


# gpu_fit's cases (and groups) in the module's one gpu_fit command, by the test that reads them.
GPU_FIT_CASES = (
    "lora-auto",
    "rl",
    "lora-kernels-compile",
    "hf-best",
    "long-16k",
    "long-2gpu-sp",
    "lora-2gpu-fsdp",
)


# The module's benchmark commands, by test: each runs one thread (one core), so they are started together,
# as many at a time as there are cores (longest first), instead of one after another beside an idle core.
def _commands(tmp: Path, tiny_llama: Path) -> dict[str, tuple[str, ...]]:
    gpu_fit = (str(BENCH / "gpu_fit.py"), "--smoke", "--steps", "1", "--results")
    small_hf = ("--micro", "1", "--gas", "2", "--seq", "32", "--steps", "1", "--precision", "fp32")
    small_cpu = ("--steps", "1", "--repeats", "1", "--seq", "32", "--global-batch", "4", "--hf-micro", "2")
    small_oh = (
        "--steps",
        "1",
        "--warmup",
        "0",
        "--repeats",
        "1",
        "--micro",
        "2",
        "--global-batch",
        "4",
        "--threads",
        "1",
    )
    return {
        # gpu_fit, one command for every case the tests read (its --smoke runs the one-process cases in its own
        # process: one start for all): a zerofit case; the speed levers and HF's best at the
        # recipe's split; one length of the long-context set with the 2-rank Ulysses case and the 2-GPU FSDP
        # case (skipped on CPU); GRPO: the 3090 recipe's case (on CPU: the tiny model) against
        # TRL's GRPOTrainer.
        "gpu_fit": (*gpu_fit, str(tmp / "gpu_fit"), "--cases", ",".join(GPU_FIT_CASES)),
        "cpu_vs_hf": (str(BENCH / "cpu_vs_hf.py"), *small_cpu, "--json", str(tmp / "cpu_vs_hf.json")),
        "overhead": (
            str(BENCH / "overhead_vs_torch.py"),
            *small_oh,
            "data.max_seq_len=32",
            "--json",
            str(tmp / "overhead.json"),
        ),
        "hf_baseline": (
            str(BENCH / "hf_baseline.py"),
            "--model-dir",
            str(tiny_llama),
            *small_hf,
            "--out",
            str(tmp / "hf.jsonl"),
        ),
        "loss_memory": (str(BENCH / "loss_memory.py"), "--smoke", "--json", str(tmp / "loss_memory.json")),
        "grpo_real": (str(BENCH / "grpo_real.py"), "--smoke", "--json", str(tmp / "grpo_real.json")),
        "distill_real": (str(BENCH / "distill_real.py"), "--smoke", "--json", str(tmp / "distill_real.json")),
        "agent_real": (str(BENCH / "agent_real.py"), "--smoke", "--json", str(tmp / "agent_real.json")),
        "agent_toy": (
            str(BENCH / "agent_real.py"),
            "--toy",
            "tools",
            "--smoke",
            "--json",
            str(tmp / "agent_toy.json"),
        ),
        "packed_dpo_vs_trl": (
            str(BENCH / "packed_dpo_vs_trl.py"),
            "--smoke",
            "--json",
            str(tmp / "packed_dpo_vs_trl.json"),
        ),
        "rollout_vs_trl": (
            str(BENCH / "rollout_vs_trl.py"),
            "--smoke",
            "--json",
            str(tmp / "rollout_vs_trl.json"),
        ),
        "planner_families": (
            str(BENCH / "planner_families.py"),
            "--smoke",
            str(tmp / "planner_families.json"),
        ),
        "startup": (str(BENCH / "startup.py"), "--smoke", "--json", str(tmp / "startup.json")),
        "plan_speed": (str(BENCH / "plan_speed.py"), "--smoke", "--json", str(tmp / "plan_speed.json")),
    }


@dataclass
class Ran:
    """One benchmark command's outcome and the folder its results went to."""

    args: list[str]
    result: subprocess.CompletedProcess[str]
    tmp: Path

    def ok(self) -> subprocess.CompletedProcess[str]:
        return _finished(self.args, self.result)


@pytest.fixture(scope="module")
def ran(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Ran]:
    from concurrent.futures import ThreadPoolExecutor

    from zerofit.models.tiny import ensure_tiny_llama

    tmp = tmp_path_factory.mktemp("benchmarks")
    (tmp / "gpu_fit").mkdir()
    commands = _commands(tmp, ensure_tiny_llama(0))

    def run(args: tuple[str, ...]) -> Ran:
        cmd = _command(*args)
        result = subprocess.run(
            cmd["args"], cwd=REPO, env=cmd["env"], capture_output=True, text=True, timeout=900
        )
        return Ran(cmd["args"], result, tmp)

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    with ThreadPoolExecutor(max_workers=max(1, cores)) as pool:
        futures = {name: pool.submit(run, args) for name, args in commands.items()}
        return {name: future.result() for name, future in futures.items()}


def test_cpu_vs_hf_prints_and_writes_its_ratios(ran: dict[str, Ran]) -> None:
    result, out = ran["cpu_vs_hf"].ok(), ran["cpu_vs_hf"].tmp / "cpu_vs_hf.json"
    assert (
        "zf-auto / hf (max-length): " in result.stdout and "x (useful tokens per CPU second)" in result.stdout
    )
    report = json.loads(out.read_text())
    assert set(report["median"]) == {
        "zf-same",
        "zf-full",
        "zf-auto",
        "zf-packed",
        "zf-auto-real",
        "hf",
        "hf-real",
    }
    assert all(value > 0 for value in report["ratios_useful_tokens_per_cpu_s"].values())


def _gpu_fit(ran: dict[str, Ran]) -> tuple[subprocess.CompletedProcess[str], Path, dict[str, Any]]:
    """The gpu_fit command's output, its one results file and that file's report."""
    result = ran["gpu_fit"].ok()
    (path,) = (ran["gpu_fit"].tmp / "gpu_fit").glob("gpu_fit-smoke-*.json")
    return result, path, json.loads(path.read_text())


def _cases(report: dict[str, Any], *names: str) -> dict[str, dict[str, Any]]:
    """The report's results of the cases `names` (case names or gpu_fit groups), by case; each ran once."""
    sys.path.insert(0, str(BENCH))
    import gpu_fit

    wanted = gpu_fit.expand_cases(",".join(names))
    cases = [r["case"] for r in report["results"]]
    assert len(cases) == len(set(cases)) and set(wanted) <= set(cases), cases
    return {r["case"]: r for r in report["results"] if r["case"] in wanted}


def test_gpu_fit_smoke_runs_a_zerofit_case_and_writes_its_results(ran: dict[str, Ran]) -> None:
    result, path, report = _gpu_fit(ran)
    assert f"wrote {path}" in result.stdout
    case = _cases(report, "lora-auto")["lora-auto"]
    assert case["ok"] is True, case
    assert case["useful_tokens_per_s"] > 0 and case["predicted"]["verdict"]


def test_gpu_fit_smoke_runs_the_grpo_case_and_trls(ran: dict[str, Ran]) -> None:
    """The GRPO case (generation and training timed apart, the plan's phases beside the measured peak) and
    TRL's GRPOTrainer at the same settings, with their step-time ratio."""
    result, _, report = _gpu_fit(ran)
    by = _cases(report, "rl")
    assert by["grpo"]["ok"] is True and by["trl-grpo"]["ok"] is True, by
    measured = by["grpo"]["measured"]
    assert measured["time/generation_s"] > 0 and measured["time/training_s"] > 0 and measured["steps"] == 1
    assert "generation" in by["grpo"]["predicted"]["phases_gib"]
    assert "TRL / zerofit step time:" in result.stdout


def test_gpu_fit_smoke_runs_the_speed_lever_cases_setup(ran: dict[str, Ran]) -> None:
    # kernels + compile and HF's best at the recipe's split; on CPU the kernels case runs with
    # train.kernels=none (Liger needs CUDA), so the smoke checks the case's setup, compile, and the ratio.
    _, _, report = _gpu_fit(ran)
    by = _cases(report, "lora-kernels-compile", "hf-best")
    assert all(r["ok"] is True and r["useful_tokens_per_s"] > 0 for r in by.values()), by
    zf = by["lora-kernels-compile"]
    assert (
        zf["smoke_kernels_off"] is True
        and zf["levers"]["compile"] is True
        and zf["levers"]["kernels"] == "none"
    )
    assert zf["compile_graph_breaks"] is not None
    assert "lora-kernels-compile / hf-best" in report["ratios_useful_tokens_per_s"]


def test_gpu_fit_smoke_runs_the_long_context_cases_and_their_ratios(ran: dict[str, Ran]) -> None:
    # One length of the long-context set (the group `long-16k`): zerofit QLoRA and LoRA with the levers, and
    # HF's padding-free baseline for each; on CPU every length is the same tiny run, so one stands for all.
    # With them the 2-rank Ulysses case, which --smoke runs on 2 gloo CPU ranks, and the 2-GPU
    # FSDP case, which it cannot run: recorded as skipped with the reason, and the script still exits 0.
    result, _, report = _gpu_fit(ran)
    by = _cases(report, "long-16k", "long-2gpu-sp", "lora-2gpu-fsdp")
    assert by.pop("lora-2gpu-fsdp") == {
        "case": "lora-2gpu-fsdp",
        "ok": False,
        "skipped": "needs 2 GPUs; --smoke runs it on none",
    }
    sp = by.pop("long-2gpu-sp")
    assert sp["ok"] is True and sp["useful_tokens_per_s"] > 0, sp
    # Two ranks trained one sequence between them: SP 2, dp 1, and each rank's memory was logged.
    assert sp["batch"] == {"global": 1, "micro": 1, "accum": 1, "dp": 1, "sequence_parallel": 2, "ranks": 2}
    assert [r["rank"] for r in sp["memory_per_rank"]] == [0, 1] and sp["predicted"]["verdict"]
    assert sp["overrides"][0] == "data.max_seq_len=61440"  # the GPU length; --smoke runs 64 tokens
    context = sp["context_vs_one_card"]
    assert context["tokens"] == 64 and context["one_card_planned_memory_tokens"] > 0
    assert context["2_cards_planned_memory_tokens"] >= context["one_card_planned_memory_tokens"]
    assert "  long-2gpu-sp: 64 tokens over 2 ranks, useful " in result.stdout
    assert set(by) == {"long-qlora-16k", "long-lora-16k", "long-hf-qlora-16k", "long-hf-lora-16k"}
    assert all(r["ok"] is True and r["useful_tokens_per_s"] > 0 for r in by.values()), by
    # The one-card LoRA case ran in the same command: the SP case's context is compared with its length.
    assert context["one_card_measured_tokens"] == 16384
    for case in ("long-qlora-16k", "long-lora-16k"):  # the levers reached the resolved config
        assert by[case]["cross_entropy"] == "fused_linear" and by[case]["activation_checkpointing"] is True
        assert by[case]["levers"]["activation_offload"] is True and by[case]["levers"]["tiled_mlp"] == 4
        assert by[case]["batch"]["micro"] == 1 and by[case]["predicted"]["verdict"]
    assert by["long-lora-16k"]["levers"]["lean_norm"] is True  # the LoRA recipe's 32k needs it
    assert by["long-hf-qlora-16k"]["load_in_4bit"] is True and by["long-hf-lora-16k"]["load_in_4bit"] is False
    assert all(by[c]["collator"] == "flatten" for c in ("long-hf-qlora-16k", "long-hf-lora-16k"))
    assert set(report["ratios_useful_tokens_per_s"]) == {  # with the speed levers' pair: all the command's
        "long-qlora-16k / long-hf-qlora-16k",
        "long-lora-16k / long-hf-lora-16k",
        "lora-kernels-compile / hf-best",
    }
    assert "zerofit / HF, useful tokens/s, long-qlora-16k / long-hf-qlora-16k: " in result.stdout
    assert "  qlora 16k " in result.stdout and "  lora 16k " in result.stdout  # the per-length table


def test_gpu_fit_smoke_runs_a_one_process_case_in_its_own_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--smoke` runs a one-process case's command in gpu_fit's process (its script's `main`, the child's
    environment, stdout read back as the child's): a refusal there is the case's error, as a child's exit
    would be, and the environment is left as it was."""
    sys.path.insert(0, str(BENCH))
    import gpu_fit

    monkeypatch.setattr(gpu_fit.subprocess, "run", lambda *a, **k: pytest.fail(f"started a child: {a}"))
    monkeypatch.setenv("RANK", "3")  # an outer launch's rank: not the case's
    before = dict(os.environ)
    cmd = [sys.executable, str(BENCH / "hf_baseline.py"), "--model-dir", "x", "--workload", "nope"]
    result = gpu_fit._run_child("hf", cmd, smoke=True)
    assert result["ok"] is False and result["returncode"] == 2, result
    assert "invalid choice: 'nope'" in result["error"] and dict(os.environ) == before


def test_gpu_fit_long_model_is_the_llama_3_1_8b_shape() -> None:
    # The GPU run builds its random model from this config: a key transformers ignored would silently give
    # another model (e.g. default rope instead of llama3 scaling), so check what transformers builds.
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from zerofit.models.meta import hf_config

    sys.path.insert(0, str(BENCH))
    import gpu_fit

    config = gpu_fit.model_config(gpu_fit.LONG_MODEL, AutoConfig, hf_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    assert model.model.rotary_emb.rope_type == "llama3" and config.max_position_embeddings == 131072
    assert config.rope_parameters["factor"] == 8.0 and config.rope_parameters["rope_theta"] == 500000.0
    shape = (config.hidden_size, config.intermediate_size, config.num_hidden_layers)
    assert shape == (4096, 14336, 32) and (config.num_attention_heads, config.num_key_value_heads) == (32, 8)
    assert config.vocab_size == 128256 and sum(p.numel() for p in model.parameters()) == 8_030_261_248
    # The 2-GPU cases need 2 cards; with fewer they are skipped with the reason (written to the results).
    assert gpu_fit.skip_reason("long-2gpu-sp", smoke=False, gpus=1) == (
        "needs 2 GPUs, 1 found here (torch.cuda.device_count()): not run"
    )
    assert gpu_fit.skip_reason("long-2gpu-sp", smoke=False, gpus=2) is None
    assert gpu_fit.skip_reason("long-2gpu-sp", smoke=True, gpus=0) is None  # 2 gloo CPU ranks
    assert gpu_fit.skip_reason("lora-2gpu-fsdp", smoke=True, gpus=0) is not None
    assert gpu_fit.CASE_GROUPS["long"] == [
        f"long-{kind}-{length}"
        for length in ("16k", "32k", "64k")
        for kind in ("qlora", "lora", "hf-qlora", "hf-lora")
    ]


def test_hf_baseline_prints_its_result_line(ran: dict[str, Ran]) -> None:
    result, out = ran["hf_baseline"].ok(), ran["hf_baseline"].tmp / "hf.jsonl"
    (line,) = [line for line in result.stdout.splitlines() if line.startswith("HF_BASELINE ")]
    printed = json.loads(line.removeprefix("HF_BASELINE "))
    assert printed["ok"] is True and printed["useful_tokens_per_s"] > 0
    assert json.loads(out.read_text()) == printed


def test_overhead_vs_torch_prints_its_ratio_and_writes_json(ran: dict[str, Ran]) -> None:
    result, out = ran["overhead"].ok(), ran["overhead"].tmp / "overhead.json"
    assert "ratio zerofit / reference (median step time): " in result.stdout
    assert "ratio zerofit / reference (median step CPU time): " in result.stdout
    report = json.loads(out.read_text())
    assert report["ratio_median_step"] > 0 and report["ratio_median_step_cpu"] > 0
    assert report["device"].endswith("torch threads 1")  # --threads 1


def test_loss_memory_prints_every_loss_and_writes_its_json(ran: dict[str, Ran]) -> None:
    result, out = ran["loss_memory"].ok(), ran["loss_memory"].tmp / "loss_memory.json"
    assert "fused_linear / chunked: peak " in result.stdout
    report = json.loads(out.read_text())
    assert [r["impl"] for r in report["results"]] == ["unchunked", "chunked", "fused_linear"]
    sums = [r["loss_sum"] for r in report["results"]]
    assert max(sums) - min(sums) <= 1e-5 * max(sums)  # the same token sums
    assert all(r["peak_mib"] > 0 for r in report["results"])


def test_grpo_real_smoke_trains_and_scores_the_base_and_the_trained_model(ran: dict[str, Ran]) -> None:
    """`grpo_real.py --smoke`: one GRPO step through `zerofit.train` on tiny-llama, then the held-out reward
    of the base (adapters off) and of the trained model, each over 5 prompts x 4 fixed-seed samples."""
    result, out = ran["grpo_real"].ok(), ran["grpo_real"].tmp / "grpo_real.json"
    assert "base     held-out reward " in result.stdout and "trained  held-out reward " in result.stdout
    report = json.loads(out.read_text())
    assert report["run"]["model"] == "tiny-llama" and report["run"]["steps"] == 1
    for name in ("base", "trained"):
        assert report[name]["completions"] == 20
        assert set(report[name]) >= {"reward", "rewards/exact_match", "rewards/format_regex"}
    assert len(report["train_reward_per_step"]) == 1


def test_distill_real_smoke_trains_a_teacher_and_a_student_and_scores_both(ran: dict[str, Ran]) -> None:
    """`distill_real.py --smoke`: the demo's run on tiny-llama (1 step) exported merged as the teacher, a gkd
    student (1 step, its own samples only); the base, the student and the teacher each answer 3 + 3 held-out
    prompts."""
    result, out = ran["distill_real"].ok(), ran["distill_real"].tmp / "distill_real.json"
    assert "  student   format " in result.stdout and "  teacher   format " in result.stdout
    report = json.loads(out.read_text())
    assert report["model"] == "tiny-llama" and len(report["student"]["loss_per_step"]) == 1
    assert report["heldout"]["of"] == {"format": 3, "facts": 3} and report["teacher"]["trained_here"]
    for who in ("base", "teacher", "student"):
        assert set(report["heldout"][who]) == {"format", "facts", "samples"}


def test_agent_real_smoke_trains_and_scores_tool_use(ran: dict[str, Ran]) -> None:
    """`agent_real.py --smoke`: one agentic GRPO step with the calculator tool on tiny-llama (the fallback
    template), then held-out accuracy and tool use of the base and the trained model (3 problems x 2)."""
    result, out = ran["agent_real"].ok(), ran["agent_real"].tmp / "agent_real.json"
    assert "base     held-out accuracy " in result.stdout and "trained  held-out accuracy " in result.stdout
    report = json.loads(out.read_text())
    assert report["run"]["model"] == "tiny-llama" and report["run"]["steps"] == 1
    for name in ("base", "trained"):
        assert report[name]["trajectories"] == 6
        assert {"accuracy", "tool_call_rate", "turns_per_trajectory"} <= set(report[name])
    assert set(report["train_per_step"][0]) == {
        "reward",
        "agent/tool_calls",
        "agent/tool_errors",
        "agent/turns",
    }


def test_agent_real_toy_smoke_scores_the_taught_tiny_model(ran: dict[str, Ran]) -> None:
    """`agent_real.py --toy tools --smoke`: the same benchmark on the tiny model taught the call format
    (`tests/agent_helpers.py`), full fine-tune, two tools, 1 step; its base (the starting weights) calls tools."""
    result, out = ran["agent_toy"].ok(), ran["agent_toy"].tmp / "agent_toy.json"
    assert "base     held-out accuracy " in result.stdout and "trained  held-out accuracy " in result.stdout
    report = json.loads(out.read_text())
    assert report["run"]["task"] == "toy-tools" and report["run"]["steps"] == 1
    assert "test-tool-caller" in report["run"]["model"]
    assert report["base"]["trajectories"] == 6 and report["base"]["tool_call_rate"] > 0


def test_packed_dpo_vs_trl_smoke_prints_and_writes_its_ratios(ran: dict[str, Ran]) -> None:
    """`packed_dpo_vs_trl.py --smoke`: TRL's DPOTrainer, zerofit padded and packed, one step each on tiny-llama."""
    result, out = ran["packed_dpo_vs_trl"].ok(), ran["packed_dpo_vs_trl"].tmp / "packed_dpo_vs_trl.json"
    assert "zf-packed / trl: " in result.stdout and "zf-padded / trl: " in result.stdout
    report = json.loads(out.read_text())
    assert set(report["median"]) == {"trl", "zf-padded", "zf-packed"}
    assert set(report["ratios_useful_tokens_per_cpu_s"]) == {"zf-packed / trl", "zf-padded / trl"}
    assert all(len(runs) == 1 for runs in report["runs"].values())
    assert report["runs"]["zf-packed"][0]["split"]["tokens_per_micro_batch"] == 2 * 32  # batch 2 x seq 32
    assert report["runs"]["zf-padded"][0]["split"]["tokens_per_micro_batch"] is None


def test_rollout_vs_trl_smoke_prints_and_writes_both_ratios(ran: dict[str, Ran]) -> None:
    """`rollout_vs_trl.py --smoke`: zerofit's rollout sampler and whole GRPO step against TRL's GRPOTrainer on
    tiny-llama, the generation and whole-step ratios and the forward shares that bound them printed and written."""
    result, out = ran["rollout_vs_trl"].ok(), ran["rollout_vs_trl"].tmp / "rollout_vs_trl.json"
    assert "zerofit / TRL generation: " in result.stdout and "zerofit / TRL whole step: " in result.stdout
    report = json.loads(out.read_text())
    (model,) = report["results"]
    assert model["model"] == "tiny-llama" and report["settings"]["g"] == 8
    assert model["ratio_gen"] > 0 and model["ratio_step"] > 0
    assert set(model["median_tokens_per_cpu_s"]) == {"zf_gen", "trl_gen", "zf_step", "trl_step"}
    # the ceiling measured: each side's generation CPU in the model's forward
    assert "generation CPU in the model's forward: " in result.stdout
    assert all(0 < share <= 1 for share in model["forward_share_gen"].values()) and model["ceiling_gen"] > 0


def test_planner_families_smoke_compares_a_tiny_moe_with_its_trace(ran: dict[str, Ran]) -> None:
    ran["planner_families"].ok()
    out = ran["planner_families"].tmp / "planner_families.json"
    (row,) = json.loads(out.read_text())["points"]
    assert row["model"] == "tiny Qwen/Qwen3-30B-A3B" and row["trace_gib"] > 0
    assert abs(row["diff_pct"]) < 5  # the analytic estimate within 5% of the trace


def test_startup_smoke_launches_before_and_after_to_their_first_step(ran: dict[str, Ran]) -> None:
    """`startup.py --smoke`: the plain one-process launch from the merge-base with main (or, without git
    history, from this tree) and from this tree, each ended at its first optimizer step, with the ratio,
    the floors and both sides' import-time tables."""
    result, out = ran["startup"].ok(), ran["startup"].tmp / "startup.json"
    assert "ratio " in result.stdout and "-X importtime of the plain launch" in result.stdout
    report = json.loads(out.read_text())
    plain = report["launches"]["plain"]
    assert plain["measured"] == "start to first optimizer step" and plain["ratio_after_before"] > 0
    assert len(plain["before_cpu_s"]) == len(plain["after_cpu_s"]) == 1
    # each side's one process reached its first optimizer step, and its CPU then is within the launch's
    assert all(len(ranks) == 1 for ranks in plain["after_first_step_cpu_s_per_rank"])
    assert 0 < plain["after_first_step_cpu_s_per_rank"][0][0] <= plain["after_cpu_s"][0] + 0.05
    assert set(report["floors"]) == {
        "import torch",
        "torch + one AdamW step",
        "torch + transformers, tiny-llama, one AdamW step",
    }
    tables = report["importtime_self_s_by_package"]
    assert "torch" in tables["before"] and "torch" in tables["after"] and "zerofit" in tables["after"]


def test_plan_speed_prints_the_plans_ratio_to_importing_torch_and_writes_json(ran: dict[str, Ran]) -> None:
    result, out = ran["plan_speed"].ok(), ran["plan_speed"].tmp / "plan_speed.json"
    assert "x the CPU time of import torch" in result.stdout
    report = json.loads(out.read_text())
    (row,) = report["configs"].values()
    assert row["plan_cpu_s"] > 0 and row["import_torch_cpu_s"] > 0 and row["ratio"] > 0
    assert report["worst"]["config"] == "configs/demo.yaml" and report["hub_kernel_message_in"] == []
