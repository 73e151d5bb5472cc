"""Config loading, dotted overrides, did-you-mean, and `resolve()`: every bad input is refused with one
clear `ConfigError` that names the field, the value and the fix."""

from __future__ import annotations

import math
import types
import typing
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from zerofit.catalogue.presets import list_presets
from zerofit.config import ZerofitConfig, load_config, parse_overrides
from zerofit.config.loader import validate_config
from zerofit.core.errors import ConfigError, ZerofitError
from zerofit.engine_spec import render_spec
from zerofit.planner import choose_fastest_plan
from zerofit.resolution import resolve

REPO = Path(__file__).resolve().parents[3]
DEMO = REPO / "configs" / "demo.yaml"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch: pytest.MonkeyPatch) -> None:
    # Run configs name data/model paths relative to the checkout, as a user's shell would.
    monkeypatch.chdir(REPO)


def _problems(overrides: list[str], world_size: int = 2, path: Path | None = DEMO) -> str:
    with pytest.raises(ConfigError) as err:
        resolve(load_config(path, overrides), world_size, choose_fastest_plan)
    assert isinstance(err.value, ZerofitError)
    return str(err.value)


def _walk(node: Any) -> list[Any]:
    if isinstance(node, dict):
        return [leaf for v in node.values() for leaf in _walk(v)]
    if isinstance(node, list | tuple):
        return [leaf for v in node for leaf in _walk(v)]
    return [node]


def _decided(cfg: Any) -> list[Any]:
    """Every value `resolve()` must have decided: all of them but `data.format`, which `auto` leaves to the
    data (the assembly detects it when the data is read; config.yaml records the format found), and
    `model.varlen_kernel`, which `auto` leaves to the device the model loads on (the run's plan names it)."""
    dumped = cfg.model_dump(mode="json")
    dumped["data"].pop("format")
    dumped["model"].pop("varlen_kernel")
    return _walk(dumped)


# ----------------------------------------------------------------------------------------- loading


def test_parse_overrides_types_and_nesting() -> None:
    parsed = parse_overrides(
        [
            "batch.global_batch_size=64",
            "lora.target_modules=[q_proj,v_proj]",
            "train.activation_checkpointing=true",
            "train.max_grad_norm=null",
            "run_name=my run",
        ]
    )
    assert parsed == {
        "batch": {"global_batch_size": 64},
        "lora": {"target_modules": ["q_proj", "v_proj"]},
        "train": {"activation_checkpointing": True, "max_grad_norm": None},
        "run_name": "my run",
    }
    # PyYAML (YAML 1.1) reads `3e-4` as a string; the loader reads it as the number it means (YAML 1.2).
    assert load_config(None, ["optimizer.lr=3e-4"]).optimizer.lr == 3e-4


@pytest.mark.parametrize("bad", ["batch.global_batch_size", "=3", "batch..x=1", ".a=1"])
def test_malformed_override_is_refused(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"dotted\.key=value"):
        parse_overrides([bad])


def test_file_values_and_overrides_win() -> None:
    cfg = load_config(DEMO)
    assert cfg.batch.global_batch_size == 16 and cfg.batch.micro_batch_size == 4
    assert cfg.distributed.preset == "zero2" and cfg.train.precision == "bf16"
    cfg = load_config(DEMO, ["batch.micro_batch_size=2", "train.precision=fp32"])
    assert cfg.batch.micro_batch_size == 2 and cfg.train.precision == "fp32"
    assert cfg.batch.global_batch_size == 16  # untouched keys keep the file's value


def test_no_file_gives_schema_defaults() -> None:
    assert load_config(None) == ZerofitConfig()


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_invalid_yaml_names_the_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("batch:\n  global_batch_size: 16\n   micro_batch_size: [\n")
    with pytest.raises(ConfigError, match=r"not valid YAML at line \d+"):
        load_config(bad)


def test_non_mapping_file(tmp_path: Path) -> None:
    bad = tmp_path / "list.yaml"
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="must hold a mapping"):
        load_config(bad)


# ----------------------------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize(
    ("override", "suggestion"),
    [
        ("bach.global_batch_size=4", "did you mean 'batch'?"),
        ("batch.global_bach_size=4", "did you mean 'batch.global_batch_size'?"),
        ("train.precison=bf16", "did you mean 'train.precision'?"),
        ("logging.wandb.mdoe=offline", "did you mean 'logging.wandb.mode'?"),
    ],
)
def test_misspelled_key_gets_did_you_mean(override: str, suggestion: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, [override])
    assert suggestion in str(err.value)
    assert "unknown key" in str(err.value)


def test_unknown_key_lists_valid_keys() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.zzz=1"])
    assert "valid keys under train:" in str(err.value) and "max_steps" in str(err.value)


def test_every_unknown_key_is_reported_at_once() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, ["train.precison=bf16", "optimzer.lr=1", "batch.micro=2"])
    msg = str(err.value)
    assert len(err.value.problems) == 3
    for key in ("train.precison", "optimzer", "batch.micro"):
        assert f"'{key}'" in msg


def test_bf16_and_fp16_both_requested() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, ["train.bf16=true", "train.fp16=true"])
    msg = str(err.value)
    assert "'train.bf16'" in msg and "'train.fp16'" in msg
    assert "train.precision=bf16" in msg and "cannot both be on" in msg


def test_simpo_gamma_is_trls_margin_and_gamma_over_beta_has_its_own_key() -> None:
    """preference.simpo_gamma is TRL's simpo_gamma, the margin itself; gamma / beta is
    preference.simpo_gamma_beta_ratio; with neither, the margin is 0.5 x beta; both at once are refused in
    one line naming both."""

    def preference(*overrides: str) -> Any:
        return load_config(None, ["train.objective=simpo", "preference.beta=2", *overrides]).preference

    assert preference().simpo_margin() == 1.0
    assert preference("preference.simpo_gamma=0.5").simpo_margin() == 0.5
    assert preference("preference.simpo_gamma_beta_ratio=0.25").simpo_margin() == 0.5
    with pytest.raises(ConfigError) as err:
        preference("preference.simpo_gamma=0.5", "preference.simpo_gamma_beta_ratio=0.25")
    assert len(err.value.problems) == 1
    assert err.value.problems[0].startswith(
        "preference.simpo_gamma_beta_ratio = 0.25: preference.simpo_gamma"
    )
    assert "TRL's simpo_gamma" in err.value.problems[0]


def test_bad_literal_value_names_allowed_values() -> None:
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, ["train.precision=bf16+fp16"])
    assert "train.precision = 'bf16+fp16'" in str(err.value) and "'fp16'" in str(err.value)


@pytest.mark.parametrize("value", ["maybe", "3", "[auto]"])
def test_a_bad_resume_mode_names_every_accepted_value(value: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(DEMO, [f"checkpoint.resume={value}"])
    text = str(err.value)
    assert text.count("checkpoint.resume = ") == 1
    assert all(word in text for word in ("must be true", "false", "or auto", "e.g. checkpoint.resume=auto"))


# ----------------------------------------------------------------------------------------- resolve


def _run_name_of(config: str | Path, overrides: list[str] | None = None) -> str:
    """The run name a launch of `config` resolves to (the config's own, else the derived default)."""
    cfg = load_config(config, overrides or [])
    return cfg.run_name or str(resolve(cfg, 1).config.run_name)


def _api_example_run_name() -> tuple[str, str]:
    """(config file, run name) of the `train(...)` call in docs/guides/python-api.md's example."""
    import ast
    import re

    text = (REPO / "docs" / "guides" / "python-api.md").read_text()
    block = re.search(r"```python\n(.*?)```", text, re.S)
    assert block, "python-api.md has no python block"
    for node in ast.walk(ast.parse(block.group(1))):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "train":
            config = ast.literal_eval(node.args[0])
            kwargs = {k.arg: ast.literal_eval(k.value) for k in node.keywords if k.arg}
            overrides = [f"run_name={kwargs['run_name']}"] if "run_name" in kwargs else []
            return config, _run_name_of(REPO / config, overrides)
    raise AssertionError("python-api.md's example calls no train(...)")


def test_the_shipped_configs_and_the_api_example_write_distinct_run_directories() -> None:
    """configs/demo.yaml, demo-chat.yaml and the Python API example once all wrote
    runs/tiny-llama-lora-zero2-bf16-g16: a second one silently became `-2`, and a resume found another
    config's run. Every shipped config, and the guide's example, names a folder of its own."""
    names = {path.name: _run_name_of(path) for path in sorted((REPO / "configs").glob("*.yaml"))}
    config, api_name = _api_example_run_name()
    assert config == "configs/demo-chat.yaml"
    taken = [*names.values(), api_name]
    assert len(set(taken)) == len(taken), names | {"python-api.md": api_name}


def test_resolve_fills_every_derived_value() -> None:
    resolved = resolve(load_config(DEMO), 2)
    cfg = resolved.config
    assert (resolved.batch.global_batch_size, resolved.batch.micro_batch_size) == (16, 4)
    assert (resolved.batch.grad_accum_steps, resolved.batch.dp_size, resolved.world_size) == (2, 2, 2)
    assert cfg.batch.grad_accum_steps == 2
    assert cfg.run_name == "tiny-llama-lora-zero2-bf16-g16"  # model, method, preset, precision, global batch
    assert resolved.run_dir == Path("runs") / cfg.run_name
    assert cfg.logging.wandb.mode == "offline"
    assert "auto" not in _decided(cfg)
    assert resolved.method == "lora"


@pytest.mark.parametrize(
    ("strategy", "preset"), [("deepspeed", "zero2"), ("fsdp", "fsdp"), ("single", None), ("ddp", None)]
)
def test_default_preset_per_strategy(strategy: str, preset: str | None) -> None:
    overrides = [f"distributed.strategy={strategy}", "distributed.preset=null"]
    resolved = resolve(load_config(DEMO, overrides), 1)
    assert resolved.config.distributed.preset == preset


def test_wandb_mode_default_is_concrete(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert resolve(load_config(DEMO, ["logging.wandb.mode=null"]), 1).config.logging.wandb.mode == "offline"
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    assert resolve(load_config(DEMO, ["logging.wandb.mode=null"]), 1).config.logging.wandb.mode == "online"


@pytest.mark.parametrize("mode", ["null", "offline", "online"])
def test_wandb_mode_disabled_in_the_environment_wins(monkeypatch: pytest.MonkeyPatch, mode: str) -> None:
    # W&B's own off switch, as CI and the README test use it: config.yaml then records what ran.
    monkeypatch.setenv("WANDB_MODE", "disabled")
    resolved = resolve(load_config(DEMO, [f"logging.wandb.mode={mode}"]), 1)
    assert resolved.config.logging.wandb.mode == "disabled"


def test_explicit_run_name_is_kept() -> None:
    resolved = resolve(load_config(DEMO, ["run_name=mine", "output_dir=/tmp/out"]), 1)
    assert resolved.run_dir == Path("/tmp/out/mine")


@pytest.mark.parametrize(
    "name", ["../victim", "../../x", "/tmp/x", "a/b", "a\\b", "", "  ", ".", "..", "a\x00b", "x\ny"]
)
def test_a_run_name_is_one_folder_name_inside_output_dir(name: str) -> None:
    # The field, the value, the rule and a fix, at load time: nothing is resolved, nothing written.
    with pytest.raises(ConfigError) as err:
        validate_config({"run_name": name})
    text = str(err.value)
    assert f"run_name = {name!r}: must be one folder name inside output_dir" in text
    assert "e.g. run_name=" in text


def test_lr_scaling_is_opt_in() -> None:
    base = ["optimizer.lr=1e-3", "optimizer.base_batch_size=4"]
    assert resolve(load_config(DEMO, base), 1).effective_lr == 1e-3
    linear = resolve(load_config(DEMO, [*base, "optimizer.lr_scaling=linear"]), 1)
    assert math.isclose(linear.effective_lr, 1e-3 * 16 / 4)
    sqrt = resolve(load_config(DEMO, [*base, "optimizer.lr_scaling=sqrt"]), 1)
    assert math.isclose(sqrt.effective_lr, 1e-3 * 2)


# ----------------------------------------------------------------------------------------- bad input


def test_indivisible_split_names_every_factor_and_valid_sizes() -> None:
    msg = _problems(["batch.global_batch_size=64", "batch.micro_batch_size=3"], world_size=8)
    for text in ("global_batch_size=64", "micro_batch_size=3", "dp_size=8", "1, 2, 4, 8"):
        assert text in msg


def test_disagreeing_triple_is_refused() -> None:
    msg = _problems(["batch.grad_accum_steps=3"], world_size=2)
    assert "grad_accum_steps=3" in msg and "grad_accum_steps would have to be 2" in msg


def test_fewer_than_two_of_the_triple() -> None:
    msg = _problems(["batch.micro_batch_size=null"])
    assert "set at least two of global_batch_size, micro_batch_size, grad_accum_steps" in msg


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("batch.global_batch_size=0", "global_batch_size must be a positive integer, got 0"),
        ("batch.micro_batch_size=-1", "micro_batch_size must be a positive integer, got -1"),
        ("batch.grad_accum_steps=0", "grad_accum_steps must be a positive integer, got 0"),
        ("train.max_steps=0", "train.max_steps = 0: must be > 0"),
        ("optimizer.lr=0", "optimizer.lr = 0.0: must be > 0"),
        ("data.max_seq_len=-5", "data.max_seq_len = -5: must be > 0"),
        ("train.max_grad_norm=-1", "train.max_grad_norm = -1.0: must be >= 0"),
    ],
)
def test_non_positive_values(override: str, named: str) -> None:
    assert named in _problems([override])


def test_world_size_must_be_positive() -> None:
    assert "world size 0 must be >= 1" in _problems([], world_size=0)


def test_unknown_preset_lists_the_presets() -> None:
    msg = _problems(["distributed.preset=zero4"])
    assert "'zero4' is not a known preset" in msg
    for name in list_presets():
        assert name in msg


def test_preset_of_another_engine_written_with_its_strategy() -> None:
    # Both written in the same place and contradicting each other: no side wins, the user decides.
    msg = _problems(["distributed.strategy=deepspeed", "distributed.preset=fsdp_offload"])
    assert "is a fsdp preset but distributed.strategy = 'deepspeed'" in msg
    assert "distributed.strategy=fsdp" in msg


@pytest.mark.parametrize(
    ("overrides", "world_size", "engine", "note"),
    [
        # One override switches engine: the file's DeepSpeed preset gives way to the new engine's default.
        (
            ["distributed.strategy=fsdp"],
            2,
            ("fsdp", "fsdp"),
            "replaces the config file's deepspeed preset 'zero2'",
        ),
        (["distributed.strategy=single"], 1, ("single", None), "(single takes no preset)"),
        (["distributed.strategy=ddp"], 2, ("ddp", None), "(ddp takes no preset)"),
        # A preset alone implies its engine.
        (["distributed.preset=fsdp_offload"], 2, ("fsdp", "fsdp_offload"), "is a fsdp preset, so"),
        # Same engine: nothing to say.
        (["distributed.preset=zero3"], 2, ("deepspeed", "zero3"), None),
    ],
)
def test_switching_engine_takes_one_override(
    overrides: list[str], world_size: int, engine: tuple[str, str | None], note: str | None
) -> None:
    resolved = resolve(load_config(DEMO, overrides), world_size)
    assert (resolved.config.distributed.strategy, resolved.config.distributed.preset) == engine
    if note is None:
        assert resolved.notes == ()
    else:
        assert len(resolved.notes) == 1 and note in resolved.notes[0], resolved.notes
    # The resolved config says the engine outright: reloading config.yaml gives the same engine, no notes.
    again = resolve(validate_config(resolved.config.model_dump(mode="json")), world_size)
    assert (again.config.distributed.strategy, again.config.distributed.preset) == engine
    assert again.notes == ()


def test_a_preset_in_a_file_without_a_strategy_implies_it(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(DEMO.read_text().replace("  strategy: deepspeed\n  preset: zero2\n", "  preset: fsdp\n"))
    resolved = resolve(load_config(path), 2)
    assert (resolved.config.distributed.strategy, resolved.config.distributed.preset) == ("fsdp", "fsdp")
    assert resolved.notes == ()  # nothing contradicted: the preset was the only word on the engine


def test_switching_away_from_deepspeed_drops_the_files_deepspeed_json(tmp_path: Path) -> None:
    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 2}}')
    path = tmp_path / "c.yaml"
    path.write_text(DEMO.read_text().replace("  preset: zero2\n", f"  ds_config: {ds}\n"))
    resolved = resolve(load_config(path, ["distributed.strategy=fsdp"]), 2)
    assert resolved.config.distributed.ds_config is None
    assert any("is not used" in note for note in resolved.notes), resolved.notes


def test_micro_batch_auto_says_the_planner_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    # The memory planner resolves `auto` (tests/unit/planner/test_planner_search.py); without a visible GPU and
    # without planner.gpu / planner.gpu_memory_gib it has no budget and says how to give one.
    monkeypatch.setattr("zerofit.planner.search.budget.detected_gpu", lambda: None)
    assert "needs the GPU's memory" in _problems(["batch.micro_batch_size=auto"])
    # The config layer sits below the planner: without a chooser, `auto` is refused, never guessed.
    with pytest.raises(ConfigError, match="needs the memory planner"):
        resolve(load_config(DEMO, ["batch.micro_batch_size=auto"]), 2)


def test_single_strategy_with_many_ranks() -> None:
    assert "runs one process, but the launcher started 2" in _problems(["distributed.strategy=single"])


def test_ds_config_must_exist_and_belong_to_deepspeed(tmp_path: Path) -> None:
    assert "file does not exist" in _problems([f"distributed.ds_config={tmp_path / 'x.json'}"])
    ds = tmp_path / "ds.json"
    ds.write_text("{}")
    msg = _problems(["distributed.strategy=fsdp", f"distributed.ds_config={ds}"])
    assert "is a DeepSpeed config but distributed.strategy = 'fsdp'" in msg


def test_all_problems_are_collected_into_one_error() -> None:
    with pytest.raises(ConfigError) as err:
        resolve(
            load_config(
                DEMO,
                [
                    "batch.micro_batch_size=3",
                    "distributed.preset=zero9",
                    "quantization.load_in=4bit",
                    "lora.enabled=false",
                    "data.path=nope.jsonl",
                ],
            ),
            2,
        )
    problems = err.value.problems
    assert len(problems) == 4
    assert "Invalid configuration (4 problems)" in str(err.value)


def test_value_bounds_are_checked_when_the_config_is_validated_all_at_once() -> None:
    # The bounds live on the schema's fields, so any validated config obeys them, not only a resolved one;
    # every broken bound and unknown key of one config is reported together.
    with pytest.raises(ConfigError) as err:
        validate_config(
            {
                "train": {"max_steps": 0},
                "scheduler": {"min_lr_ratio": 1.5},
                "lora": {"dropuot": 0.1, "dropout": 1},
            }
        )
    assert sorted(err.value.problems) == [
        "lora.dropout = 1.0: must be in [0, 1)",
        "scheduler.min_lr_ratio = 1.5: must be in [0, 1]",
        "train.max_steps = 0: must be > 0",
        "unknown key 'lora.dropuot'; did you mean 'lora.dropout'? (valid keys under lora: alpha, dropout, "
        "enabled, moe_experts, projector, r, target_modules, train_router, use_dora, vision_tower)",
    ]


@pytest.mark.parametrize(
    ("override", "named"),
    [
        (
            "checkpoint.every_minutes=-1",
            "checkpoint.every_minutes = -1.0: must be >= 0 (0 or null = no wall-clock saves)",
        ),
        ("eval.every_steps=-2", "eval.every_steps = -2: must be >= 0 (0 = only at the end)"),
        ("checkpoint.keep_last=0", "checkpoint.keep_last = 0: must be >= 1"),
        # A bound on one member of a union (bool | int >= 0 | auto; a fraction or a split name).
        (
            "train.activation_checkpointing=-2",
            "train.activation_checkpointing = -2: must be >= 0 (the number",
        ),
        ("data.eval_split=1.5", "data.eval_split = 1.5: must be in (0, 1) (a held-out fraction, e.g. 0.02"),
        ("train.early_stopping.patience=-1", "train.early_stopping.patience = -1: must be >= 0 (0 = off)"),
    ],
)
def test_a_broken_bound_says_what_its_edge_means(override: str, named: str) -> None:
    assert named in _problems([override])


# ------------------------------------------------------------------------- values that wreck a run


def _refusal(overrides: list[str], path: Path | None = DEMO) -> str:
    """The one problem `load_config` reports for `overrides`."""
    with pytest.raises(ConfigError) as err:
        load_config(path, overrides)
    (problem,) = err.value.problems
    return problem


@pytest.mark.parametrize(
    ("override", "named"),
    [
        (
            "optimizer.lr=.inf",
            "optimizer.lr = inf: not a finite number (inf and nan are refused); it must be",
        ),
        ("optimizer.lr=.nan", "optimizer.lr = nan: not a finite number"),
        ("preference.beta=.inf", "preference.beta = inf: not a finite number"),
        ("preference.beta=nan", "preference.beta = 'nan': not a finite number"),
        ("distributed.timeout_minutes=-.inf", "distributed.timeout_minutes = -inf: not a finite number"),
        (
            "lora.alpha=0",
            "lora.alpha = 0: must be > 0 (the adapters' scale is alpha / r, so 0 learns nothing",
        ),
        (
            "train.max_steps=true",
            "train.max_steps = True: true/false is not a number; it must be an integer > 0",
        ),
        ("planner.num_gpus=-1", "planner.num_gpus = -1: must be >= 1"),
        ("planner.headroom=1.5", "planner.headroom = 1.5: must be in [0, 1) (a fraction of GPU memory"),
        ("planner.gpu_memory_gib=0", "planner.gpu_memory_gib = 0.0: must be > 0"),
        ("optimizer.eps=-1", "optimizer.eps = -1.0: must be > 0 (added to Adam's denominator"),
        ("optimizer.weight_decay=-0.5", "optimizer.weight_decay = -0.5: must be >= 0 (0 = off"),
        ("seed=-1", "seed = -1: must be in [0, 4294967295] (numpy's seeding takes 0 to 2**32 - 1)"),
        ("seed=12345678901234567890", "seed = 12345678901234567890: must be in [0, 4294967295]"),
        (
            "train.tiled_mlp=4.5",
            "train.tiled_mlp = 4.5: not an integer; it must be an integer >= 1 (the number of token shards of "
            "each MLP, e.g. 4; or false, auto)",
        ),
    ],
)
def test_a_value_that_wrecks_a_run_is_one_paragraph_naming_it(override: str, named: str) -> None:
    problem = _refusal([override])
    assert problem.startswith(named), problem
    assert "Input should be" not in problem


def _takes_a_number_not_a_bool(annotation: Any) -> bool:
    """An int / float field (or a union with one) that takes no true/false; said here apart from the schema's
    own rule, so the test checks the schema rather than repeating it."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    members = [
        typing.get_args(m)[0] if typing.get_origin(m) is typing.Annotated else m
        for m in (typing.get_args(annotation) if union else (annotation,))
    ]
    takes_bool = any(
        m is bool
        or (typing.get_origin(m) is typing.Literal and any(isinstance(a, bool) for a in typing.get_args(m)))
        for m in members
    )
    return not takes_bool and any(m in (int, float) for m in members)


def _number_fields(model: type[BaseModel] = ZerofitConfig, prefix: str = "") -> list[tuple[str, Any]]:
    """Every int / float field of the schema that takes no true/false, as (dotted key, annotation)."""
    found: list[tuple[str, Any]] = []
    for name, field in model.model_fields.items():
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            found += _number_fields(annotation, f"{prefix}{name}.")
        elif _takes_a_number_not_a_bool(annotation):
            found.append((f"{prefix}{name}", annotation))
    return found


NUMBER_FIELDS = _number_fields()


def test_the_schema_s_number_fields_are_found() -> None:
    keys = {key for key, _ in NUMBER_FIELDS}
    assert {
        "seed",
        "train.max_steps",
        "optimizer.lr",
        "lora.r",
        "data.eval_split",
        "batch.micro_batch_size",
    } <= keys
    assert not keys & {"train.activation_checkpointing", "train.tiled_mlp", "optimizer.betas", "lora.enabled"}


@pytest.mark.parametrize("key", [key for key, _ in NUMBER_FIELDS])
def test_no_number_field_takes_true_or_false(key: str) -> None:
    """pydantic alone reads true as 1 (`train.max_steps=true` trained 1 step): every number field refuses it."""
    for word, shown in (("true", "True"), ("false", "False")):
        problem = _refusal([f"{key}={word}"], path=None)
        assert problem.startswith(f"{key} = {shown}: true/false is not a number; it must be "), problem


@pytest.mark.parametrize("key", [key for key, annotation in NUMBER_FIELDS if "float" in str(annotation)])
def test_no_float_field_takes_inf_or_nan(key: str) -> None:
    for word, shown in ((".inf", "inf"), ("-.inf", "-inf"), (".nan", "nan")):
        problem = _refusal([f"{key}={word}"], path=None)
        assert problem.startswith(f"{key} = {shown}: not a finite number (inf and nan are refused)"), problem


FLOAT_FIELDS = [
    key for key, annotation in NUMBER_FIELDS if "float" in str(annotation) and "str" not in str(annotation)
]


def test_the_schema_s_float_fields_are_found() -> None:
    assert {
        "optimizer.lr",
        "optimizer.eps",
        "train.max_grad_norm",
        "preference.beta",
        "planner.headroom",
    } <= set(FLOAT_FIELDS)
    assert "data.eval_split" not in FLOAT_FIELDS  # a fraction, or a split name (text)


@pytest.mark.parametrize("key", FLOAT_FIELDS)
def test_no_float_field_takes_a_quoted_number(key: str) -> None:
    """pydantic alone read `optimizer.lr="3e-3"` as 0.003, while its strict fields refuse text: every float
    field refuses a quoted number, naming the key, the value and the fix (the number without quotes)."""
    for quoted, number in (("'0.5'", "0.5"), ('"3e-3"', "3e-3")):
        problem = _refusal([f"{key}={quoted}"], path=None)
        assert problem.startswith(
            f"{key} = {number!r}: a quoted string is text, not a number; it must be "
        ), problem
        leaf = key.rsplit(".", 1)[-1]
        assert problem.endswith(
            f"write it without quotes: {key}={number} (in a YAML file `{leaf}: {number}`)"
        )


def test_a_quoted_number_is_refused_in_a_file_and_in_a_list_of_rewards(tmp_path: Path) -> None:
    path = tmp_path / "quoted.yaml"
    path.write_text('optimizer:\n  lr: "3e-3"\n')
    assert _refusal([], path=path).startswith("optimizer.lr = '3e-3': a quoted string is text, not a number")
    reward = _refusal(["rl.rewards=[{function: length, target_length: 3, weight: '2'}]"], path=None)
    assert (
        reward == "rl.rewards.0.weight = '2': a quoted string is text, not a number; write it without quotes"
    )


def test_an_unquoted_exponent_is_a_number_in_a_file_and_on_the_command_line(tmp_path: Path) -> None:
    """YAML 1.1 (PyYAML) reads `3e-3`, `1e5` and `1.0e5` as text; a config reads them as the numbers they
    are (YAML 1.2), so the strict float fields take them; only a quoted number stays text."""
    assert parse_overrides(["a=3e-3", "b=1e5", "c=1.0e5", "d=-2E+2", "e='3e-3'", "f=1_000", "g=e5"]) == {
        "a": 3e-3,
        "b": 1e5,
        "c": 1e5,
        "d": -200.0,
        "e": "3e-3",
        "f": 1000,
        "g": "e5",
    }
    path = tmp_path / "exponents.yaml"
    path.write_text("optimizer:\n  lr: 3e-3\n  eps: 1E-8\ntrain:\n  max_grad_norm: 1e0\n")
    cfg = load_config(path, ["preference.beta=5e-2"])
    assert (cfg.optimizer.lr, cfg.optimizer.eps, cfg.train.max_grad_norm, cfg.preference.beta) == (
        3e-3,
        1e-8,
        1.0,
        5e-2,
    )


@pytest.mark.parametrize("null", ["null", "~", "Null", "NULL"])
def test_an_override_of_run_name_to_null_is_refused(null: str) -> None:
    """`run_name=~` used to become the derived name silently; an override that names no run is refused, in
    one paragraph naming the key and the two fixes (a name, or no override)."""
    problem = _refusal([f"run_name={null}"])
    assert problem.startswith("run_name = null: the override sets run_name to null"), problem
    assert "set a name (run_name=NAME" in problem and "or leave the override out" in problem


def test_run_name_null_in_a_file_is_the_key_left_out_and_the_api_refuses_none(tmp_path: Path) -> None:
    import zerofit

    path = tmp_path / "unresolved.yaml"  # what a dump of an unresolved config writes
    path.write_text(DEMO.read_text() + "run_name: null\n")
    assert resolve(load_config(path), 1).config.run_name == resolve(load_config(DEMO), 1).config.run_name
    with pytest.raises(ConfigError, match="run_name = null: the override sets run_name to null"):
        zerofit.plan(DEMO, run_name=None)


def test_a_config_file_that_is_not_utf8_names_the_file_the_byte_and_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "latin1.yaml"
    path.write_bytes("seed: 42\nrun_name: café\n".encode("latin-1"))
    problem = _refusal([], path=path)
    assert problem.startswith(f"config file '{path}' is not UTF-8 text: byte 0xe9 at byte offset 22 (line 2)")
    assert "save the file as UTF-8" in problem


def test_a_long_value_is_echoed_short() -> None:
    problem = _refusal([f"seed=[{','.join(['12345'] * 5000)}]"], path=None)
    assert problem.startswith("seed = [12345, 12345, ") and len(problem) < 400, problem


_BOMB = """\
import sys, time
from zerofit.config import load_config
from zerofit.core.errors import ConfigError
start = time.monotonic()
try:
    load_config(sys.argv[1], sys.argv[2:])
except ConfigError as err:
    print(f"{time.monotonic() - start:.1f}s {err}")
"""


def _alias_bomb(levels: int) -> str:
    """A "billion laughs" YAML flow list: each level repeats the one before it 9 times (9**levels values)."""
    parts = ["&l0 [" + ",".join(["lol"] * 9) + "]"]
    parts += [f"&l{i} [" + ",".join([f"*l{i - 1}"] * 9) + "]" for i in range(1, levels + 1)]
    return "[" + ", ".join(parts) + "]"


@pytest.mark.parametrize("where", ["file", "override"])
def test_a_billion_laughs_config_is_refused_fast_and_briefly(tmp_path: Path, where: str) -> None:
    """Aliases nested 9 deep expand to 9**9 values (a shared reference each, so loading is fast); on main the
    message's repr walked the whole expansion and `zerofit plan` hung. A subprocess bounds the test's time."""
    import subprocess
    import sys

    config = tmp_path / "bomb.yaml"
    config.write_text(f"train:\n  max_steps: {_alias_bomb(9)}\n" if where == "file" else "seed: 1\n")
    args = [] if where == "file" else [f"seed={_alias_bomb(9)}"]
    done = subprocess.run(
        [sys.executable, "-c", _BOMB, str(config), *args], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "expands to more than 10000 values" in done.stdout and "write the values out" in done.stdout
    assert len(done.stdout) < 500 and float(done.stdout.split("s ")[0]) < 5, done.stdout


_FOLDER_BOMB = """\
import sys, time
from pathlib import Path
from zerofit.core.errors import ZerofitError
from zerofit.trained.model import read_run_config
from zerofit.metrics.runs import load_run
start = time.monotonic()
for read in (read_run_config, load_run):  # zerofit export / generate, and zerofit compare
    try:
        read(Path(sys.argv[1]))
    except ZerofitError as err:
        print(f"{time.monotonic() - start:.1f}s {err}")
"""


def test_a_run_folders_billion_laughs_config_is_refused_fast_and_briefly(tmp_path: Path) -> None:
    """A run folder may be a stranger's: its config.yaml is read by the same bounded reader as a config file,
    by export / generate and by compare, not walked whole (on main, `zerofit compare` hung on it)."""
    import subprocess
    import sys

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.yaml").write_text(f"train:\n  max_steps: {_alias_bomb(9)}\n")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    done = subprocess.run(
        [sys.executable, "-c", _FOLDER_BOMB, str(run)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr[-2000:]
    lines = done.stdout.splitlines()
    assert len(lines) == 2 and all("expands to more than 10000 values" in line for line in lines), lines
    assert all(len(line) < 500 and float(line.split("s ")[0]) < 5 for line in lines), lines


def test_quantization_needs_lora() -> None:
    assert "needs LoRA" in _problems(["quantization.load_in=4bit", "lora.enabled=false"])


# ----------------------------------------------------------------------------------------- shipped configs


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_resolves_and_renders(path: Path) -> None:
    resolved = resolve(load_config(path), 1, choose_fastest_plan)
    engine = render_spec(resolved).to_json()
    assert "auto" not in _walk(engine)
    assert "auto" not in _decided(resolved.config)


@pytest.mark.parametrize("betas", ["[0.9]", "[0.9,1.5]", "[0.9,0.99,0.1]", "0.9"])
def test_betas_must_be_two_rates_and_the_message_says_so(betas: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(None, [f"optimizer.betas={betas}"])
    (problem,) = err.value.problems
    assert problem.startswith("optimizer.betas = ") and "Field required" not in problem
    assert "two numbers in [0, 1)" in problem and "optimizer.betas=[0.9,0.999]" in problem


def test_a_model_path_that_is_no_model_folder_says_why_and_how_to_fix_it(tmp_path: Path) -> None:
    missing = _problems([f"model.name_or_path={tmp_path / 'nonexistent'}"])
    assert "is neither an existing folder nor a Hugging Face hub id" in missing
    assert "fix the path to a model folder (config.json" in missing
    empty = _problems([f"model.name_or_path={tmp_path}"])
    assert f"model.name_or_path = '{tmp_path}': that folder has no config.json" in empty
    assert "point it at the folder that holds config.json" in empty
