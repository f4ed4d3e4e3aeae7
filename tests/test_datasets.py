"""Published math data as it is distributed (GSM8K, MATH, DAPO, AIME) in every form drmas
reads: JSON Lines and Parquet files, Parquet shards in a folder as the hub ships them, and a
``datasets`` ``save_to_disk`` folder (read without the ``datasets`` package); and an
evaluation over a mixed file reported per source.

Every file is written here, in the published layout (column names, nesting, types, file
names), from rows shaped as the published ones; nothing is downloaded. The ``save_to_disk``
layout is written by hand with pyarrow, and checked against the real ``datasets`` package
where it is installed.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.ipc as paipc
import pyarrow.parquet as pq
import pytest

from drmas.config import DataConfig
from drmas.stages.evaluate import source_label, success_at_k
from drmas.tasks import DataError, Question
from drmas.tasks.files import default_source
from drmas.tasks.math import load_math_questions, math_reward
from drmas.tasks.search.corpus import load_qa
from drmas.team.episodes import Episode

GSM8K_TRAIN = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
        "How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
    },
    {
        "question": "A farm has 1,000 hens and buys 234 more. How many hens does it have?",
        "answer": "It has 1,000 + 234 = <<1000+234=1234>>1,234 hens.\n#### 1,234",
    },
    {
        "question": "Weng earns $12 an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
        "How much did she earn?",
        "answer": "Weng earns 12/60 = $<<12/60=0.2>>0.2 per minute.\nWorking 50 minutes, she earned "
        "0.2 x 50 = $<<0.2*50=10>>10.\n#### 10",
    },
]
GSM8K_TEST = [
    {
        "question": "Janet's ducks lay 16 eggs per day. She eats three and bakes with four. She sells the rest "
        "for $2 each. How much does she make every day?",
        "answer": "She sells 16 - 3 - 4 = <<16-3-4=9>>9 eggs.\nShe makes 9 * 2 = $<<9*2=18>>18.\n#### 18",
    }
]
GSM8K_GOLD = [("72",), ("1234",), ("10",)]

MATH_TRAIN = [
    {
        "problem": "If $x^2+y^2=1$, what is the largest possible value of $|x|+|y|$?",
        "level": "Level 5",
        "type": "Algebra",
        "solution": r"If $(x,y)$ lies on the circle, so does $(x,-y)$, ... so the answer is $\boxed{\sqrt{2}}$.",
    },
    {
        "problem": "Two fair coins are flipped. What is the probability that both show heads?",
        "level": "Level 1",
        "type": "Counting & Probability",
        "solution": r"Each coin is heads with probability $\boxed{\frac12}$ first, so both: $\boxed{\frac{1}{4}}$.",
    },
    {
        "problem": "What is $1+2$?",
        "level": "Level 1",
        "type": "Prealgebra",
        "solution": r"We have $1+2=\fbox{3}$.",
    },
]
MATH_TEST = [
    {
        "problem": "Compute $\\dbinom{5}{2}$.",
        "level": "Level 2",
        "type": "Counting & Probability",
        "solution": r"$\dbinom{5}{2} = \frac{5 \times 4}{2} = \boxed{10}$.",
    }
]

DAPO = [
    {
        "data_source": "math_dapo",
        "prompt": [
            {
                "content": "Solve the following math problem step by step. The last line of your response should be "
                "of the form Answer: $Answer\n\nIn triangle $ABC$, $AB = 5$ ...\n\nRemember to put your answer on its "
                'own line after "Answer:".',
                "role": "user",
            }
        ],
        "ability": "MATH",
        "reward_model": {"ground_truth": "34", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "9a9b6eb4-a1cb-49d1-8c1e-62eaf2f74079"},
    },
    {
        "data_source": "math_dapo",
        "prompt": [{"content": "Let $f(x) = 2x$. Find $f(f(3))$.", "role": "user"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "12", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "b426d104-244e-4831-a2c4-cd756b61700a"},
    },
]

AIME_2024 = pa.table(
    {
        "ID": ["2024-I-1", "2024-II-4"],
        "Problem": [
            "Every morning Aya goes for a $9$-kilometer-long walk ... Find the number of minutes the walk takes her.",
            "Let $x,y$ and $z$ be positive real numbers ... Find $m+n$.",
        ],
        "Solution": [r"... so the answer is $\boxed{204}$.", r"... $\boxed{033}$"],
        "Answer": pa.array([204, 33], pa.int64()),
    }
)


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return str(path)


def _parquet(path: Path, rows: list[dict] | pa.Table) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(rows if isinstance(rows, pa.Table) else pa.Table.from_pylist(rows), path)
    return str(path)


def save_to_disk(folder: Path, rows: list[dict], shards: int = 1, split: str | None = None) -> Path:
    """A Dataset as ``datasets``' ``save_to_disk`` writes it: ``data-0000i-of-0000n.arrow``
    files (Arrow IPC streams of contiguous rows), ``state.json`` listing them under
    ``_data_files``, and ``dataset_info.json``."""
    folder.mkdir(parents=True)
    table = pa.Table.from_pylist(rows)
    names, start = [], 0
    for index in range(shards):
        size = len(rows) // shards + (index < len(rows) % shards)
        names.append(f"data-{index:05d}-of-{shards:05d}.arrow")
        with pa.OSFile(str(folder / names[-1]), "wb") as sink, paipc.new_stream(sink, table.schema) as writer:
            writer.write_table(table.slice(start, size))
        start += size
    state = {
        "_data_files": [{"filename": name} for name in names],
        "_fingerprint": "4e1ba5bc3f1cbd3a",
        "_format_columns": None,
        "_format_kwargs": {},
        "_format_type": None,
        "_output_all_columns": False,
        "_split": split,
    }
    (folder / "state.json").write_text(json.dumps(state, indent=2, sort_keys=True))
    (folder / "dataset_info.json").write_text(json.dumps({"citation": "", "description": "", "license": ""}))
    return folder


def save_dict_to_disk(folder: Path, splits: dict[str, list[dict]], shards: int = 1) -> str:
    """A DatasetDict as ``save_to_disk`` writes it: ``dataset_dict.json`` and a folder per split."""
    for name, rows in splits.items():
        save_to_disk(folder / name, rows, shards, split=name)
    (folder / "dataset_dict.json").write_text(json.dumps({"splits": list(splits)}))
    return str(folder)


@pytest.fixture
def without_datasets(monkeypatch):
    """``import datasets`` fails, as where the package is not installed."""
    monkeypatch.setitem(sys.modules, "datasets", None)


def _load(spec: str, split: str = "train", data: DataConfig | None = None) -> list[Question]:
    return load_math_questions(spec, split, data or DataConfig(), 0)  # type: ignore[arg-type]


def _error(spec: str, split: str = "train", data: DataConfig | None = None) -> str:
    with pytest.raises(DataError) as error:
        _load(spec, split, data)
    return str(error.value)


# --------------------------------------------------------------------------------------
# GSM8K: '#### 72' after the working, thousands commas
# --------------------------------------------------------------------------------------


def test_gsm8k_jsonl_and_the_hubs_parquet_folder_read_the_same(tmp_path):
    """The original JSON Lines and the hub's ``main/{split}-00000-of-00001.parquet``: the
    number after ``####`` without commas; the folder's splits by data.*_split."""
    jsonl = load_math_questions(
        _jsonl(tmp_path / "grade_school_math/train.jsonl", GSM8K_TRAIN), "train", DataConfig(), 0
    )
    assert [q.answers for q in jsonl] == GSM8K_GOLD and {q.data_source for q in jsonl} == {"grade_school_math"}
    main = tmp_path / "gsm8k" / "main"
    _parquet(main / "train-00000-of-00001.parquet", GSM8K_TRAIN)
    _parquet(main / "test-00000-of-00001.parquet", GSM8K_TEST)
    train = _load(str(main))
    assert [(q.question, q.answers) for q in train] == [(q.question, q.answers) for q in jsonl]
    assert {q.data_source for q in train} == {"gsm8k"}  # 'main' names the hub config, not the set
    assert [q.answers for q in _load(str(main), "eval")] == [("18",)]
    assert [q.answers for q in _load(str(main), "eval", DataConfig(eval_split="train"))] == GSM8K_GOLD


def test_a_folder_whose_split_is_in_several_configs_names_them(tmp_path):
    root = tmp_path / "gsm8k"
    for config in ("main", "socratic"):
        _parquet(root / config / "train-00000-of-00001.parquet", GSM8K_TRAIN)
    assert _error(str(root)) == (
        f"{root}: split 'train' is in several folders (main, socratic: main/train-00000-of-00001.parquet, "
        "socratic/train-00000-of-00001.parquet); name the folder to read"
    )


def test_a_missing_split_names_the_splits_and_their_files(tmp_path):
    main = tmp_path / "main"
    _parquet(main / "train-00000-of-00001.parquet", GSM8K_TRAIN)
    _parquet(main / "test-00000-of-00001.parquet", GSM8K_TEST)
    assert _error(str(main), "eval", DataConfig(eval_split="validation")) == (
        f"{main}: no split 'validation' (data.eval_split); its splits: "
        "test (test-00000-of-00001.parquet); train (train-00000-of-00001.parquet)"
    )


# --------------------------------------------------------------------------------------
# MATH: problem and solution (its last box), level and type
# --------------------------------------------------------------------------------------


@pytest.fixture
def math_folder(tmp_path) -> Path:
    """The hub's conversion of MATH: ``data/`` with hashed shard names, two train shards."""
    data = tmp_path / "competition_math" / "data"
    _parquet(data / "train-00000-of-00002-7320a6f3aba8ebd2.parquet", MATH_TRAIN[:2])
    _parquet(data / "train-00001-of-00002-6b5c3d2e1f0a9b8c.parquet", MATH_TRAIN[2:])
    _parquet(data / "test-00000-of-00001-29ebb4ab3aa5c8a2.parquet", MATH_TEST)
    (tmp_path / "competition_math" / "README.md").write_text("---\nlicense: mit\n---\n")
    (tmp_path / "competition_math" / ".gitattributes").write_text("*.parquet filter=lfs\n")
    return tmp_path / "competition_math"


def test_math_shards_read_problem_and_the_last_boxed_answer(math_folder):
    """With the default fields, ``problem`` and ``solution`` are recognised; the answer is
    the last box (``\\fbox`` too); ``data.data_source_field: type`` reports per subject."""
    questions = _load(str(math_folder), data=DataConfig(data_source_field="type"))
    assert questions == [
        Question("0", MATH_TRAIN[0]["problem"], (r"\sqrt{2}",), "Algebra", MATH_TRAIN[0]["solution"].strip()),
        Question(
            "1",
            MATH_TRAIN[1]["problem"],
            (r"\frac{1}{4}",),
            "Counting & Probability",
            MATH_TRAIN[1]["solution"].strip(),
        ),
        Question("2", MATH_TRAIN[2]["problem"], ("3",), "Prealgebra", MATH_TRAIN[2]["solution"].strip()),
    ]
    [test] = _load(str(math_folder), "eval")
    assert (test.answers, test.data_source) == (("10",), "competition_math")
    assert math_reward(r"so \boxed{0.25}", questions[1]) == 1.0


def test_a_bad_row_in_a_shard_names_the_shard_and_the_row(math_folder):
    shard = math_folder / "data" / "train-00001-of-00002-6b5c3d2e1f0a9b8c.parquet"
    _parquet(shard, [{**MATH_TRAIN[2], "solution": r"We have $1+2=\boxed{3$."}])  # the box never closes
    label = "data/train-00001-of-00002-6b5c3d2e1f0a9b8c.parquet: row 0"
    assert _error(str(math_folder)) == f"{math_folder}: {label}: missing or empty answer ('solution')"


def test_a_missing_shard_is_named(math_folder):
    (math_folder / "data" / "train-00001-of-00002-6b5c3d2e1f0a9b8c.parquet").unlink()
    assert _error(str(math_folder)) == f"{math_folder}: 1 of 2 shards; missing: train-00001-of-00002"


def test_explicit_fields_are_never_replaced_and_a_failure_names_the_columns(math_folder, tmp_path):
    """A field set in the config is read or fails; only a default one falls back, and then
    the message lists the columns and the forms tried."""
    assert _error(str(math_folder), data=DataConfig(question_field="query")) == (
        f"{math_folder}: no question column 'query' (set data.question_field); columns: level, problem, solution, type"
    )
    odd = _jsonl(tmp_path / "odd.jsonl", [{"prompt": "Q: 1+1? A:", "target": "2"}])
    assert _error(odd) == (
        f"{odd}: no question column 'question' (set data.question_field); columns: prompt, target; "
        "nor any of its published forms: problem, Problem, prompt"
    )  # a plain prompt string is no question: it is often already templated


# --------------------------------------------------------------------------------------
# DAPO: a chat prompt and reward_model.ground_truth
# --------------------------------------------------------------------------------------


def test_dapo_reads_with_the_default_fields_as_a_file_and_as_its_repository(tmp_path):
    path = tmp_path / "DAPO-Math-17k" / "data" / "dapo-math-17k.parquet"
    _parquet(path, DAPO)
    (tmp_path / "DAPO-Math-17k" / "dataset_infos.json").write_text('{"default": {"features": {}}}')  # no rows
    expected = [
        Question("0", DAPO[0]["prompt"][0]["content"], ("34",), "math_dapo"),
        Question("1", "Let $f(x) = 2x$. Find $f(f(3))$.", ("12",), "math_dapo"),
    ]
    assert _load(str(path)) == expected
    assert _load(str(tmp_path / "DAPO-Math-17k"), "eval") == expected  # its one split, whatever its name


@pytest.mark.parametrize(
    ("name", "folder", "source"),
    [
        ("/data/gsm8k/main", True, "gsm8k"),
        ("/data/grade_school_math/test.jsonl", False, "grade_school_math"),
        ("/data/gsm8k/main/train-00000-of-00001.parquet", False, "gsm8k"),
        (f"/hf/hub/datasets--openai--gsm8k/snapshots/{'a' * 40}/main", True, "gsm8k"),
        ("s3://bucket/gsm8k/test.jsonl", False, "gsm8k"),
        ("s3://bucket/test.jsonl", False, "test"),  # a bucket names no data set
        ("/data/AIME_2024/aime_2024_problems.parquet", False, "aime_2024_problems"),
        ("/data/gsm8k_disk", True, "gsm8k_disk"),
    ],
)
def test_a_rows_default_source_names_the_set_not_its_split(name, folder, source):
    """The eval's per-source metrics are named by it: ``eval/test/...`` would say nothing."""
    assert default_source(name, folder) == source


# --------------------------------------------------------------------------------------
# AIME: capitalised Problem and Answer, integer answers
# --------------------------------------------------------------------------------------


def test_aime_2024_parquet_with_integer_answers(tmp_path):
    path = _parquet(tmp_path / "AIME_2024" / "aime_2024_problems.parquet", AIME_2024)
    questions = _load(path, "eval")
    assert [(q.question[:20], q.answers, q.data_source) for q in questions] == [
        ("Every morning Aya go", ("204",), "aime_2024_problems"),
        ("Let $x,y$ and $z$ be", ("33",), "aime_2024_problems"),
    ]
    assert math_reward(r"\boxed{033}", questions[1]) == 1.0 and math_reward(r"\boxed{34}", questions[1]) == 0.0
    in_folder = _load(str(tmp_path / "AIME_2024"), "eval")  # the repository folder: its name is the source
    assert [(q.qid, q.question, q.answers, q.data_source) for q in in_folder] == [
        (q.qid, q.question, q.answers, "AIME_2024") for q in questions
    ]


def test_aime_2025_jsonl_with_lowercase_fields(tmp_path):
    rows = [{"id": "2025-I-1", "problem": "Find the sum of all integer bases $b>9$ ...", "answer": 70}]
    spec = _jsonl(tmp_path / "aime2025-I.jsonl", rows)
    assert _load(spec, "eval") == [Question("2025-I-1", rows[0]["problem"], ("70",), "aime2025-I")]


# --------------------------------------------------------------------------------------
# save_to_disk folders, read without the datasets package
# --------------------------------------------------------------------------------------


def test_a_dataset_dict_saved_to_disk_reads_each_split(tmp_path, without_datasets):
    spec = save_dict_to_disk(tmp_path / "gsm8k_disk", {"train": GSM8K_TRAIN, "test": GSM8K_TEST}, shards=2)
    assert (tmp_path / "gsm8k_disk" / "train" / "data-00001-of-00002.arrow").is_file()
    train = _load(spec)
    assert [q.answers for q in train] == GSM8K_GOLD and [q.qid for q in train] == ["0", "1", "2"]
    assert {q.data_source for q in train} == {"gsm8k_disk"}
    assert [q.answers for q in _load(spec, "eval")] == [("18",)]
    assert _error(spec, "eval", DataConfig(eval_split="validation")) == (
        f"{spec}: no split 'validation' (data.eval_split); its splits: test, train"
    )
    assert load_qa(spec, "eval", DataConfig(), 0)[0].answers == (GSM8K_TEST[0]["answer"],)  # the task's own gold


def test_one_dataset_saved_to_disk_with_nested_columns(tmp_path, without_datasets):
    spec = str(save_to_disk(tmp_path / "dapo_disk", DAPO, shards=2))
    assert [(q.answers, q.data_source) for q in _load(spec)] == [(("34",), "math_dapo"), (("12",), "math_dapo")]


def test_a_damaged_save_to_disk_folder_names_the_file(tmp_path):
    folder = save_to_disk(tmp_path / "ds", GSM8K_TRAIN, shards=2)
    (folder / "data-00001-of-00002.arrow").write_bytes(b"not arrow")
    assert _error(str(folder)).startswith(f"{folder / 'data-00001-of-00002.arrow'}: not a readable Arrow stream")
    (folder / "data-00001-of-00002.arrow").unlink()
    assert _error(str(folder)) == f"{folder / 'state.json'}: lists data-00001-of-00002.arrow, which is missing"
    (folder / "state.json").write_text('{"_data_files": "data-00000-of-00002.arrow"}')
    assert _error(str(folder)).startswith(
        f"{folder / 'state.json'}: no list of {{'filename': ...}} under '_data_files'"
    )


def test_a_folder_without_data_says_what_it_holds(tmp_path):
    (tmp_path / "empty" / "notes").mkdir(parents=True)
    (tmp_path / "empty" / "README.md").write_text("nothing")
    assert _error(str(tmp_path / "empty")).endswith("; it holds: README.md")
    assert _error(str(tmp_path / "absent")) == f"{tmp_path / 'absent'}: no such file or folder"


def test_the_layout_is_the_datasets_packages_own(tmp_path):
    """The real ``save_to_disk`` (where ``datasets`` is installed) reads as the hand-written
    layout, and ``datasets`` loads the hand-written one: the layout here is the real one."""
    datasets = pytest.importorskip("datasets")
    written = save_dict_to_disk(tmp_path / "by_hand", {"train": MATH_TRAIN, "test": MATH_TEST}, shards=2)
    real = datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(MATH_TRAIN), "test": datasets.Dataset.from_list(MATH_TEST)}
    )
    real.save_to_disk(str(tmp_path / "by_datasets"), num_shards={"train": 2, "test": 1})
    for split in ("train", "eval"):
        ours = [(q.question, q.answers) for q in _load(written, split)]
        assert [(q.question, q.answers) for q in _load(str(tmp_path / "by_datasets"), split)] == ours
    assert datasets.load_from_disk(written)["train"].to_list() == MATH_TRAIN


# --------------------------------------------------------------------------------------
# Evaluation per source over a mixed file
# --------------------------------------------------------------------------------------


def test_an_eval_over_a_mixed_file_reports_each_source(tmp_path):
    """GSM8K, MATH and AIME rows in one file (as veRL-style preprocessing writes them: one
    answer column holding each set's own gold form) are scored by the evaluate stage's
    aggregation per source, under names MLflow accepts (``source_label``).

    By hand, k = 2 episodes per question:
      gsm8k  q0 [1, 1], q1 [0, 1]  -> avg (1 + 0.5) / 2 = 0.75, pass 1.0
      MATH (Counting & Probability) q2 [0, 0] -> avg 0, pass 0
      aime   q3 [1, 0]              -> avg 0.5, pass 1
      all: avg (1 + 0.5 + 0 + 0.5) / 4 = 0.5, pass 3 / 4
    """
    rows = [
        {**GSM8K_TRAIN[0], "data_source": "openai/gsm8k"},
        {**GSM8K_TRAIN[1], "data_source": "openai/gsm8k"},
        {
            "question": MATH_TRAIN[1]["problem"],
            "answer": MATH_TRAIN[1]["solution"],
            "data_source": "Counting & Probability",
        },
        {"question": "AIME 2024 I-1", "answer": 204, "data_source": "aime"},
    ]
    questions = _load(_jsonl(tmp_path / "mixed.jsonl", rows), "eval")
    assert [q.answers for q in questions] == [("72",), ("1234",), (r"\frac{1}{4}",), ("204",)]
    responses = [
        [r"\boxed{72}", r"\boxed{72.0}"],
        [r"\boxed{1243}", r"\boxed{1,234}"],
        [r"\boxed{1/2}", "0.25"],  # wrong, then unboxed
        [r"\boxed{204}", r"\boxed{240}"],
    ]
    episodes = [
        Episode(q.qid, f"{q.qid}-{j}", j, q, reward=math_reward(text, q), success=math_reward(text, q) == 1.0)
        for q, texts in zip(questions, responses, strict=True)
        for j, text in enumerate(texts)
    ]
    metrics = success_at_k(episodes, 2)
    assert metrics == {
        "eval/avg_at_2": 0.5,
        "eval/pass_at_2": 0.75,
        "eval/questions": 4.0,
        "eval/Counting _ Probability/avg_at_2": 0.0,
        "eval/Counting _ Probability/pass_at_2": 0.0,
        "eval/Counting _ Probability/questions": 1.0,
        "eval/aime/avg_at_2": 0.5,
        "eval/aime/pass_at_2": 1.0,
        "eval/aime/questions": 1.0,
        "eval/openai_gsm8k/avg_at_2": 0.75,
        "eval/openai_gsm8k/pass_at_2": 1.0,
        "eval/openai_gsm8k/questions": 2.0,
    }


@pytest.mark.slow  # importing mlflow takes seconds on two cores
def test_every_source_label_is_a_metric_name_mlflow_accepts():
    """Sources as data may name them; one name MLflow refuses would lose the step's metrics."""
    from mlflow.utils.validation import _validate_metric_name

    sources = ["gsm8k", "Counting & Probability", "openai/gsm8k", "..", ".", " ", "Level 5", "a:b", "x?y#z", "日本"]
    for source in sources:
        _validate_metric_name(f"eval/{source_label(source)}/avg_at_4")  # raises for a name MLflow refuses
    assert source_label("Level 5") == "Level 5" and source_label("..") == "__"
