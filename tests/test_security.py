"""Security: nothing drmas reads is executed, no credential leaks, its servers stay local.

- Pickles: a payload that creates a marker file when unpickled is planted where weights,
  optimizer state and index arrays belong, at every place drmas loads such files: the
  weight gate ``drmas.models.load_model`` (every stage loads weights through it), a worker
  group's ``load_policy`` as each Ray actor runs it, the update stage's optimizer state,
  the BM25 cache, and ``drmas run --resume`` / ``drmas eval`` on a real run. Each is
  refused and the marker never appears; a control shows each payload does create its
  marker when loaded the unsafe way, and a scan of the source keeps other loaders out.
- Model output is data: code, template and shell syntax in it are never evaluated by a
  parser, a checker, the retriever or the chat template that carries it to the next agent
  (the math checker's own table is test_math_task.py::test_answers_are_never_evaluated).
- Credentials: a real ``drmas run`` on the real S3 server with planted secrets, then a
  scan of everything it wrote (its output, every store object with Parquet decoded, the
  MLflow database and artifacts, params and tags, local caches, Ray's logs), with a
  positive control for the scan.
- Local servers (SeaweedFS, Ray, the update's gloo rendezvous, ``make ui``) listen on
  127.0.0.1 only. The Kubernetes side (non-root pods, dropped capabilities, least RBAC)
  is test_manifests.py.
"""

from __future__ import annotations

import ast
import json
import logging
import os
import pickle
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import psutil
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
import torch
from conftest import S3_BUCKET, TRAINED_RUN, TRAINED_SETTINGS, TrainedRun, copy_trained_run
from helpers import record_policy, stored_rollout

from drmas.config import ModelSpec, StoreConfig
from drmas.generation.workers import WorkerGroupRuntime
from drmas.infra.layout import PolicyRef, policy_path
from drmas.infra.store import CorruptArtifact, Store
from drmas.models import PolicyError, build_scratch_policy, chat_turn, load_model, load_tokenizer, train_tokenizer
from drmas.stages.advantage import advantage
from drmas.stages.policies import AGENT_TAGS, init_policies
from drmas.stages.update import update
from drmas.tasks import Question
from drmas.tasks.math import math_reward
from drmas.tasks.search.answers import exact_match
from drmas.tasks.search.retrieval import INDEX_DIR, PASSAGES_FILE, Retriever, cached_retriever
from drmas.team.agents import AnswerAgent, MathVerifierAgent, RouterAgent, SearchAgent, SolverAgent
from drmas.team.episodes import Episode
from drmas.team.orchestras import Passage

ROOT = Path(__file__).resolve().parents[1]
MATH = str(ROOT / "configs" / "math_tiny.yaml")
DRMAS = str(Path(sys.executable).parent / "drmas")
EXPERIMENT = "math-tiny"
RUN = TRAINED_RUN
BASE = TRAINED_SETTINGS
"""The settings of the trained run (conftest.py; a resume must repeat them)."""


# --------------------------------------------------------------------------------------
# Pickles
# --------------------------------------------------------------------------------------


class Payload:
    """What an attacker plants: unpickling it opens ``marker`` for writing, creating it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def plant_torch_pickle(path: Path, marker: Path) -> Path:
    """A ``torch.save`` checkpoint (what ``pytorch_model.bin`` is) holding the payload."""
    torch.save({"model.embed_tokens.weight": Payload(marker)}, path)
    return path


def plant_object_array(path: Path, marker: Path) -> Path:
    """A ``.npy`` file of object dtype holding the payload."""
    np.save(path, np.array([Payload(marker)], dtype=object), allow_pickle=True)
    return path


def test_the_payloads_do_run_when_loaded_the_unsafe_way(tmp_path):
    """The control for every test below: a marker that stays absent means 'refused'."""
    markers = [tmp_path / f"marker-{i}" for i in range(3)]
    pickle.loads(pickle.dumps(Payload(markers[0])))
    torch.load(plant_torch_pickle(tmp_path / "w.bin", markers[1]), weights_only=False)
    np.load(plant_object_array(tmp_path / "a.npy", markers[2]), allow_pickle=True)
    assert all(marker.exists() for marker in markers)


@pytest.fixture(scope="module")
def policy_folder(tmp_path_factory) -> Path:
    """A real scratch policy in HF layout (safetensors, tokenizer), built once."""
    spec = ModelSpec(hidden_size=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_size=16)
    return build_scratch_policy(spec, list(AGENT_TAGS), tmp_path_factory.mktemp("policy") / "p", seed=0)


def pickled_policy(policy_folder: Path, folder: Path, marker: Path, weights: str = "pytorch_model.bin") -> Path:
    """A copy of the policy with its safetensors weights swapped for a planted pickle (a
    copy of one already swapped gets this marker's pickle)."""
    shutil.copytree(policy_folder, folder)
    (folder / "model.safetensors").unlink(missing_ok=True)
    plant_torch_pickle(folder / weights, marker)
    return folder


@pytest.mark.parametrize("weights", ["pytorch_model.bin", "model.pt", "consolidated.pth"])
def test_the_weight_gate_refuses_pickled_weights_unrun(weights, policy_folder, tmp_path):
    marker = tmp_path / "pwned"
    folder = pickled_policy(policy_folder, tmp_path / "policy", marker, weights)
    with pytest.raises(
        PolicyError, match=re.escape(f"{folder}: has pickled weights ({weights}) and no model.safetensors")
    ):
        load_model(folder)
    assert not marker.exists()


def test_a_pickle_beside_safetensors_is_never_opened(policy_folder, tmp_path):
    marker = tmp_path / "pwned"
    folder = shutil.copytree(policy_folder, tmp_path / "policy")
    for name in ("pytorch_model.bin", "training_args.bin", "optimizer.pt"):
        plant_torch_pickle(folder / name, marker)
    assert load_model(folder).num_parameters() > 0
    assert len(load_tokenizer(folder)) > 0
    assert not marker.exists()


def test_code_shipped_in_a_policy_folder_is_never_run(policy_folder, tmp_path):
    """A config.json that names the folder's own modeling code (``auto_map``) would run it
    with trust_remote_code; drmas never passes it."""
    marker = tmp_path / "pwned"
    folder = shutil.copytree(policy_folder, tmp_path / "policy")
    config = json.loads((folder / "config.json").read_text())
    config |= {
        "model_type": "drmas-evil",
        "auto_map": {"AutoConfig": "evil.EvilConfig", "AutoModelForCausalLM": "evil.EvilModel"},
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "evil.py").write_text(f"open({str(marker)!r}, 'w')\nEvilConfig = EvilModel = None\n")
    with pytest.raises(PolicyError, match=re.escape(f"{folder}: not a loadable policy")):
        load_model(folder)
    assert not marker.exists()


def planted_artifact(store: Store, path: str, files: dict[str, bytes]) -> PolicyRef:
    with store.writer(path) as out:
        for name, data in files.items():
            out.write_bytes(name, data)
    return PolicyRef(path)


def test_a_worker_group_refuses_a_pickled_policy_from_the_store(policy_folder, tmp_path):
    """What every Ray actor runs when the pool points it at a policy (here in-process)."""
    marker = tmp_path / "pwned"
    folder = pickled_policy(policy_folder, tmp_path / "policy", marker)
    store = Store(str(tmp_path / "store"))
    ref = planted_artifact(store, "planted/policy", {path.name: path.read_bytes() for path in folder.iterdir()})
    runtime = WorkerGroupRuntime("solver", store.settings(), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(PolicyError, match=r"has pickled weights \(pytorch_model.bin\)"):
        runtime.load_policy(ref)
    assert runtime.version is None and not marker.exists()


@pytest.mark.parametrize("planted", ["optimizer state", "policy"])
def test_the_update_stage_refuses_planted_pickles(planted, tmp_path):
    marker = tmp_path / "pwned"
    config, store, _ = stored_rollout(tmp_path)
    advantage(config, store, "r", 0)
    policy = init_policies(config, store, "r")["solver"]
    optim = None
    if planted == "optimizer state":
        payload = pickle.dumps(Payload(marker))
        optim = planted_artifact(
            store, "planted/optim", {"optimizer.safetensors": payload, "state.json": b"{}", "optimizer.pt": payload}
        )
        expected = (
            CorruptArtifact,
            rf"^{re.escape(store.uri('planted/optim'))}: cannot resume the optimizer from it: "
            r"optimizer.safetensors is not a safetensors file",
        )
    else:
        folder = store.open(policy.artifact).download(tmp_path / "policy")
        (folder / "model.safetensors").unlink()
        plant_torch_pickle(folder / "pytorch_model.bin", marker)
        policy = planted_artifact(store, "planted/policy", {path.name: path.read_bytes() for path in folder.iterdir()})
        expected = PolicyError, r"has pickled weights \(pytorch_model.bin\) and no model.safetensors"
    before = store.list()
    with pytest.raises(expected[0], match=expected[1]):
        update(config, store, "r", 0, "solver", policy, optim)
    assert not marker.exists()
    assert store.list() == before  # no policy or optimizer state written


def test_a_pickled_bm25_cache_is_refused_and_rebuilt(tmp_path, caplog):
    passages = [
        Passage(str(i), text)
        for i, text in enumerate(["The Vell flows through Quellin.", "Quellin was founded by Mara Voss."])
    ]
    store = Store(str(tmp_path / "store"))
    folder = tmp_path / "index"
    Retriever.build(passages).index.save(str(folder), show_progress=False, allow_pickle=False)
    marker = tmp_path / "pwned"
    arrays = sorted(folder.glob("*.npy"))
    assert arrays
    for array in arrays:
        plant_object_array(array, marker)
    path = f"_cache/bm25/{Retriever.corpus_hash(passages)}"
    with store.writer(path) as out:
        out.write_bytes(
            PASSAGES_FILE, "".join(json.dumps({"id": p.pid, "text": p.text}) + "\n" for p in passages).encode()
        )
        out.put_dir(folder, INDEX_DIR)
    with caplog.at_level(logging.WARNING):
        retriever = cached_retriever(passages, store)
    assert "rebuilding the BM25 cache" in caplog.text and "not a loadable BM25 index" in caplog.text
    assert retriever.search(["Mara Voss"], k=1) == [[passages[1]]]
    assert not marker.exists()


SOURCE_TREES = ("src/drmas", "src/drmas_kfp", "components", "pipelines")
UNSAFE_CALLS = {
    "eval",
    "exec",
    "__import__",
    "pickle.load",
    "pickle.loads",
    "pickle.Unpickler",
    "cloudpickle.load",
    "cloudpickle.loads",
    "dill.load",
    "dill.loads",
    "joblib.load",
    "marshal.loads",
    "shelve.open",
    "torch.load",
    "yaml.load",
    "yaml.unsafe_load",
    "yaml.full_load",
    "sympify",
    "sympy.sympify",
    "parse_expr",
    "numexpr.evaluate",
}
"""Calls that run or unpickle what they are given."""
UNSAFE_KEYWORDS = {"trust_remote_code": True, "weights_only": False, "allow_pickle": True}
UNSAFE_MODULES = {"pickle", "cloudpickle", "dill", "joblib", "marshal", "shelve"}
WEIGHT_GATE = "src/drmas/models.py"
"""The one module that may call ``from_pretrained``: every weight load passes its checks."""


def _imported_names(tree: ast.AST) -> dict[str, str]:
    """Local name -> what it was imported as (``import torch as t``: t -> torch)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {
                alias.asname or alias.name.split(".")[0]: alias.name if alias.asname else alias.name.split(".")[0]
                for alias in node.names
            }
        elif isinstance(node, ast.ImportFrom):
            names |= {alias.asname or alias.name: f"{node.module}.{alias.name}" for alias in node.names}
    return names


def _name(node: ast.AST, imported: dict[str, str]) -> str:
    """The dotted name a call goes to, with import aliases resolved."""
    if isinstance(node, ast.Name):
        return imported.get(node.id, node.id)
    if isinstance(node, ast.Attribute):
        return f"{_name(node.value, imported)}.{node.attr}"
    return ""


def unsafe_constructs(source: str, where: str) -> list[str]:
    """Every place in ``source`` that could execute or unpickle input."""
    tree = ast.parse(source)
    imported = _imported_names(tree)
    found = []
    for node in ast.walk(tree):
        at = f"{where}:{getattr(node, 'lineno', 0)}"
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            modules = [alias.name for alias in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            found += [f"{at}: imports {module}" for module in modules if module.split(".")[0] in UNSAFE_MODULES]
        if not isinstance(node, ast.Call):
            continue
        name = _name(node.func, imported)
        if name in UNSAFE_CALLS or name.rsplit(".", 1)[-1] in ("sympify", "parse_expr"):
            found.append(f"{at}: calls {name}")
        if name.endswith("from_pretrained") and where != WEIGHT_GATE:
            found.append(f"{at}: loads weights outside the gate ({name})")
        for keyword in node.keywords:
            if (
                keyword.arg in UNSAFE_KEYWORDS
                and isinstance(keyword.value, ast.Constant)
                and keyword.value.value is UNSAFE_KEYWORDS[keyword.arg]
            ):
                found.append(f"{at}: {keyword.arg}={keyword.value.value}")
    return found


def test_no_code_path_executes_or_unpickles_input():
    sources = sorted(path for tree in SOURCE_TREES for path in (ROOT / tree).rglob("*.py"))
    assert len(sources) > 20
    found = [item for path in sources for item in unsafe_constructs(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == []


@pytest.mark.parametrize(
    "snippet",
    [
        "eval(text)",
        "exec(text)",
        "import pickle",
        "from joblib import load",
        "torch.load(path)",
        "import torch as t\nt.load(path)",
        "from torch import load\nload(path)",
        "yaml.load(text)",
        "sympy.sympify(answer)",
        "np.load(path, allow_pickle=True)",
        "AutoModel.from_pretrained(path)",
        "AutoModel.from_pretrained(path, trust_remote_code=True)",
        "torch.load(path, weights_only=False)",
    ],
)
def test_the_source_scan_sees_each_unsafe_construct(snippet):
    assert unsafe_constructs(snippet, "src/drmas/example.py")


# --------------------------------------------------------------------------------------
# Model output is data
# --------------------------------------------------------------------------------------

CODE_IN_OUTPUTS = [
    "__import__('os').system('touch MARKER')",
    "open('MARKER', 'w').write('x')",
    "{{ cycler.__init__.__globals__.os.popen('touch MARKER').read() }}",
    "{% for x in range(10**12) %}x{% endfor %}{{ 7*7 }}",
    "$(touch MARKER) `touch MARKER` ${7*7} #{7*7} <%= 7*7 %>",
]
"""Python, Jinja (the chat template's language) and shell payloads, MARKER a file path."""


@pytest.fixture(scope="module")
def runtime(tmp_path_factory) -> WorkerGroupRuntime:
    """A worker group's tokenise step, with a tokenizer trained as a scratch policy's is."""
    worker = WorkerGroupRuntime("solver", StoreConfig(root=str(tmp_path_factory.mktemp("store"))))
    worker.tokenizer = train_tokenizer([*AGENT_TAGS, "Problem: What is 1 + 1? Solver: solve it"], vocab_size=300)
    worker.max_prompt_tokens = 100_000
    return worker


@pytest.mark.parametrize("payload", CODE_IN_OUTPUTS)
def test_model_output_is_never_evaluated(payload, runtime, tmp_path):
    marker = tmp_path / "pwned"
    text = payload.replace("MARKER", str(marker))
    started = time.perf_counter()
    roles = (SolverAgent(), MathVerifierAgent(), RouterAgent(), SearchAgent(), AnswerAgent())
    wrapped = (
        f"<think>{text}</think><verify>{text}</verify><search>{text}</search><answer>{text}</answer>\\boxed{{{text}}}"
    )
    assert all(agent.parse(wrapped).text is not None for agent in roles)  # read as text, nothing more
    assert math_reward(wrapped, Question("q", "?", ("49",), "t")) == 0.0
    assert exact_match(text, ["49"]) == 0.0
    assert len(Retriever.build([Passage("0", "seven times seven is 49")]).search([text], k=1)) == 1
    episode = Episode(uid="u", traj_uid="t", sample_idx=0, question=Question("q", "What is 7 * 7?", ("49",), "t"))
    episode.team_context.append(f"Solver: {text}")  # what the next agent's prompt carries
    prompt = MathVerifierAgent().prompt(episode, 1)
    assert text in prompt
    assert runtime.tokenizer.decode(runtime._encode(prompt)) == chat_turn(prompt)  # rendered as data
    assert time.perf_counter() - started < 5
    assert not marker.exists()


# --------------------------------------------------------------------------------------
# A real run on S3 with planted secrets
# --------------------------------------------------------------------------------------


def readable(name: str, data: bytes) -> bytes:
    """A file's bytes, with its cells decoded when it is Parquet (compressed pages would
    hide a string from a byte search)."""
    if not name.endswith(".parquet"):
        return data
    table = pq.read_table(pa.BufferReader(data))
    return data + json.dumps(table.to_pylist(), default=str).encode()


def store_objects(run: TrainedRun) -> dict[str, bytes]:
    fs = pafs.S3FileSystem(
        endpoint_override=run.endpoint.removeprefix("http://"),
        scheme="http",
        region="us-east-1",
        access_key=run.secrets["AWS_ACCESS_KEY_ID"],
        secret_key=run.secrets["AWS_SECRET_ACCESS_KEY"],
    )
    infos = fs.get_file_info(pafs.FileSelector(run.root.removeprefix("s3://"), recursive=True))
    objects = {}
    for info in infos:
        if info.type == pafs.FileType.File:
            with fs.open_input_stream(info.path) as stream:
                objects[f"s3://{info.path}"] = readable(info.path, stream.read())
    return objects


def local_files(folder: Path, label: str) -> dict[str, bytes]:
    return {
        f"{label}:{path}": readable(path.name, path.read_bytes())
        for path in folder.rglob("*")
        if path.is_file() and not path.is_symlink()
    }


def mlflow_view(folder: Path) -> dict[str, bytes]:
    """Every run's params, tags and metric names as MLflow serves them."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{folder / 'mlflow.db'}")
    experiments = [e.experiment_id for e in client.search_experiments()]
    runs = client.search_runs(experiments)
    view = [
        {"params": r.data.params, "tags": r.data.tags, "metrics": sorted(r.data.metrics), "name": r.info.run_name}
        for r in runs
    ]
    return {"mlflow:params+tags": json.dumps(view).encode()}


def holding(sources: dict[str, bytes], needle: str) -> list[str]:
    return sorted(name for name, data in sources.items() if needle.encode() in data)


def test_the_scan_finds_a_string_hidden_in_compressed_parquet(tmp_path):
    """The scan's own control: a secret inside a zstd Parquet page is not in the file's
    bytes, and ``readable`` still finds it."""
    needle = "planted-" * 8
    pq.write_table(pa.table({"text": ["a" * 100, needle, "z" * 100]}), tmp_path / "t.parquet", compression="zstd")
    data = (tmp_path / "t.parquet").read_bytes()
    assert holding({"t.parquet": data}, needle) == []
    assert holding({"t.parquet": readable("t.parquet", data)}, needle) == ["t.parquet"]


@pytest.mark.slow
def test_no_credential_appears_in_anything_the_run_wrote(trained_run):
    sources = {"output": trained_run.output.encode()}
    sources |= store_objects(trained_run)
    sources |= local_files(trained_run.folder, "working folder")
    sources |= local_files(trained_run.ray_dir, "ray")
    sources |= mlflow_view(trained_run.folder)
    # The scan reads each kind of source: the run id is in all of them but Ray's logs.
    assert "output" in holding(sources, RUN)
    assert any(name.endswith("trajectories.parquet") for name in holding(sources, RUN))
    assert any(name.endswith("mlflow.db") for name in holding(sources, RUN))
    assert "mlflow:params+tags" in holding(sources, RUN)
    assert any(name.startswith("ray:") and name.endswith(".log") and sources[name] for name in sources)
    config = next(name for name in sources if name.endswith(f"{RUN}/run/config.json"))
    assert json.loads(sources[config])["store"]["root"] == trained_run.root  # the resolved config was scanned
    leaks = {label: holding(sources, secret) for label, secret in trained_run.secrets.items()}
    assert leaks == {label: [] for label in trained_run.secrets}, f"scanned {len(sources)} sources"


@pytest.mark.slow
@pytest.mark.parametrize("command", ["resume", "eval"])
def test_a_pickled_policy_in_the_store_is_refused_by_the_commands(command, trained_run, s3_env, tmp_path):
    marker = tmp_path / "pwned"
    root = f"s3://{S3_BUCKET}/{uuid.uuid4().hex}"
    copy_trained_run(trained_run, root)
    store = Store(root, trained_run.endpoint)
    path = policy_path(EXPERIMENT, RUN, 0, "solver")
    folder = pickled_policy(store.open(path).download(tmp_path / "stored"), tmp_path / "policy", marker)
    with store.writer(path, overwrite=True, meta=store.open(path).meta) as out:
        out.put_dir(folder, "")
    record_policy(store, RUN, "solver")
    before = store.list(f"{EXPERIMENT}/{RUN}")
    args = (
        ["run", MATH, "--resume", RUN, "experiment.iterations=2"]
        if command == "resume"
        else ["eval", MATH, "--run-id", RUN, "experiment.iterations=1"]
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(
        [DRMAS, *args, *BASE, f"store.root={root}", f"store.endpoint={trained_run.endpoint}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert f"{store.uri(path)}: has pickled weights (pytorch_model.bin) and no model.safetensors" in done.stderr
    assert "Traceback" not in done.stderr
    assert not marker.exists()
    assert store.list(f"{EXPERIMENT}/{RUN}") == before


# --------------------------------------------------------------------------------------
# Servers listen on 127.0.0.1 only
# --------------------------------------------------------------------------------------

LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}


def listening(processes: list[psutil.Process]) -> list[tuple[str, int, str]]:
    """(address, port, process name) of every listening TCP socket of ``processes``."""
    found = []
    for process in processes:
        try:
            connections = process.net_connections(kind="tcp")
            name = process.name()
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
        found += [(c.laddr.ip, c.laddr.port, name) for c in connections if c.status == psutil.CONN_LISTEN]
    return found


def test_the_s3_server_listens_on_loopback_only(s3_server):
    server = psutil.Process(s3_server.process.pid)
    sockets = listening([server, *server.children(recursive=True)])
    assert int(s3_server.endpoint.rsplit(":", 1)[1]) in {port for _, port, _ in sockets}
    assert [s for s in sockets if s[0] not in LOOPBACK] == []


RAY_PROBE = """
import json, sys, psutil, ray
from drmas.config import DrmasConfig
from drmas.generation.ray_session import connect_ray
config = DrmasConfig.model_validate({"agents": [{"name": "solver", "model": "m"}, {"name": "verifier", "model": "m"}]})
connect_ray(config, __import__("pathlib").Path(sys.argv[1]))
me = psutil.Process()
sockets = [(c.laddr.ip, c.laddr.port, p.name()) for p in [me, *me.children(recursive=True)]
           for c in p.net_connections(kind="tcp") if c.status == psutil.CONN_LISTEN]
ray.shutdown()
print(json.dumps(sockets))
"""
"""Starts Ray as ``drmas run`` does (a fresh process whose first Ray import is drmas's)."""


@pytest.mark.slow
def test_the_local_ray_listens_on_loopback_only():
    ray_dir = tempfile.mkdtemp(prefix="drmas-ray-")  # short: Ray's socket paths
    env = {key: value for key, value in os.environ.items() if not key.startswith("RAY_ENABLE")}
    try:
        done = subprocess.run(
            [sys.executable, "-c", RAY_PROBE, ray_dir], env=env, capture_output=True, text=True, timeout=120
        )
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-2000:]
    sockets = [tuple(s) for s in json.loads(done.stdout.strip().splitlines()[-1])]
    assert any(name == "gcs_server" for _, _, name in sockets), sockets
    assert [s for s in sockets if s[0] not in LOOPBACK] == []


def test_the_update_rendezvous_listens_on_loopback_only(monkeypatch):
    import torch.distributed as dist

    from drmas.training.engines.deepspeed import ensure_process_group

    if dist.is_initialized():
        pytest.skip("a process group is already up in this process")
    monkeypatch.setenv("LOCAL_RANK", "0")  # what it sets for DeepSpeed; undone after the test
    before = set(listening([psutil.Process()]))
    ensure_process_group()
    try:
        opened = set(listening([psutil.Process()])) - before
    finally:
        dist.destroy_process_group()
    assert opened, "the rendezvous opened no socket"
    assert [s for s in opened if s[0] not in LOOPBACK] == []


def test_make_ui_serves_mlflow_on_loopback_only():
    lines = [line for line in (ROOT / "Makefile").read_text().splitlines() if re.search(r"mlflow (ui|server)", line)]
    assert lines
    assert all("--host 127.0.0.1" in line for line in lines), lines
