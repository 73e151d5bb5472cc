"""train_step in one process: token-sum loss, one normalizer per window, one clip and step per window."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from config_helpers import one_process_strategy
from zerofit.data import IGNORE_INDEX, Example, collate
from zerofit.loop.train import LoopInputs, StepResult, train_loop, train_step
from zerofit.strategies.single import SingleStrategy
from zerofit.token_loss.sums import count_label_tokens, token_sum_loss

VOCAB = 11


class TinyLM(torch.nn.Module):
    """Embedding + linear head: enough for a next-token loss whose gradient depends on every token."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(VOCAB, 8)
        self.head = torch.nn.Linear(8, VOCAB)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, use_cache: bool = False) -> Any:
        del attention_mask, use_cache

        class Out:
            logits = self.head(self.embed(input_ids))

        return Out()


def _examples() -> list[Example]:
    # Lengths 2..16 with prompt masks of different sizes: token counts differ a lot per micro-batch.
    out = []
    for i in range(8):
        n = 2 + (i * 5) % 15
        ids = [(i + j) % (VOCAB - 1) + 1 for j in range(n)]
        labels = [IGNORE_INDEX] * (1 + i % 3) + ids[1 + i % 3 :]
        out.append(Example(ids, labels[:n]))
    return out


def _strategy(model: torch.nn.Module, lr: float = 0.1) -> SingleStrategy:
    strategy = one_process_strategy()
    strategy.prepare(
        model,
        lambda m: torch.optim.SGD(m.parameters(), lr=lr),
        lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0),
    )
    return strategy


def _split(examples: list[Example], micro: int) -> list[dict[str, torch.Tensor]]:
    return [collate(examples[k : k + micro], pad_id=0) for k in range(0, len(examples), micro)]


def test_token_sum_loss_is_sum_of_valid_next_token_losses() -> None:
    logits = torch.randn(2, 5, VOCAB)
    labels = torch.tensor(
        [[IGNORE_INDEX, 3, 4, IGNORE_INDEX, IGNORE_INDEX], [IGNORE_INDEX, IGNORE_INDEX, 1, 2, 5]]
    )
    loss_sum = token_sum_loss(logits, labels)
    assert count_label_tokens(labels) == 5
    mean = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1), ignore_index=IGNORE_INDEX
    )
    assert float(loss_sum) == pytest.approx(float(mean) * 5, rel=1e-6)


def test_an_all_masked_batch_gives_zero_with_a_graph() -> None:
    logits = torch.randn(1, 3, VOCAB, requires_grad=True)
    labels = torch.full((1, 3), IGNORE_INDEX)
    loss_sum = token_sum_loss(logits, labels)
    assert count_label_tokens(labels) == 0 and float(loss_sum.detach()) == 0.0
    loss_sum.backward()  # the dummy row of an empty micro-batch still runs backward
    assert logits.grad is not None and float(logits.grad.abs().sum()) == 0.0


def test_the_split_does_not_change_loss_or_update() -> None:
    examples = _examples()
    results, params = [], []
    for micro in (8, 2, 1):
        model = TinyLM()
        result = train_step(_strategy(model), model, _split(examples, micro), max_grad_norm=None)
        results.append(result)
        params.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    for result, p in zip(results[1:], params[1:], strict=True):
        assert result.tokens == results[0].tokens
        assert result.loss == pytest.approx(results[0].loss, abs=1e-6)
        assert result.grad_norm == pytest.approx(results[0].grad_norm, rel=1e-5)
        assert float((p - params[0]).abs().max()) < 1e-6


def test_clip_and_step_run_once_per_window_after_the_last_micro_step() -> None:
    model = TinyLM()
    strategy = _strategy(model)
    calls: list[tuple[str, Any]] = []
    backward, clip_and_step = strategy.backward, strategy.clip_and_step
    strategy.backward = lambda loss: (calls.append(("backward", None)), backward(loss))[1]  # type: ignore[method-assign]
    strategy.clip_and_step = lambda m: (calls.append(("step", m)), clip_and_step(m))[1]  # type: ignore[method-assign]
    result = train_step(strategy, model, _split(_examples(), 2), max_grad_norm=1e-3)
    assert [c[0] for c in calls] == ["backward"] * 4 + ["step"]
    assert result.grad_norm > 1e-3  # the reported norm is the one before clipping


def test_empty_micro_batches_add_no_tokens() -> None:
    examples = _examples()[:3]
    full = train_step(_strategy(m := TinyLM()), m, [collate(examples, 0)], None)
    short = [collate(examples[:2], 0), collate(examples[2:], 0), collate([], 0), collate([], 0)]
    partial = train_step(_strategy(m2 := TinyLM()), m2, short, None)
    assert partial.tokens == full.tokens
    assert partial.loss == pytest.approx(full.loss, abs=1e-6)


class _Sink:
    def __init__(self) -> None:
        self.rows: list[tuple[int, dict[str, Any]]] = []

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.rows.append((step, metrics))

    def log_config(self, config: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class _Checkpoints:
    def __init__(self) -> None:
        self.steps: list[int] = []
        self.stopping: list[int] = []
        self.tokens_seen: list[int | None] = []

    def after_step(self, steps_done: int, stopping: bool = False, tokens_seen: int | None = None) -> None:
        self.steps.append(steps_done)
        self.tokens_seen.append(tokens_seen)
        if stopping:
            self.stopping.append(steps_done)


def _loop_run(sink: _Sink, checkpoints: _Checkpoints, max_steps: int, **options: Any) -> LoopInputs:
    """A one-process LoopInputs over the test examples: global 4 = micro 2 x accum 2."""
    from zerofit.config.batching import solve_batch
    from zerofit.data import GlobalBatchSampler

    examples = _examples()
    model = TinyLM()
    return LoopInputs(
        strategy=_strategy(model),
        model=model,
        examples=examples,
        sampler=GlobalBatchSampler(len(examples), 4, seed=0),
        batch=solve_batch(1, 4, 2),
        max_steps=max_steps,
        pad_id=0,
        sink=sink,
        checkpointer=checkpoints,
        **options,
    )


def test_train_loop_logs_each_optimizer_step_from_a_start_step() -> None:
    sink, checkpoints = _Sink(), _Checkpoints()
    results = train_loop(_loop_run(sink, checkpoints, max_steps=4, max_grad_norm=1.0), start_step=1)
    assert len(results) == 3 and all(isinstance(r, StepResult) for r in results)
    assert [step for step, _ in sink.rows] == [2, 3, 4] == checkpoints.steps
    row = sink.rows[0][1]
    assert (row["micro_batch_size"], row["grad_accum_steps"], row["dp_size"], row["epoch"]) == (2, 2, 1, 0)
    assert row["mem/source"] in ("cpu_rss", "cuda") and "mem/rank0/peak_gib" in row


def test_a_stop_request_ends_the_loop_after_the_step_in_progress_with_a_checkpoint() -> None:
    import signal

    from zerofit.loop.signals import StopSignal

    stop = StopSignal()
    stop.arm("test")

    class _SignalAtStep2(_Sink):
        def log(self, step: int, metrics: dict[str, Any]) -> None:
            super().log(step, metrics)
            if step == 2:  # as if SIGTERM arrived while step 2 was running
                stop.signum = signal.SIGTERM

    sink, checkpoints = _SignalAtStep2(), _Checkpoints()
    results = train_loop(_loop_run(sink, checkpoints, max_steps=5, max_grad_norm=1.0, stop=stop))
    assert len(results) == 2 and checkpoints.steps == [1, 2] and checkpoints.stopping == [2]
    assert stop.agreed == signal.SIGTERM and StopSignal.exit_code(stop.agreed) == 143


def test_a_stop_between_logging_steps_logs_the_last_step_too() -> None:
    """logging.log_every=3, a signal during step 2: the rows end at the step the run stopped after (the
    end-of-run summary's step count, the stop checkpoint's step), not at the last logging step."""
    import signal

    from zerofit.loop.signals import StopSignal

    stop = StopSignal()
    stop.arm("test")

    class _SignalAtStep2(_Checkpoints):
        def after_step(self, steps_done: int, stopping: bool = False, tokens_seen: int | None = None) -> None:
            super().after_step(steps_done, stopping, tokens_seen)
            if steps_done == 1:  # as if SIGTERM arrived while step 2 was running
                stop.signum = signal.SIGTERM

    sink, checkpoints = _Sink(), _SignalAtStep2()
    run = _loop_run(sink, checkpoints, max_steps=9, max_grad_norm=1.0, stop=stop, log_every=3)
    assert len(train_loop(run)) == 2 and checkpoints.stopping == [2]
    assert [step for step, _ in sink.rows] == [2] and "mem/rank0/peak_gib" in sink.rows[0][1]


def test_mfu_is_logged_from_input_tokens_where_the_device_peak_is_known(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from zerofit.metrics import throughput

    # A CPU has no catalogued peak; pretend this one does 1 TFLOP/s so the wiring can be checked.
    monkeypatch.setattr(throughput, "device_peak_tflops", lambda device, precision="bf16": 1.0)
    sink = _Sink()
    run = _loop_run(sink, _Checkpoints(), max_steps=1, max_grad_norm=None, flops_per_token=1e6)
    (result,) = train_loop(run)
    row = sink.rows[0][1]
    # Input tokens include the prompt (masked from the loss), so MFU counts more tokens than the loss does.
    assert result.input_tokens > result.tokens > 0
    assert row["mfu"] == pytest.approx(result.input_tokens / row["step_time_s"] * 1e6 / 1e12)


def test_every_logged_field_is_a_documented_contract() -> None:
    """docs/contracts.md lists every field the loop writes to metrics.jsonl (rank fields as `rank{r}`)."""
    import re
    from pathlib import Path

    contracts = (Path(__file__).resolve().parents[3] / "docs" / "contracts.md").read_text()
    sink = _Sink()
    train_loop(_loop_run(sink, _Checkpoints(), max_steps=1, max_grad_norm=1.0))
    fields = {"step", *sink.rows[0][1]}
    rank_field = re.compile(r"rank\d+")
    undocumented = {f for f in fields if "`" + rank_field.sub("rank{r}", f) + "`" not in contracts}
    # Memory fields beyond the per-rank contract fields are telemetry (zerofit.metrics.memory), not contract.
    contract_memory = re.compile(r"^mem/rank\d+/(allocated|reserved|peak)_gib$")
    undocumented = {f for f in undocumented if not f.startswith("mem/") or contract_memory.match(f)}
    assert not undocumented, f"metrics.jsonl fields missing from docs/contracts.md: {sorted(undocumented)}"


def test_every_row_counts_the_tokens_of_every_step_under_log_every_and_on_from_a_resume() -> None:
    """logging.log_every=3 logs steps 3, 6 and 7 only; each row's `tokens_seen` is the label tokens of all
    steps so far (the unlogged ones too), the checkpointer gets the same count after every step, and a loop
    resumed at step 4 with the count its checkpoint recorded logs the uninterrupted run's values."""
    sink, checkpoints = _Sink(), _Checkpoints()
    results = train_loop(_loop_run(sink, checkpoints, max_steps=7, max_grad_norm=1.0, log_every=3))
    running = [sum(r.tokens for r in results[:n]) for n in range(1, 8)]
    assert len(set(r.tokens for r in results)) > 1  # steps differ, so a sum over logged rows would not do
    assert [(step, row["tokens_seen"]) for step, row in sink.rows] == [(s, running[s - 1]) for s in (3, 6, 7)]
    assert checkpoints.tokens_seen == running
    resumed_sink = _Sink()
    train_loop(
        _loop_run(resumed_sink, _Checkpoints(), max_steps=7, max_grad_norm=1.0, log_every=3),
        start_step=4,
        tokens_before=running[3],
    )
    assert [(s, row["tokens_seen"]) for s, row in resumed_sink.rows] == [(6, running[5]), (7, running[6])]


# --- what a step costs besides the model: kept off the hot path ---------------------------------------------


def _count_value_reads(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Count every read of a floating-point or boolean tensor's value into Python (`item`, `tolist`,
    `float`, `int`, `bool`): on a GPU each is a host sync, a wait for every queued kernel. Integer tensors
    are left out: the token counts are built from the host's collated batches."""
    reads = [0]
    for name in ("item", "tolist", "__float__", "__int__", "__bool__"):
        real = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *args: Any, _real: Any = real, **kwargs: Any) -> Any:
            if self.is_floating_point() or self.dtype == torch.bool:
                reads[0] += 1
            return _real(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, counted)
    return reads


class _ReadsPerStep(_Checkpoints):
    """Records the value reads of each step (the checkpointer is called once at the end of every step)."""

    def __init__(self, reads: list[int]) -> None:
        super().__init__()
        self.reads, self.per_step, self.before = reads, [], 0

    def after_step(self, steps_done: int, stopping: bool = False, tokens_seen: int | None = None) -> None:
        super().after_step(steps_done, stopping, tokens_seen)
        self.per_step.append(self.reads[0] - self.before)
        self.before = self.reads[0]


@pytest.mark.parametrize("micro", [1, 4])
def test_a_step_reads_device_values_three_times_whatever_the_accumulation(
    monkeypatch: pytest.MonkeyPatch, micro: int
) -> None:
    """Global batch 4 as 4 micro-steps or 1: the loss sums stay on the device through the window, so a
    step reads values three times (the gradient norm, the window's loss sums, the weights' finiteness),
    never once per micro-batch, and the metrics, memory and agreement add no read."""
    from zerofit.config.batching import solve_batch

    checkpoints = _ReadsPerStep(_count_value_reads(monkeypatch))
    run = _loop_run(_Sink(), checkpoints, max_steps=3, max_grad_norm=1.0)
    run.batch = solve_batch(1, 4, micro)
    train_loop(run)
    assert checkpoints.per_step == [3, 3, 3]


def test_the_loop_finds_the_trainable_weights_once_not_at_every_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """The finiteness check after each step uses the trainable parameters found when the loop starts:
    walking a peft model's modules for them cost more than the check itself. (The strategy's own walk in
    its clip is the strategy's business and is not counted.)"""
    run = _loop_run(_Sink(), _Checkpoints(), max_steps=4, max_grad_norm=1.0)
    walks, in_strategy = [0], [False]
    real_parameters, real_clip = TinyLM.parameters, run.strategy.clip_and_step

    def parameters(self: torch.nn.Module, recurse: bool = True) -> Any:
        walks[0] += not in_strategy[0]
        return real_parameters(self, recurse)

    def clip_and_step(max_grad_norm: float | None) -> float:
        in_strategy[0] = True
        try:
            return real_clip(max_grad_norm)
        finally:
            in_strategy[0] = False

    monkeypatch.setattr(TinyLM, "parameters", parameters)
    monkeypatch.setattr(run.strategy, "clip_and_step", clip_and_step)
    assert len(train_loop(run)) == 4
    assert walks[0] == 1


def test_memory_is_read_once_per_logged_step(monkeypatch: pytest.MonkeyPatch) -> None:
    """logging.log_every=2 over 5 steps logs steps 2, 4 and 5: one memory snapshot each, none in between."""
    from zerofit.loop import train as loop_train

    snapshots: list[int] = []
    real = loop_train.memory_snapshot
    monkeypatch.setattr(loop_train, "memory_snapshot", lambda device: (snapshots.append(1), real(device))[1])
    sink = _Sink()
    train_loop(_loop_run(sink, _Checkpoints(), max_steps=5, max_grad_norm=1.0, log_every=2))
    assert [step for step, _ in sink.rows] == [2, 4, 5] and len(snapshots) == 3


def _ops_of(fn: Any, *args: Any) -> tuple[Any, int]:
    """`fn(*args)` and the number of torch ops it dispatched."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Counting(TorchDispatchMode):
        ops = 0

        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            Counting.ops += 1
            return func(*args, **(kwargs or {}))

    with Counting():
        out = fn(*args)
    return out, Counting.ops


def test_the_weights_check_costs_a_few_ops_however_many_tensors_train() -> None:
    """The finiteness check after every step is a handful of ops for 2 trainable tensors or 40 (one
    foreach op, not two ops per tensor), and still finds a NaN, +inf or -inf in any of them, in fp32, bf16
    and fp16; finite weights whose 2-norm would overflow fp32 are finite. The norms it falls back to on
    other devices find the same, an overflowing norm confirmed element by element."""
    from zerofit.loop.train import _finite_by_norms, weights_finite

    def weights(n: int, dtype: torch.dtype = torch.float32) -> list[torch.nn.Parameter]:
        return [torch.nn.Parameter(torch.randn(3, 4).to(dtype)) for _ in range(n)]

    few, many = weights(2), weights(40)
    (ok_few, ops_few), (ok_many, ops_many) = _ops_of(weights_finite, few), _ops_of(weights_finite, many)
    assert ok_few and ok_many and ops_few == ops_many <= 8
    for check in (weights_finite, _finite_by_norms):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            for bad in (float("nan"), float("inf"), -float("inf")):
                poisoned = weights(40, dtype)
                poisoned[17].data[1, 2] = bad
                assert not check(poisoned), (check, dtype, bad)
        huge = weights(3)
        huge[1].data.fill_(1e30)  # a 2-norm of 3.5e30**2: inf in fp32, every element finite
        assert check(huge)
    assert weights_finite([])


def test_the_weights_check_leaves_every_byte_of_the_weights_as_it_was() -> None:
    """The check writes each value back as it read it: negative zeros, subnormals (even with denormals
    flushed to zero) and the extremes of each dtype keep their bytes, and a graph that saved the weights
    still runs its backward afterwards."""
    from zerofit.loop.train import weights_finite

    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        info = torch.finfo(dtype)  # subnormals below `tiny`, the largest finite values
        special = [0.0, -0.0, info.tiny / 2, -info.tiny / 4, info.max, -info.max, 1.0, -2.5]
        weights = [
            torch.nn.Parameter(torch.tensor(special).to(dtype)),
            torch.nn.Parameter(torch.randn(5, 7).to(dtype)),
        ]
        before = [w.detach().clone().view(torch.uint8) for w in weights]
        torch.set_flush_denormal(True)
        try:
            assert weights_finite(weights)
        finally:
            torch.set_flush_denormal(False)
        assert all(torch.equal(b, w.detach().view(torch.uint8)) for b, w in zip(before, weights, strict=True))
    weight = torch.nn.Parameter(torch.randn(4))
    graph = (weight * weight).sum()
    assert weights_finite([weight])
    graph.backward()
    assert weight.grad is not None and torch.equal(weight.grad, 2 * weight.detach())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_twenty_steps_have_the_bits_of_the_norm_checked_loop(
    monkeypatch: pytest.MonkeyPatch, precision: str
) -> None:
    """20 steps of AdamW (fp32, and bf16 under autocast) with the loss scaler's check after each step give
    the losses, gradient norms and weight bytes (`==`) of the same steps checked by per-tensor norms."""
    from zerofit.config.batching import solve_batch
    from zerofit.data import GlobalBatchSampler
    from zerofit.loop import train as loop_train

    def run() -> tuple[list[tuple[float, float]], list[torch.Tensor]]:
        model = TinyLM()
        strategy = one_process_strategy(precision)
        strategy.prepare(
            model,
            lambda m: torch.optim.AdamW(m.parameters(), lr=0.05),
            lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s)),
        )
        examples = _examples()
        inputs = LoopInputs(
            strategy,
            model,
            examples,
            GlobalBatchSampler(len(examples), 4, seed=0),
            solve_batch(1, 4, 2),
            20,
            1.0,
            0,
            _Sink(),
            _Checkpoints(),
            precision=precision,
        )
        results = train_loop(inputs)
        return [(r.loss, r.grad_norm) for r in results], [p.detach().clone() for p in model.parameters()]

    losses, weights = run()
    monkeypatch.setattr(loop_train, "weights_finite", loop_train._finite_by_norms)
    norm_losses, norm_weights = run()
    assert len(losses) == 20 and losses == norm_losses
    assert all(
        torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        for a, b in zip(weights, norm_weights, strict=True)
    )


def test_one_process_without_autocast_enters_no_exit_stack() -> None:
    """A micro-step's context in one process is the sync context itself in fp32 (an exit stack around
    one context costs more than the context); bf16 still autocasts inside it."""
    from contextlib import ExitStack

    fp32, bf16 = one_process_strategy("fp32"), one_process_strategy("bf16")
    assert not isinstance(fp32.accumulate(is_last=False), ExitStack)
    with fp32.accumulate(is_last=True):
        assert not torch.is_autocast_enabled("cpu")
    with bf16.accumulate(is_last=True):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def test_one_process_sums_its_counts_and_votes_without_a_tensor() -> None:
    """The window's counts and the agreement after each step are sums over ranks; in one process they are
    the values themselves: no tensor is built, copied and read back for an identity."""
    from zerofit.loop.train import summed_over_ranks

    assert _ops_of(summed_over_ranks, one_process_strategy(), [3, 0, 7]) == ([3, 0, 7], 0)


def test_a_micro_steps_loss_sum_joins_the_windows_sums_in_one_op_with_the_same_bits() -> None:
    """SFT's one term and no metrics: the fp32 sum is added to the window's fp64 sums in one op (with its
    detach), not cast, stacked and concatenated first, and the sums have the general path's bits; more
    terms or metrics take the general path."""
    from zerofit.loop.train import _accumulate

    term = torch.tensor(1.0, requires_grad=True) * torch.tensor(0.1234567)  # a graph, as a loss sum has
    fast, general = torch.tensor([0.3], dtype=torch.float64), torch.tensor([0.3], dtype=torch.float64)
    _, ops = _ops_of(_accumulate, fast, [term], torch.zeros(0, dtype=torch.float64))
    general += torch.cat([torch.stack([term.detach().double()]), torch.zeros(0, dtype=torch.float64)])
    assert ops == 2 and torch.equal(fast, general) and not fast.requires_grad
    both = torch.zeros(3, dtype=torch.float64)
    _accumulate(both, [term, 2 * term], torch.tensor([5.0], dtype=torch.float64))
    assert both.tolist() == [float(term), float(2 * term), 5.0]


def test_the_single_strategy_clips_without_walking_the_model_at_each_step(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`prepare` lists the model's parameters once; each clip takes those with a gradient from that list
    (walking a peft model's modules cost ~0.2 ms a step on the demo)."""
    run = _loop_run(_Sink(), _Checkpoints(), max_steps=3, max_grad_norm=1.0)
    walks = [0]
    real_parameters = TinyLM.parameters

    def parameters(self: torch.nn.Module, recurse: bool = True) -> Any:
        walks[0] += 1
        return real_parameters(self, recurse)

    monkeypatch.setattr(TinyLM, "parameters", parameters)
    monkeypatch.setattr("zerofit.loop.train.trainable_parameters", lambda model: list(model.parameters()))
    norms = [r.grad_norm for r in train_loop(run)]
    assert walks[0] == 1  # the loop's finiteness check, once; none in the three clips
    assert all(n > 0 for n in norms)


def test_sfts_window_counts_its_label_tokens_once() -> None:
    """SFT's normalizer is the window's valid label tokens, which the loop also reports: counted once for
    both (half the ops of counting twice), with the same numbers; another objective's counts are its own."""
    from zerofit.loop.train import window_counts
    from zerofit.objectives.sft.loss import SFTObjective

    micro_batches = _split(_examples(), 2)
    (counts, tokens), ops = _ops_of(window_counts, SFTObjective(), micro_batches)
    twice = sum(count_label_tokens(b["labels"]) for b in micro_batches)
    _, ops_once = _ops_of(SFTObjective().counts, micro_batches)
    assert counts == [twice] and tokens == twice > 0 and ops == ops_once

    class Pairs(SFTObjective):
        def counts(self, micro_batches: list[dict[str, torch.Tensor]]) -> list[int]:
            return [len(micro_batches)]

    assert window_counts(Pairs(), micro_batches) == ([len(micro_batches)], twice)
