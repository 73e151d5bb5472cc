"""On-policy distillation (`train.objective: gkd`, the `gkd` section; GKD, Agarwal et al. 2024): the student
(the policy) learns a teacher's per-token distribution on completions that are, with probability
`gkd.lmbda` each, its own samples, else the data's `completion` (or the teacher's samples with `gkd.seq_kd`).

A unit is a completion, as GRPO's (`zerofit.objectives.grpo`: the prompts, the global batch of
rl.num_generations x rl.prompts_per_step completions, the sampling keys and the engines are its); there is no
reward and no advantage: the loss is the generalized JSD to the teacher over every completion token
(`zerofit.objectives.gkd.loss`), the rollouts `zerofit.loop.distill`, the teacher `zerofit.recipe.teacher`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from zerofit.objectives.grpo import GRPOSpec, completions_per_step, engine_problem
from zerofit.objectives.rules import refuse_reference, refuse_unpaired_format

if TYPE_CHECKING:
    from zerofit.config.schema import ZerofitConfig
    from zerofit.objectives.protocol import Objective

__all__ = ["GKD", "divergence_name"]


def divergence_name(beta: float) -> str:
    """What `gkd.beta` makes the loss: forward KL at 0, reverse KL at 1, the generalized JSD between."""
    return {0.0: "forward KL", 1.0: "reverse KL"}.get(beta, f"generalized JSD (beta {beta:g})")


def _gkd_problems(cfg: ZerofitConfig) -> list[str]:
    """The `gkd` and `rl` keys against the rest: a teacher, one update per rollout, no rewards, no GRPO
    KL, no packing, no evaluation data, no sequence parallelism, prompts as data."""
    rl, g = cfg.rl, cfg.gkd
    rules = [
        (g.teacher is None, "gkd.teacher is unset: on-policy distillation needs a teacher, a model zerofit can "
         "load that shares the student's tokenizer (a built-in, a hub id, a folder, a zerofit run or export); "
         "set gkd.teacher=<model or folder>"),
        (rl.num_iterations != 1, f"rl.num_iterations = {rl.num_iterations} with train.objective = 'gkd', which "
         "takes one update per rollout; set rl.num_iterations=1"),
        (bool(rl.rewards), "rl.rewards is set with train.objective = 'gkd', whose signal is the teacher, not a "
         "reward, so they would be ignored; unset rl.rewards (or set train.objective=grpo)"),
        (rl.beta != 0, f"rl.beta = {rl.beta} is GRPO's KL to a reference; with train.objective = 'gkd' the "
         "divergence to the teacher is gkd.beta's; set rl.beta=0"),
        (rl.generation_backend == "vllm", "rl.generation_backend = 'vllm' needs vLLM on CUDA, which zerofit "
         "does not drive yet; set rl.generation_backend=transformers (the student's own sampling)"),
        (cfg.batch.tokens_per_micro_batch is not None, "batch.tokens_per_micro_batch packs rows, and GKD's "
         "micro-batch is completions; unset batch.tokens_per_micro_batch"),
        (cfg.data.eval_path is not None or cfg.data.eval_split is not None, "data.eval_path / data.eval_split "
         "with train.objective = 'gkd': held-out divergences are not evaluated during the run yet; unset them"),
        (cfg.distributed.sequence_parallel > 1, "distributed.sequence_parallel > 1 with train.objective = 'gkd': "
         "rollouts are not sharded over the sequence; set distributed.sequence_parallel=1"),
        (cfg.data.format not in ("auto", "prompt"), f"data.format = {cfg.data.format!r} with train.objective = "
         "'gkd', which reads prompts ({prompt: ..., completion: ...}); set data.format=auto (or prompt)"),
    ]  # fmt: skip
    return [text for broken, text in rules if broken]


class GKDSpec(GRPOSpec):
    """On-policy distillation (module docstring): GRPO's unit, data, sampling and plan shape, its own loss."""

    name = "gkd"
    rewarded = False  # no reward functions: the teacher is its signal (its rules refuse evaluation data)
    vision = False  # text prompts only: GRPO's image prompts are not sampled by the teacher

    def settle_batch(self, cfg: ZerofitConfig, problems: list[str]) -> None:
        """The global batch is rl.num_generations x rl.prompts_per_step completions, then the `gkd` rules."""
        b, rl, completions = cfg.batch, cfg.rl, completions_per_step(cfg)
        if b.global_batch_size is not None and b.global_batch_size != completions:
            problems.append(
                f"batch.global_batch_size = {b.global_batch_size} with train.objective = 'gkd', whose global "
                f"batch is rl.num_generations x rl.prompts_per_step = {rl.num_generations} x "
                f"{rl.prompts_per_step} = {completions} completions; unset batch.global_batch_size (it is set to "
                "that) or change the rl keys"
            )
        b.global_batch_size = completions
        problems.extend(_gkd_problems(cfg))
        engine = engine_problem(cfg)
        if engine is not None:
            problems.append(engine)

    def check(self, cfg: ZerofitConfig, problems: list[str]) -> None:
        """Not KTO's data, no preference reference, and the loss over the vocabulary needs the logits: chunked
        (the fused head never forms them), set so `auto` has nothing to choose."""
        refuse_unpaired_format(cfg, problems)
        refuse_reference(cfg, problems)
        t = cfg.train
        if t.cross_entropy not in ("chunked", "auto"):
            problems.append(
                f"train.cross_entropy = {t.cross_entropy!r} with train.objective = 'gkd': the divergence to the "
                "teacher is over the whole vocabulary, so both models' logits are formed, not a token's "
                "cross-entropy; unset train.cross_entropy (or set chunked)"
            )
        else:
            t.cross_entropy = "chunked"

    def build_loss(self, cfg: ZerofitConfig) -> Objective:
        """The divergence of `gkd.beta` (the run attaches the teacher: `zerofit.recipe.teacher`)."""
        from zerofit.objectives.gkd.loss import GKDObjective, GKDSettings

        return GKDObjective(GKDSettings(beta=cfg.gkd.beta))

    def updates_per_rollout(self, cfg: ZerofitConfig) -> int:
        """One update per rollout."""
        return 1

    def describe(self, cfg: ZerofitConfig, reference: str) -> str | None:
        """The divergence, the teacher, the on-policy fraction and the batch in prompts and completions."""
        rl, g, n = cfg.rl, cfg.gkd, completions_per_step(cfg)
        off = "the teacher's samples (seq_kd)" if g.seq_kd else "the data's completion"
        quantized = f", loaded {g.teacher_load_in}" if g.teacher_load_in != "none" else ""
        return (
            f"gkd ({divergence_name(g.beta)} to teacher {g.teacher}{quantized}, no gradients): "
            f"{rl.prompts_per_step} prompts x {rl.num_generations} = {n} completions per step, <= "
            f"{rl.max_prompt_length} + {rl.max_completion_length} tokens each; each completion is the student's "
            f"sample with probability lmbda {g.lmbda:g} (temperature {rl.temperature:g}, top_p {rl.top_p:g}, "
            f"top_k {rl.top_k}), else {off}; loss over the global batch's completion tokens"
        )

    def planned_reference(self, cfg: ZerofitConfig) -> str:
        """No reference pass (the teacher is counted on its own: `teacher_model`)."""
        return "none"

    def no_grad_forwards(self, reference: str) -> int:
        """None of the policy's own (the teacher's forward is another model's)."""
        return 0

    def teacher_model(self, cfg: ZerofitConfig) -> str | None:
        """The teacher the run loads beside the policy."""
        return cfg.gkd.teacher

    def planned_line(self, memory: dict[str, Any]) -> str | None:
        phases = ", ".join(f"{k} {v:.2f}" for k, v in memory["phases_gib"].items())
        return (
            f"Planned for train.objective gkd: {memory['micro_batch_size']} completions per micro-batch, each "
            f"{memory['seq_len']} tokens (prompt + completion), and the teacher; tensors per phase (GiB): {phases}"
        )


GKD = GKDSpec()
