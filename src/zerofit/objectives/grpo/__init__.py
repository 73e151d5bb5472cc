"""GRPO and its variants (`train.objective: grpo`, the `rl` section): online RL on prompts, the completions
sampled by the policy inside the run and scored by reward functions.

A unit is a completion: the global batch is rl.num_generations x rl.prompts_per_step of them (set by the rl
keys, split micro x accumulation x dp as any global batch); the data is prompts (data.format prompt or
auto); a loop step takes rl.num_iterations optimizer updates on its rollout. Held-out prompts (data.eval_path
or data.eval_split) are answered by the policy at each evaluation and scored by the same rewards
(`eval/reward`, which the best checkpoint and early stopping follow; `eval.sampling` says how). The loss is
`zerofit.objectives.grpo.loss.GRPOObjective`, the reward functions `zerofit.objectives.grpo.rewards` (built
from the config at launch by `zerofit.recipe.rewards`), the rollouts `zerofit.loop.rollout`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from zerofit.config.rules.engine import preset_zero_stage
from zerofit.objectives.rules import refuse_reference, refuse_unpaired_format
from zerofit.objectives.spec import PROMPT, ObjectiveSpec

if TYPE_CHECKING:
    from zerofit.config.schema import RewardSpec, RLSection, ZerofitConfig
    from zerofit.objectives.protocol import Objective

__all__ = [
    "ENVIRONMENT_REWARD",
    "GRPO",
    "MIN_TURN_TOKENS",
    "GRPOSpec",
    "completions_per_step",
    "describe_environment_reward",
    "describe_reward",
    "describe_rewards",
    "engine_problem",
    "unread_keys",
]

MIN_TURN_TOKENS = 8  # the fewest tokens of rl.max_completion_length a multi-turn trajectory gets per turn
ENVIRONMENT_REWARD = "environment"  # the reward an `rl.environment` gives, summed into the total


def describe_reward(spec: RewardSpec) -> str:
    """How `zerofit plan` names a reward: `exact_match (column answer) x 1.0`, or for the user's own function
    `my_rewards:correct (imported at launch from module my_rewards) x 0.5`; nothing is imported."""
    detail = {
        "exact_match": f"column {spec.column}",
        "format_regex": f"pattern {spec.pattern}",
        "length": f"target {spec.target_length} tokens",
        "reward_model": f"model folder {spec.path}",
    }.get(spec.function)
    if detail is None:
        detail = f"imported at launch from module {spec.function.split(':')[0]}"
    return f"{spec.function} ({detail}) x {spec.weight:g}"


def describe_environment_reward(environment: str) -> str:
    """How the plan names the reward an `rl.environment` gives: what its `step` returns, summed over a
    trajectory's turns and added to the weighted reward functions (weight 1); nothing is imported."""
    return (
        f"{ENVIRONMENT_REWARD} (what {environment}'s step returns, summed over the trajectory's turns; "
        "imported at launch) x 1"
    )


def describe_rewards(rl: RLSection) -> str:
    """The plan's rewards of a run: each reward function, then an environment's own reward."""
    named = [describe_reward(spec) for spec in rl.rewards]
    if rl.environment is not None:
        named.append(describe_environment_reward(rl.environment))
    return "; ".join(named)


def completions_per_step(cfg: ZerofitConfig) -> int:
    """GRPO's global batch: rl.num_generations x rl.prompts_per_step completions."""
    return cfg.rl.num_generations * cfg.rl.prompts_per_step


def engine_problem(cfg: ZerofitConfig) -> str | None:
    """Why the rollouts cannot run on this engine, or None: sampling runs one forward per token, and under
    ZeRO-3 each would gather every layer again (FSDP2's layers are gathered once per rollout instead,
    `zerofit.loop.rollout.generating`)."""
    if preset_zero_stage(cfg) == 3:
        return (
            f"train.objective = {cfg.train.objective!r} generates its completions inside the run, and "
            f"distributed.preset = {cfg.distributed.preset!r} is ZeRO-3, which shards the parameters over the ranks, so each generated "
            "token would gather every layer again (zerofit does not gather them once per rollout there yet); use "
            "distributed.strategy=ddp, deepspeed with preset zero2, fsdp (its layers are gathered once per "
            "rollout), or single"
        )
    return None


def _rl_problems(cfg: ZerofitConfig, name: str) -> list[str]:
    """The `rl` section against the rest: a reward, a backend that runs here, no packing, no sequence
    parallelism, beta > 0 only with adapters to switch off, temperature only with logits."""
    rl, b = cfg.rl, cfg.batch
    rules = [
        (not rl.rewards and rl.environment is None, "rl.rewards is empty: GRPO needs at least one reward "
         "function (or an rl.environment), e.g. rl.rewards=[{function: exact_match, column: answer}]"),
        (rl.generation_backend == "vllm", "rl.generation_backend = 'vllm' needs vLLM on CUDA, which zerofit "
         "does not drive yet; set rl.generation_backend=transformers (the policy's own sampling)"),
        (b.tokens_per_micro_batch is not None, "batch.tokens_per_micro_batch packs rows, and GRPO's micro-batch "
         "is completions (batch.micro_batch_size completions each); unset batch.tokens_per_micro_batch"),
        (cfg.distributed.sequence_parallel > 1, f"distributed.sequence_parallel > 1 with train.objective = "
         f"{name!r}: rollouts are not sharded over the sequence; set distributed.sequence_parallel=1"),
        (rl.beta > 0 and not cfg.lora.enabled, f"rl.beta = {rl.beta} needs the reference, the base with the LoRA "
         "adapters switched off, and lora.enabled = false leaves none; set lora.enabled=true or rl.beta=0"),
        (rl.temperature != 1.0 and cfg.train.cross_entropy == "fused_linear", f"rl.temperature = "
         f"{rl.temperature} scales the logits, which train.cross_entropy = 'fused_linear' never forms; set "
         "train.cross_entropy=chunked or rl.temperature=1.0"),
        (cfg.data.format not in ("auto", "prompt"), f"data.format = {cfg.data.format!r} with train.objective = "
         f"{name!r}, which reads prompts ({{prompt: ..., other columns}}); set data.format=auto (or prompt)"),
    ]  # fmt: skip
    return [text for broken, text in rules if broken]


def unread_keys(cfg: ZerofitConfig, name: str, keys: tuple[str, ...], reason: str) -> list[str]:
    """A paragraph for each of the `rl` keys `keys` set away from its default, which train.objective `name`
    does not read (`reason` says why and what to use instead)."""
    from zerofit.config.schema import RLSection

    return [
        f"rl.{key} = {getattr(cfg.rl, key)!r} with train.objective = {name!r}, which does not read it "
        f"({reason}); unset rl.{key}"
        for key in keys
        if getattr(cfg.rl, key) != RLSection.model_fields[key].default
    ]


def _describe_agent(cfg: ZerofitConfig) -> str:
    """The plan's words for a multi-turn run (nothing is imported): its tools and environment, the turn
    limit, and the trajectory's token budget, which the memory plan counts (prompt + max_completion_length
    per trajectory: sampled turns, template and tool tokens together, in the KV cache and the training row)."""
    rl = cfg.rl
    if not rl.tools and rl.environment is None:
        return ""
    tools = ", ".join(t.function for t in rl.tools) or "none"
    env = f"; environment {rl.environment} (imported at launch)" if rl.environment else ""
    return (
        f"; multi-turn: tools {tools}{env}; <= {rl.max_turns} assistant turns per trajectory, all of its "
        f"tokens after the prompt (sampled turns, template and tool replies; only the sampled ones trained) "
        f"within rl.max_completion_length {rl.max_completion_length}, so the KV cache and each training row "
        f"are planned at {rl.max_prompt_length} + {rl.max_completion_length} tokens (the prompt includes the "
        "tools' schemas; tool calls time out after "
        f"{rl.tool_timeout_s:g} s)"
    )


def _agent_problems(cfg: ZerofitConfig) -> list[str]:
    """A multi-turn budget that cannot hold its turns: every turn samples at least one token and every reply
    takes a few, so rl.max_completion_length must leave at least `MIN_TURN_TOKENS` per turn."""
    rl = cfg.rl
    if (rl.tools or rl.environment) and rl.max_completion_length < MIN_TURN_TOKENS * rl.max_turns:
        return [
            f"rl.max_turns = {rl.max_turns} with rl.max_completion_length = {rl.max_completion_length}: a "
            f"trajectory's turns, tool calls and replies share that budget, which leaves under "
            f"{MIN_TURN_TOKENS} tokens per turn; raise rl.max_completion_length to at least "
            f"{MIN_TURN_TOKENS * rl.max_turns} or lower rl.max_turns"
        ]
    return []


class GRPOSpec(ObjectiveSpec):
    """GRPO (module docstring)."""

    name = "grpo"
    unit = PROMPT
    generates = True
    unread: tuple[str, ...] = ("normalize_advantages",)  # rl keys refused away from their defaults
    unread_reason = "it normalizes RLOO's advantages; GRPO's are scaled by rl.scale_rewards"
    rewarded = True  # held-out prompts are evaluated by their completions' reward (`zerofit.loop.held_out`)
    vision = True  # image prompts on the Qwen2-VL family (`zerofit.data.vision_prompts`)

    def settle_batch(self, cfg: ZerofitConfig, problems: list[str]) -> None:
        """The global batch is rl.num_generations x rl.prompts_per_step completions (batch.global_batch_size
        is that or unset, and is set to it), then the `rl` section's rules and the engine's."""
        b, rl, completions = cfg.batch, cfg.rl, completions_per_step(cfg)
        if b.global_batch_size is not None and b.global_batch_size != completions:
            problems.append(
                f"batch.global_batch_size = {b.global_batch_size} with train.objective = {self.name!r}, whose global "
                f"batch is rl.num_generations x rl.prompts_per_step = {rl.num_generations} x "
                f"{rl.prompts_per_step} = {completions} completions; unset batch.global_batch_size (it is set to "
                "that) or change the rl keys"
            )
        b.global_batch_size = completions
        problems.extend(_rl_problems(cfg, self.name))
        problems.extend(_agent_problems(cfg))
        engine = engine_problem(cfg)
        if engine is not None:
            problems.append(engine)

    def batch_problem(self, cfg: ZerofitConfig, error: str) -> str | None:
        """The split error in completions, set by the rl keys."""
        rl = cfg.rl
        return (
            f"batch: train.objective = {self.name!r} trains on rl.num_generations x rl.prompts_per_step = "
            f"{rl.num_generations} x {rl.prompts_per_step} completions per step (the global batch), split into "
            f"micro-batches of batch.micro_batch_size completions over the ranks: {error} (or change "
            "rl.num_generations / rl.prompts_per_step)"
        )

    def check(self, cfg: ZerofitConfig, problems: list[str]) -> None:
        """Not KTO's unpaired feedback (the prompts' own format: `settle_batch`); no preference reference; none
        of the `rl` keys this objective does not read (`unread`)."""
        refuse_unpaired_format(cfg, problems)
        refuse_reference(cfg, problems)
        problems.extend(unread_keys(cfg, self.name, self.unread, self.unread_reason))

    def build_loss(self, cfg: ZerofitConfig) -> Objective:
        """The `rl` section's loss (`zerofit.objectives.grpo.loss`)."""
        from zerofit.objectives.grpo.loss import GRPOObjective, GRPOSettings

        rl = cfg.rl
        settings = GRPOSettings(
            loss_type=rl.loss_type,
            beta=rl.beta,
            epsilon=rl.epsilon,
            epsilon_high=rl.epsilon_high,
            max_completion_length=rl.max_completion_length,
            temperature=rl.temperature,
            use_bias_correction_kl=rl.use_bias_correction_kl,
            importance_sampling_level=rl.importance_sampling_level,
        )
        return GRPOObjective(settings)

    def advantage_estimator(self, cfg: ZerofitConfig) -> Callable[[Any, int], Any]:
        """TRL's group normalization per rl.scale_rewards (`zerofit.objectives.grpo.loss.group_advantages`)."""
        from zerofit.objectives.grpo.loss import group_advantages

        return functools.partial(group_advantages, scale=cfg.rl.scale_rewards)

    def updates_per_rollout(self, cfg: ZerofitConfig) -> int:
        """rl.num_iterations optimizer updates on each rollout."""
        return cfg.rl.num_iterations

    def tokens_per_step(self, cfg: ZerofitConfig) -> str | None:
        """`16 completions x (<= 256 prompt + <= 6 completion tokens) = <= 4,192 tokens, <= 96 of them trained`."""
        rl, n = cfg.rl, completions_per_step(cfg)
        whole = n * (rl.max_prompt_length + rl.max_completion_length)
        return (
            f"{n} completions x (<= {rl.max_prompt_length} prompt + <= {rl.max_completion_length} completion "
            f"tokens) = <= {whole:,} tokens, <= {n * rl.max_completion_length:,} of them trained"
        )

    def describe(self, cfg: ZerofitConfig, reference: str) -> str | None:
        """The loss, the global batch in prompts, completions and tokens, the updates per rollout and every
        reward function (a `module:function` is named, not imported)."""
        rl, n = cfg.rl, completions_per_step(cfg)
        normalizer = {
            "grpo": "each completion's token mean, averaged over the global batch's completions",
            "dapo": "the global batch's completion tokens",
            "dr_grpo": f"{n} completions x rl.max_completion_length {rl.max_completion_length}",
        }[rl.loss_type]
        high = rl.epsilon if rl.epsilon_high is None else rl.epsilon_high
        ref = "the base with the LoRA adapters off" if rl.beta > 0 else "none (beta 0)"
        if rl.beta > 0:
            ref += (
                ", k3 x the ratio (bias-corrected)" if rl.use_bias_correction_kl else ", k3 (original GRPO)"
            )
        level = {"token": "", "sequence": ", GSPO", "sequence_token": ", GSPO-token"}[
            rl.importance_sampling_level
        ]
        return (
            f"grpo ({rl.loss_type}{level}, beta {rl.beta:g}, clip [1 - {rl.epsilon:g}, 1 + {high:g}], advantages / std of "
            f"the {rl.scale_rewards}): {rl.prompts_per_step} prompts x G {rl.num_generations} = {n} completions per "
            f"step, <= {rl.max_prompt_length} + {rl.max_completion_length} tokens each (<= "
            f"{n * rl.max_completion_length:,} completion tokens), sampled by the policy (temperature "
            f"{rl.temperature:g}, top_p {rl.top_p:g}, top_k {rl.top_k}); {rl.num_iterations} update(s) per rollout; "
            f"loss over {normalizer}; reference: {ref}; rewards: {describe_rewards(rl)}"
            + _describe_agent(cfg)
        )

    def planned_reference(self, cfg: ZerofitConfig) -> str:
        """The base with the adapters off when rl.beta > 0, else none."""
        return "adapters_off" if cfg.rl.beta > 0 else "none"

    def max_tokens_per_unit(self, cfg: ZerofitConfig) -> tuple[int, str]:
        """A completion's training sequence: its prompt and itself."""
        rl = cfg.rl
        return (
            rl.max_prompt_length + rl.max_completion_length,
            "rl.max_prompt_length + rl.max_completion_length",
        )

    def planned_line(self, memory: dict[str, Any]) -> str | None:
        phases = ", ".join(f"{k} {v:.2f}" for k, v in memory["phases_gib"].items())
        return (
            f"Planned for train.objective {self.name}: {memory['micro_batch_size']} completions per micro-batch, each "
            f"{memory['seq_len']} tokens (prompt + completion); tensors per phase (GiB): {phases}"
        )

    def synthetic_batch(
        self, micro: int, seq: int, vocab: int, pad_id: int, cfg: ZerofitConfig
    ) -> dict[str, Any]:
        """`zerofit.loop.rollout.micro_batch`'s layout: `micro` completions of `seq` tokens, the prompt's
        positions unlabelled, positions from the mask, an advantage each, and the old policy's log-probs
        with rl.num_iterations > 1."""
        import torch

        from zerofit.objectives.synthetic import token_rows
        from zerofit.token_loss.sums import IGNORE_INDEX

        batch = token_rows(micro, seq, vocab, pad_id)
        prompt = min(cfg.rl.max_prompt_length, seq - 1)
        batch["labels"][:, :prompt] = IGNORE_INDEX
        batch["position_ids"] = (batch["attention_mask"].cumsum(dim=1) - 1).clamp(min=0)
        batch["advantages"] = torch.linspace(-1.0, 1.0, micro)
        if cfg.rl.num_iterations > 1:
            batch["old_logps"] = torch.zeros(micro, seq)
        return batch


GRPO = GRPOSpec()
