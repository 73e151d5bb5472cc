"""`zerofit export --out DIR` deletes only what an earlier export wrote there, and a pickle planted in an export
folder is one paragraph from `zerofit generate`, never torch's traceback.

One tiny run (the demo config, one process, 2 steps, fp32) is exported into the same folder again and again,
as every kind (adapter, --merge, --format gguf): an earlier export's files (its zerofit_export.json lists
them) are replaced; anything else there (a user's notes, a folder of their own, a symlink) makes the export
refuse, in one paragraph naming the files, with nothing deleted, also for a marker from an older zerofit
(no listing: only what an export of its kind writes may go) and for an empty `{}` marker.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from planted_pickle import plant_pickle

from config_helpers import train_demo
from zerofit.cli import main as cli
from zerofit.export import EXPORT_INFO, export_run

KINDS = {"adapter": [], "merged": ["--merge"], "gguf": ["--format", "gguf"]}


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo config trained for 2 steps on one process in fp32 (final export adapter/)."""
    return train_demo(tmp_path_factory.mktemp("out"), 2, precision="fp32")


def _export(run_dir: Path, out: Path, kind: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    """`zerofit export RUN --out OUT` of `kind`, in this process: (exit code, stderr)."""
    code = cli(["export", str(run_dir), "--out", str(out), *KINDS[kind]])
    return code, capsys.readouterr().err


def _files(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` (symlinks as their target's path), by relative path."""
    return {
        p.relative_to(folder).as_posix(): str(p.readlink()).encode() if p.is_symlink() else p.read_bytes()
        for p in sorted(folder.rglob("*"))
        if p.is_file() or p.is_symlink()
    }


def _refused(code: int, err: str, out: Path, *names: str) -> None:
    """One paragraph, exit 2, naming the folder, the files (`names`, sorted) and the fix; no traceback."""
    assert code == 2, err
    assert "Traceback" not in err and "\n" not in err.strip(), err
    assert f"--out {out} holds files that are not a zerofit export's own ({', '.join(names)})" in err, err
    assert "nothing was exported and nothing deleted: choose another --out" in err and "move" in err


def _listing(out: Path) -> list[str]:
    return json.loads((out / EXPORT_INFO).read_text())["files"]


@pytest.mark.slow
@pytest.mark.parametrize("kind", list(KINDS))
def test_an_export_into_a_folder_with_user_files_is_refused_and_nothing_deleted(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    out = tmp_path / "x"
    assert _export(run_dir, out, kind, capsys)[0] == 0
    (out / "notes.txt").write_text("my notes")
    (out / "mydata").mkdir()
    (out / "mydata" / "a.txt").write_text("my data")
    before = _files(out)
    _refused(*_export(run_dir, out, kind, capsys), out, "mydata/a.txt", "notes.txt")
    assert _files(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["x"]  # no temporary folder left beside it


@pytest.mark.slow
def test_an_export_replaces_exactly_the_files_of_the_earlier_exports_there(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "x"
    assert _export(run_dir, out, "gguf", capsys)[0] == 0
    assert cli(["export", str(run_dir), "--out", str(out), "--format", "gguf", "--quant", "q8_0"]) == 0
    assert {"demo-f16.gguf", "demo-q8_0.gguf", "Modelfile"} <= set(_listing(out))  # both types listed
    for kind, weights, gone in (
        ("adapter", "adapter_model.safetensors", "demo-f16.gguf"),
        ("merged", "model.safetensors", "adapter_model.safetensors"),
        ("adapter", "adapter_model.safetensors", "model.safetensors"),
    ):
        assert _export(run_dir, out, kind, capsys)[0] == 0
        assert sorted(_files(out)) == _listing(out)  # the folder holds exactly what its marker lists
        assert (out / weights).is_file() and not (out / gone).exists()
        assert json.loads((out / EXPORT_INFO).read_text())["kind"] == kind
    assert [p.name for p in tmp_path.iterdir()] == ["x"]


@pytest.mark.slow
def test_an_empty_marker_beside_a_users_file_is_refused_and_the_file_kept(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "x"
    out.mkdir()
    (out / EXPORT_INFO).write_text("{}")
    (out / "thesis.txt").write_text("four years of work")
    for kind in KINDS:
        _refused(*_export(run_dir, out, kind, capsys), out, "thesis.txt")
        assert (out / "thesis.txt").read_text() == "four years of work"
    (out / "thesis.txt").unlink()  # the marker alone: an export may replace it
    assert _export(run_dir, out, "adapter", capsys)[0] == 0


def _without_listing(out: Path) -> None:
    """`out`'s marker as an older zerofit wrote it: no `files`."""
    info = json.loads((out / EXPORT_INFO).read_text())
    del info["files"]
    (out / EXPORT_INFO).write_text(json.dumps(info))


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "users", "gone"), [("adapter", "notes.txt", "adapter_model.safetensors"), ("gguf", "demo-q4_k_m.gguf", "demo-f16.gguf")])  # fmt: skip
def test_a_marker_without_a_listing_allows_only_what_an_export_of_its_kind_writes(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, users: str, gone: str
) -> None:
    # (demo-q4_k_m.gguf: what the llama-quantize command zerofit suggests writes beside the f16 file)
    out = tmp_path / "x"
    assert _export(run_dir, out, kind, capsys)[0] == 0
    _without_listing(out)
    (out / users).write_text("the user's")
    before = _files(out)
    _refused(*_export(run_dir, out, "merged", capsys), out, users)
    assert _files(out) == before
    (out / users).unlink()
    assert _export(run_dir, out, "merged", capsys)[0] == 0
    assert not (out / gone).exists() and (out / "model.safetensors").is_file()


@pytest.mark.slow
def test_the_listing_is_trusted_only_for_plain_files_inside_the_folder(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, victim, outside = tmp_path / "x", tmp_path / "victim.txt", tmp_path / "outside"
    victim.write_text("keep")
    outside.mkdir()
    (outside / "f.txt").write_text("keep")
    assert _export(run_dir, out, "adapter", capsys)[0] == 0
    info = json.loads((out / EXPORT_INFO).read_text())
    info["files"] += ["../victim.txt", str(victim), "link", "sub/f.txt"]
    (out / EXPORT_INFO).write_text(json.dumps(info))
    assert _export(run_dir, out, "adapter", capsys)[0] == 0  # names outside the folder: ignored
    assert victim.read_text() == "keep"
    (out / EXPORT_INFO).write_text(json.dumps(info))
    (out / "link").symlink_to(victim)
    (out / "sub").symlink_to(outside, target_is_directory=True)
    _refused(*_export(run_dir, out, "adapter", capsys), out, "link", "sub")
    assert victim.read_text() == "keep" and (outside / "f.txt").read_text() == "keep"


@pytest.mark.slow
def test_a_file_added_while_exporting_is_refused_and_a_failed_export_keeps_the_earlier_one(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import zerofit.export.folder as folder

    out = tmp_path / "x"
    assert _export(run_dir, out, "adapter", capsys)[0] == 0
    before = _files(out)
    card = folder.model_card

    def user_writes_meanwhile(*args: object) -> str:
        (out / "late.txt").write_text("written during the export")
        return card(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(folder, "model_card", user_writes_meanwhile)
    _refused(*_export(run_dir, out, "merged", capsys), out, "late.txt")
    assert _files(out) == {**before, "late.txt": b"written during the export"}
    (out / "late.txt").unlink()

    def disk_full(*args: object) -> str:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(folder, "model_card", disk_full)
    with pytest.raises(OSError, match="No space left"):
        export_run(run_dir, out, merge=True)
    assert _files(out) == before
    assert [p.name for p in tmp_path.iterdir()] == ["x"]


# ------------------------------------------------------------------- a pickle planted in an export folder


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "pickle", "beside"),
    [
        ("adapter", "adapter_model.bin", True),  # peft would read the safetensors, but it is no export's
        ("merged", "pytorch_model.bin", False),  # in place of the weights: transformers would read it
    ],
)
def test_generate_refuses_a_pickle_planted_in_an_export_in_one_paragraph(
    run_dir: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str, pickle: str, beside: bool
) -> None:
    out, ran = tmp_path / "x", tmp_path / "ran"
    assert _export(run_dir, out, kind, capsys)[0] == 0
    if not beside:
        (out / "model.safetensors").unlink()
    plant_pickle(out / pickle, ran)
    script = Path(sys.executable).with_name("zerofit")
    proc = subprocess.run(
        [str(script), "generate", str(out), "--prompt", "12 + 7 =", "--max-new-tokens", "2"],
        capture_output=True,
        text=True,
        check=False,
        timeout=300,
    )
    err = proc.stderr.strip()
    assert proc.returncode == 2, err
    assert err.startswith("zerofit generate: error: ") and "\n" not in err and "Traceback" not in err, err
    assert f"{out} is a zerofit export" in err and f"pickled weights ({pickle})" in err
    assert "delete or move it" in err and not ran.exists()
    shutil.rmtree(out)
