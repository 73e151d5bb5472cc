"""A model folder zerofit loads weights from is read from safetensors only (`zerofit.models.safe_weights`): a
local `model.name_or_path` holding only pickled weights is refused in one paragraph before transformers could
unpickle them; beside safetensors weights a pickle is never read (`use_safetensors=True`)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from planted_pickle import plant_pickle

from config_helpers import config
from zerofit.core.errors import ConfigError
from zerofit.models.build import build_model, resolve_model_path


@pytest.fixture
def local_model(tmp_path: Path) -> Path:
    """tiny-llama's folder, copied as a user's local model folder."""
    return Path(shutil.copytree(resolve_model_path(config({"seed": 0})), tmp_path / "my-model"))


def test_a_local_model_folder_with_only_pickled_weights_is_refused_before_loading(
    local_model: Path, tmp_path: Path
) -> None:
    ran = tmp_path / "ran"
    (local_model / "model.safetensors").unlink()
    plant_pickle(local_model / "pytorch_model.bin", ran)
    with pytest.raises(ConfigError) as err:
        build_model(config({"model": {"name_or_path": str(local_model)}}, train={"precision": "fp32"}))
    text = err.value.without_heading()
    assert f"model.name_or_path {local_model}: it holds only pickled weights (pytorch_model.bin)" in text
    assert "no safetensors (model.safetensors or model.safetensors.index.json)" in text
    assert "convert them to safetensors" in text and "\n" not in text and not ran.exists()


def test_beside_safetensors_weights_a_pickle_is_never_read(local_model: Path, tmp_path: Path) -> None:
    # (a downloaded hub repository often holds both formats: it trains, from its safetensors)
    ran = tmp_path / "ran"
    plant_pickle(local_model / "pytorch_model.bin", ran)
    built = build_model(config({"model": {"name_or_path": str(local_model)}}, train={"precision": "fp32"}))
    assert built.total_params > 0 and not ran.exists()
