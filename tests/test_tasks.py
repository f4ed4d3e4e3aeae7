"""drmas.tasks: the task registry, the one question-file reader, and a third task (the
example of docs/tasks.md) run through the rollout stage without a change to drmas."""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import uuid
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest

from drmas.config import ConfigError, DataConfig, DrmasConfig, StoreConfig, load_config
from drmas.generation.workers import GenerationResult
from drmas.infra import store as store_module
from drmas.infra.schema import TRAJECTORY_SCHEMA
from drmas.infra.store import Store
from drmas.registry import BUILTIN_TASKS, get_task
from drmas.stages.policies import tokenizer_corpus
from drmas.stages.rollout import rollout, task_questions
from drmas.tasks import DataError, Question, Task, files, task_for
from drmas.tasks.files import read_questions
from drmas.tasks.math import MathTask, load_math_questions
from drmas.tasks.search.corpus import corpus_hash_for, iter_corpus, load_corpus, load_qa
from drmas.tasks.search.task import SearchTask

ROOT = Path(__file__).parent.parent
CONFIGS = ROOT / "configs"
LOADERS = {"math": load_math_questions, "search": load_qa}
"""Both tasks' question loaders: a file must read the same through either."""


# --------------------------------------------------------------------------------------
# The registry
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "task_class", "default_data"),
    [("math", MathTask, "generated:arithmetic"), ("search", SearchTask, "generated:facts")],
)
def test_builtin_tasks_by_name(name, task_class, default_data):
    task = get_task(name)
    assert type(task) is task_class and isinstance(task, Task)
    assert (task.default_data, task.default_orchestra) == (default_data, name)


@pytest.mark.parametrize("config_file", ["math_tiny.yaml", "search_tiny.yaml", "math_solo_tiny.yaml"])
def test_the_config_asks_its_task_for_defaults(config_file):
    config = load_config(CONFIGS / config_file, ["data.train=null", "data.eval=null"])
    task = task_for(config)
    assert type(task) is type(get_task(config.task.name))
    assert config.data_spec("train") == config.data_spec("eval") == task.default_data
    assert config.task.orchestra_name == (config.task.orchestra or task.default_orchestra)


def test_unknown_and_unimportable_tasks_are_named():
    known = ", ".join(sorted(BUILTIN_TASKS))
    with pytest.raises(ValueError, match=re.escape(f"unknown task 'maths': use one of {known}, or an import path")):
        get_task("maths")
    with pytest.raises(ValueError, match=r"cannot import task 'no_such_module:Task': No module named 'no_such_module'"):
        get_task("no_such_module:Task")
    with pytest.raises(ValueError, match=r"cannot import task 'drmas.tasks.math:NoTask'"):
        get_task("drmas.tasks.math:NoTask")


def test_the_config_refuses_an_unknown_task_by_its_field():
    with pytest.raises(
        ConfigError, match=re.escape("override task.name: unknown task 'maths': use one of math, search")
    ):
        load_config(CONFIGS / "math_tiny.yaml", ["task.name=maths"])


def test_the_builtin_rewards_are_the_tasks_own():
    question = Question("q", "What is 3 + 4?", ("7",), "t")
    assert get_task("math").reward("so \\boxed{7}", question) == 1.0
    assert get_task("math").reward("7", question) == 0.0  # math wants a boxed answer
    assert get_task("search").reward("7", question) == 1.0
    assert get_task("search").reward(None, question) == 0.0


def test_a_task_without_tools_or_corpus_says_so():
    config = load_config(CONFIGS / "math_tiny.yaml")
    assert get_task("math").tools(config, Store("unused")).retriever is None
    assert get_task("math").corpus(config) == []


def test_the_search_corpus_is_the_retrieved_passages():
    config = load_config(CONFIGS / "search_tiny.yaml")
    corpus = get_task("search").corpus(config)
    answers = {answer for question in get_task("search").questions(config, "train") for answer in question.answers}
    assert corpus and all(any(answer in text for text in corpus) for answer in list(answers)[:50])


# --------------------------------------------------------------------------------------
# The shared question-file reader: formats
# --------------------------------------------------------------------------------------

ROWS = [
    {"id": "a", "question": "Who?", "answer": ["Ann"], "data_source": "nq"},
    {"question": " What? ", "answer": ["x", "y"]},
]
EXPECTED = [Question("a", "Who?", ("Ann",), "nq"), Question("1", "What?", ("x", "y"), "qa")]


def _jsonl_bytes(rows: list[object]) -> bytes:
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def _write(path: Path, content: bytes | list[dict] | pa.Table) -> str:
    if isinstance(content, pa.Table):
        pq.write_table(content, path)
    else:
        path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    return str(path)


def _both(spec: str, data: DataConfig | None = None, store: StoreConfig | None = None) -> list[Question]:
    """The questions of ``spec`` as both tasks read them (they must agree)."""
    math, search = (load(spec, "train", data or DataConfig(), 0, store) for load in LOADERS.values())
    assert math == search
    return math


FORMATS = [
    ("qa.jsonl", _jsonl_bytes(ROWS)),
    ("qa.jsonl", b"\xef\xbb\xbf" + _jsonl_bytes(ROWS[:1]) + b"\n  \n" + _jsonl_bytes(ROWS[1:])),  # BOM, blank line
    ("qa.json", ROWS),  # a JSON list (MATH-500)
    ("qa.json", _jsonl_bytes(ROWS)),  # JSON Lines named .json (Search-R1)
    ("qa.parquet", pa.Table.from_pylist(ROWS)),
]


@pytest.mark.parametrize(("name", "content"), FORMATS)
def test_every_format_reads_the_same_questions(tmp_path, name, content):
    assert _both(_write(tmp_path / name, content)) == EXPECTED


def test_a_json_file_with_one_object_is_one_line_of_json_lines(tmp_path):
    spec = _write(tmp_path / "qa.json", json.dumps(ROWS[0]).encode())
    assert _both(spec) == EXPECTED[:1]


def test_fields_may_be_nested_or_have_dots_and_questions_may_be_chats(tmp_path):
    rows = [
        {"prompt": [{"role": "user", "content": "Q1"}], "reward_model": {"ground_truth": "1"}, "src.name": "s"},
        {
            "prompt": [{"role": "system", "content": "x"}, {"role": "user", "content": "Q2"}],
            "reward_model": {"ground_truth": "2"},
            "src.name": 7,
        },
    ]
    data = DataConfig(question_field="prompt", answer_field="reward_model.ground_truth", data_source_field="src.name")
    spec = _write(tmp_path / "dapo.jsonl", _jsonl_bytes(rows))
    assert _both(spec, data) == [Question("0", "Q1", ("1",), "s"), Question("1", "Q2", ("2",), "7")]


def test_each_task_reads_its_own_gold_answers(tmp_path):
    spec = _write(tmp_path / "qa.jsonl", _jsonl_bytes([{"question": "q", "answer": "work\n#### 1,072"}]))
    assert read_questions(spec, DataConfig(), lambda value: (value.upper(),))[0].answers == ("WORK\n#### 1,072",)
    assert load_math_questions(spec, "train", DataConfig(), 0)[0].answers == ("1072",)  # GSM8K
    assert load_qa(spec, "train", DataConfig(), 0)[0].answers == ("work\n#### 1,072",)


# --------------------------------------------------------------------------------------
# The shared question-file reader: every error names the file, the line or row, the problem
# --------------------------------------------------------------------------------------

BAD_FILES = [
    (
        "qa.csv",
        b"question,answer\n",
        "unsupported file type '.csv'; use one of .jsonl, .json, .parquet, or a dataset folder",
    ),
    ("qa", b"{}", "unsupported file type '(none)'; use one of .jsonl, .json, .parquet, or a dataset folder"),
    ("qa.jsonl", b"", "no rows"),
    ("qa.jsonl", b"\n  \n", "no rows"),
    ("qa.json", b"[]", "no rows"),
    ("qa.parquet", pa.table({"question": pa.array([], pa.string())}), "no rows"),
    ("qa.parquet", b"not parquet", "not a readable Parquet file ("),
    ("qa.jsonl", b'{"question": "caf\xe9"}\n', "not UTF-8 text (bad byte at offset 17) on line 1"),
    (
        "qa.jsonl",
        b'\xef\xbb\xbf{"question": "a"}\r\n{"question": "caf\xe9"}\n',
        "not UTF-8 text (bad byte at offset 39) on line 2",
    ),
    (
        "qa.json",
        b'[{"question": "a", "answer": "1"},\n{"question": "caf\xe9"}]',
        "not UTF-8 text (bad byte at offset 52) on line 2",
    ),
    ("qa.jsonl", _jsonl_bytes(ROWS[:1]) + b'{"question": \n', "line 2: invalid JSON (Expecting value)"),
    ("qa.json", b'[\n{"question": "a",\n', "line 3: invalid JSON (Expecting property name enclosed in double quotes)"),
    ("qa.jsonl", b'["question"]\n', "line 1: expected a JSON object, got list"),
    ("qa.json", b'[{"question": "a", "answer": "1"}, 5]', "row 1: expected a JSON object, got int"),
    (
        "qa.jsonl",
        _jsonl_bytes([{"query": "p", "answer": "1"}]),
        "no question column 'question' (set data.question_field); columns: answer, query; "
        "nor any of its published forms: problem, Problem, prompt",
    ),
    (
        "qa.jsonl",
        _jsonl_bytes([{"question": "q", "answer": None, "reward_model": {"style": "rule"}}]),
        "no answer column 'answer' (set data.answer_field); columns: answer, question, reward_model; "
        "nor any of its published forms: Answer, golden_answers, reward_model.ground_truth, solution",
    ),
    (
        "qa.jsonl",
        _jsonl_bytes([ROWS[0], {"question": "  ", "answer": "2"}]),
        "row 1 (line 2): empty or missing question ('question')",
    ),
    (
        "qa.jsonl",
        _jsonl_bytes([{"question": 5, "answer": "2"}]),
        "row 0 (line 1): empty or missing question ('question': int 5, not text)",
    ),
    ("qa.json", [ROWS[0], {"question": "b"}], "row 1: missing or empty answer ('answer')"),
    (
        "qa.parquet",
        pa.table({"question": ["a?", None], "answer": ["x", "y"]}),
        "row 1: empty or missing question ('question')",
    ),
    ("qa.jsonl", _jsonl_bytes([ROWS[0], ROWS[1], ROWS[0]]), "duplicated id 'a' (row 0 (line 1) and row 2 (line 3))"),
]


@pytest.mark.parametrize(
    ("task", "name", "content", "message"), [(task, *bad) for task in LOADERS for bad in BAD_FILES]
)
def test_bad_files_fail_with_one_message_per_problem(tmp_path, task, name, content, message):
    spec = _write(tmp_path / name, content)
    with pytest.raises(DataError) as error:
        LOADERS[task](spec, "train", DataConfig(), 0)
    assert str(error.value).startswith(f"{spec}: {message}")
    assert message.endswith("(") or str(error.value) == f"{spec}: {message}"


@pytest.mark.parametrize("task", LOADERS)
def test_missing_and_remote_files(tmp_path, task):
    absent = str(tmp_path / "absent.jsonl")
    with pytest.raises(DataError, match=f"^{re.escape(absent)}: file not found$"):
        LOADERS[task](absent, "train", DataConfig(), 0)
    with pytest.raises(
        DataError,
        match=r"^gs://bucket/qa\.jsonl: only local files and s3:// objects are supported; copy the file here first$",
    ):
        LOADERS[task]("gs://bucket/qa.jsonl", "train", DataConfig(), 0)
    for uri in ("s3://Bad_Bucket/qa.jsonl", "s3://no-key.jsonl"):
        with pytest.raises(DataError, match=f"^{re.escape(uri)}: not s3://bucket/key "):
            LOADERS[task](uri, "train", DataConfig(), 0)


# --------------------------------------------------------------------------------------
# The same files on S3 (the real SeaweedFS server of the fixtures)
# --------------------------------------------------------------------------------------

S3_BUCKET = "drmas-test"
CORPUS = (
    b"\xef\xbb\xbf"
    + _jsonl_bytes(
        [{"id": "d1", "contents": '"Zorbania"\nZorbania is a country.'}, {"title": "Qu\u00e9llin", "text": "A city."}]
    )
    + b"\r\n  \n"
    + _jsonl_bytes([{"text": "caf\u00e9 \u2603 " + "long " * 40}])
    + b'{"id": 7, "text": "no newline at the end"}'
)
"""A corpus with a byte-order mark, ids and line numbers, a CRLF and a blank line, text
beyond ASCII, a line longer than a read, and no final newline."""


@pytest.fixture
def s3_data(s3_env, monkeypatch):
    """Upload to the S3 server: ``upload(name, content) -> s3://...``; reads in 7-byte
    chunks, so that lines, characters and byte-order marks straddle them."""
    monkeypatch.setattr(files, "S3_CHUNK_BYTES", 7)
    fs = pafs.S3FileSystem(
        endpoint_override=s3_env.endpoint.removeprefix("http://"),
        scheme="http",
        access_key=s3_env.access_key,
        secret_key=s3_env.secret_key,
        region="us-east-1",
    )
    prefix = f"{S3_BUCKET}/data-{uuid.uuid4().hex}"

    def upload(name: str, content: bytes | list[dict] | pa.Table) -> str:
        if isinstance(content, pa.Table):
            pq.write_table(content, f"{prefix}/{name}", filesystem=fs)
        else:
            with fs.open_output_stream(f"{prefix}/{name}") as out:
                out.write(content if isinstance(content, bytes) else json.dumps(content).encode())
        return f"s3://{prefix}/{name}"

    return upload


@pytest.mark.s3
@pytest.mark.parametrize(("name", "content"), FORMATS)
def test_question_files_on_s3_read_as_the_local_ones(s3_env, s3_data, tmp_path, name, content):
    store = StoreConfig(endpoint=s3_env.endpoint)
    local = _both(_write(tmp_path / name, content))
    assert _both(s3_data(name, content), store=store) == local == EXPECTED


@pytest.mark.s3
@pytest.mark.parametrize(("name", "content", "message"), BAD_FILES)
def test_bad_question_files_on_s3_fail_as_the_local_ones(s3_env, s3_data, tmp_path, name, content, message):
    """The same message, the URI for the path: file, then line or row, then the problem."""
    spec, uri = _write(tmp_path / name, content), s3_data(name, content)
    with pytest.raises(DataError) as local:
        load_math_questions(spec, "train", DataConfig(), 0)
    with pytest.raises(DataError) as remote:
        load_math_questions(uri, "train", DataConfig(), 0, StoreConfig(endpoint=s3_env.endpoint))
    if message.endswith("("):  # then pyarrow's own words, which name a local file's path
        assert str(remote.value).startswith(f"{uri}: {message}") and str(local.value).startswith(f"{spec}: {message}")
    else:
        assert str(remote.value) == str(local.value).replace(spec, uri, 1)


@pytest.mark.s3
def test_a_corpus_on_s3_loads_and_hashes_as_the_local_one(s3_env, s3_data, tmp_path):
    store = StoreConfig(endpoint=s3_env.endpoint)
    local, uri = _write(tmp_path / "corpus.jsonl", CORPUS), s3_data("corpus.jsonl", CORPUS)
    passages = load_corpus(local)
    assert [p.pid for p in passages] == ["d1", "2", "5", "7"]
    assert load_corpus(uri, store) == passages
    assert corpus_hash_for(DataConfig(corpus=uri), 0, store) == corpus_hash_for(DataConfig(corpus=local), 0)


@pytest.mark.s3
def test_a_corpus_on_s3_is_streamed(s3_env, s3_data, monkeypatch):
    """The first passage comes after the first reads, not after the whole object."""
    uri = s3_data("corpus.jsonl", CORPUS)
    reads = []
    read_at = store_module._read_at
    monkeypatch.setattr(store_module, "_read_at", lambda *args: reads.append(args[-1]) or read_at(*args))
    passages = iter_corpus(uri, StoreConfig(endpoint=s3_env.endpoint))
    assert next(passages).pid == "d1"
    assert reads == [7 * index for index in range(len(reads))]  # consecutive ranged reads
    assert 0 < len(reads) * 7 < len(CORPUS) / 2
    assert [p.pid for p in passages] == ["2", "5", "7"]
    assert reads == [7 * index for index in range(-(-len(CORPUS) // 7))]


@pytest.mark.s3
def test_an_object_cut_while_it_is_streamed_is_named(s3_env, s3_data):
    """Its size was read when it was opened; a shorter object after that is an error that
    says where it ended, not a corpus that silently lost its tail."""
    uri = s3_data("corpus.jsonl", CORPUS)
    found = files.open_location(uri, StoreConfig(endpoint=s3_env.endpoint))
    assert isinstance(found, files.DataFile) and found.size == len(CORPUS)
    longer = dataclasses.replace(found, size=len(CORPUS) + 5)  # as if it were cut after the size was read
    with pytest.raises(DataError, match=rf"^{re.escape(uri)}: ended at byte {len(CORPUS)} of {len(CORPUS) + 5} "):
        list(longer.lines())


@pytest.mark.s3
def test_a_config_with_s3_data_reads_it_with_the_store_settings(s3_env, s3_data):
    """The tasks pass ``config.store`` (endpoint, region) to the loaders; the environment
    names no endpoint here."""
    corpus_uri = s3_data("corpus.jsonl", CORPUS)
    questions_uri = s3_data("qa.parquet", pa.Table.from_pylist(ROWS))
    overrides = [f"store.endpoint={s3_env.endpoint}", f"data.corpus={corpus_uri}", f"data.train={questions_uri}"]
    config = load_config(CONFIGS / "search_tiny.yaml", overrides)
    assert task_questions(config, "train") == EXPECTED
    assert get_task("search").corpus(config) == [p.text for p in load_corpus(corpus_uri, config.store)]
    config = load_config(CONFIGS / "math_tiny.yaml", overrides[:1] + overrides[2:])
    assert task_questions(config, "train") == EXPECTED


@pytest.mark.s3
def test_dataset_folders_on_s3_read_as_the_local_ones(s3_env, s3_data, tmp_path):
    """Hub shards (one split chosen by name) and a save_to_disk DatasetDict (its Arrow
    stream files), uploaded under a prefix: the same questions as from a local copy; the
    folder's name is the default source."""
    store = StoreConfig(endpoint=s3_env.endpoint)
    train, test = pa.Table.from_pylist(ROWS), pa.table({"question": ["Why?"], "answer": ["because"]})
    files: dict[str, bytes | pa.Table] = {
        "hub/data/train-00000-of-00002.parquet": train.slice(0, 1),
        "hub/data/train-00001-of-00002.parquet": train.slice(1),
        "hub/data/test-00000-of-00001.parquet": test,
        "hub/README.md": b"---\nlicense: mit\n---\n",
        "disk/dataset_dict.json": b'{"splits": ["train", "test"]}',
    }
    for split, table in (("train", train), ("test", test)):
        stream = pa.BufferOutputStream()
        with pa.ipc.new_stream(stream, table.schema) as writer:
            writer.write_table(table)
        files[f"disk/{split}/data-00000-of-00001.arrow"] = stream.getvalue().to_pybytes()
        state = {"_data_files": [{"filename": "data-00000-of-00001.arrow"}], "_split": split}
        files[f"disk/{split}/state.json"] = json.dumps(state).encode()
    for name, content in files.items():
        local = tmp_path / name
        local.parent.mkdir(parents=True, exist_ok=True)
        uri = s3_data(name, content)
        _write(local, content)
    root = uri.rsplit("/disk/", 1)[0]
    for folder in ("hub", "disk"):
        for split in ("train", "eval"):
            remote = load_qa(f"{root}/{folder}/", split, DataConfig(), 0, store)
            assert remote == load_qa(str(tmp_path / folder), split, DataConfig(), 0)
            assert [q.answers for q in remote] == ([("Ann",), ("x", "y")] if split == "train" else [("because",)])
            assert {q.data_source for q in remote} <= {"nq", folder}
    missing = f"{root}/nothing-here"
    with pytest.raises(DataError, match=f"^{re.escape(missing)}: no such file or folder$"):
        load_qa(missing, "train", DataConfig(), 0, store)


@pytest.mark.s3
def test_the_s3_endpoint_may_come_from_the_environment(s3_env, s3_data, monkeypatch):
    monkeypatch.delenv("DRMAS_S3_ENDPOINT", raising=False)
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3_env.endpoint)
    uri = s3_data("corpus.jsonl", CORPUS)
    assert [p.pid for p in load_corpus(uri)] == ["d1", "2", "5", "7"]


@pytest.mark.s3
@pytest.mark.parametrize("task", LOADERS)
def test_a_missing_s3_object_or_bucket_names_the_uri(s3_env, s3_data, task):
    store = StoreConfig(endpoint=s3_env.endpoint)
    absent = s3_data("qa.jsonl", ROWS).replace("qa.jsonl", "absent.jsonl")
    with pytest.raises(DataError, match=f"^{re.escape(absent)}: file not found$"):
        LOADERS[task](absent, "train", DataConfig(), 0, store)
    with pytest.raises(DataError, match=f"^{re.escape(absent)}: file not found$"):
        load_corpus(absent, store)
    folder = absent.rsplit("/", 1)[0]  # a prefix of objects, not one
    with pytest.raises(DataError, match=f"^{re.escape(folder)}: file not found$"):
        load_corpus(folder, store)
    nowhere = "s3://no-such-bucket/qa.jsonl"
    with pytest.raises(DataError, match=f"^{re.escape(nowhere)}: bucket 'no-such-bucket' does not exist at "):
        LOADERS[task](nowhere, "train", DataConfig(), 0, store)


@pytest.mark.s3
def test_wrong_s3_credentials_fail_clearly_without_the_secret(s3_env, s3_data, monkeypatch, caplog):
    uri = s3_data("qa.jsonl", ROWS)
    wrong = "not-the-secret-" + uuid.uuid4().hex
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", wrong)
    caplog.set_level(logging.DEBUG)
    store = StoreConfig(endpoint=s3_env.endpoint)
    for load in (lambda: load_qa(uri, "train", DataConfig(), 0, store), lambda: load_corpus(uri, store)):
        with pytest.raises(DataError) as error:
            load()
        message = str(error.value)
        assert message.startswith(f"{uri}: S3 at {s3_env.endpoint} denied access")
        assert "check AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY" in message
        assert wrong not in message and s3_env.secret_key not in message
    assert wrong not in caplog.text and s3_env.secret_key not in caplog.text


# --------------------------------------------------------------------------------------
# A third task: the example of docs/tasks.md, run through the rollout stage
# --------------------------------------------------------------------------------------


def _docs_example() -> str:
    """The Python block of docs/tasks.md (there is exactly one)."""
    [code] = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "tasks.md").read_text(), re.DOTALL)
    return code


@pytest.fixture
def reverse_config(tmp_path, monkeypatch) -> DrmasConfig:
    """A config of the reverse task, its module written from the docs onto sys.path."""
    (tmp_path / "reverse_task.py").write_text(_docs_example())
    monkeypatch.syspath_prepend(str(tmp_path))
    overrides = [
        "task.name=reverse_task:ReverseTask",
        "task.orchestra=null",  # the task's own: ReverseOrchestra
        "agents=[{name: reverser, model: tiny}]",
        "data.train=null",
        "data.eval=null",
        "rollout.prompts_per_iteration=5",
        "rollout.group_size=2",
    ]
    return load_config(CONFIGS / "math_tiny.yaml", overrides)


class ReversingPool:
    """A pool at the engine boundary that reverses the word of every prompt, except the
    words in ``wrong`` (answered as they are)."""

    def __init__(self, wrong: set[str]) -> None:
        self.wrong = wrong

    def load(self, policies) -> None:
        pass

    def generate(self, wg, messages, sampling, seed):
        words = [re.search(r"Reverse the word (\w+)", message).group(1) for message in messages]
        texts = [f"<answer>{word if word in self.wrong else word[::-1]}</answer>" for word in words]
        return [GenerationResult([1, 2], [3], [-0.1], text, "stop") for text in texts]


def test_a_third_task_runs_through_the_rollout_stage(reverse_config, tmp_path):
    config = reverse_config
    assert config.data_spec("train") == "generated:words"
    assert config.task.orchestra_name == "reverse_task:ReverseOrchestra"
    train = task_questions(config, "train")
    assert [q.question for q in train] == ["apple", "stone", "light", "silver", "planet"]
    store = Store(str(tmp_path / "runs"))
    result = rollout(config, store, "reverse", 0, {}, ReversingPool(wrong={"stone"}))
    table = store.open(result.artifact).read_table("trajectories.parquet", TRAJECTORY_SCHEMA)
    assert set(table["agent"].to_pylist()) == {"reverser"}
    words = [text.removeprefix("<answer>").removesuffix("</answer>") for text in table["response_text"].to_pylist()]
    rewards = dict(zip(words, table["reward"].to_pylist(), strict=True))
    assert rewards == {"elppa": 1.0, "stone": 0.0, "thgil": 1.0, "revlis": 1.0, "tenalp": 1.0}
    assert table.num_rows == 10 and result.metrics["reward/mean"] == 0.8


def test_a_third_task_gives_the_tokenizer_and_the_warm_start_its_texts(reverse_config):
    texts = tokenizer_corpus(reverse_config)
    assert "window" in texts  # its corpus
    assert any("Reverse the word apple" in text for text in texts)  # its agent's prompts
    task = task_for(reverse_config)
    demos = task.demonstrations(
        reverse_config,
        task.questions(reverse_config, "eval"),
        task.tools(reverse_config, None),
        np.random.default_rng(0),
    )
    assert [response for _, response in demos["reverser"]][:2] == ["<answer>revir</answer>", "<answer>duolc</answer>"]


def test_a_third_task_reads_question_files_with_the_shared_reader(reverse_config, tmp_path):
    spec = _write(tmp_path / "words.jsonl", _jsonl_bytes([{"question": "abc", "answer": "cba"}, {"question": "de"}]))
    config = reverse_config.model_copy(update={"data": reverse_config.data.model_copy(update={"train": spec})})
    with pytest.raises(DataError, match=re.escape(f"{spec}: row 1 (line 2): missing or empty answer ('answer')")):
        task_questions(config, "train")
