"""Initial policies from every kind of source: scratch, a local folder, an earlier run's
policy artifact on S3. (Hub ids use the same loading code; tests never touch the hub.)"""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from safetensors.torch import load_file

from drmas.config import ConfigError, ModelSpec, load_config
from drmas.infra.store import Store
from drmas.models import build_scratch_policy, load_model
from drmas.stages.policies import init_policies

ROOT = Path(__file__).parent.parent
SMALL_MODEL = {"hidden_size": 32, "intermediate_size": 64, "num_layers": 1}


def config_with_source(source: str, *extra: str):
    return load_config(
        ROOT / "configs" / "math_tiny.yaml",
        [
            f"models.tiny={{source: '{source}', hidden_size: 32, intermediate_size: 64, num_layers: 1}}",
            "workers.sharing=by_model",
            *extra,
        ],
    )


def weights_of(store: Store, artifact: str, tmp: Path) -> dict:
    return load_file(str(store.open(artifact).download(tmp) / "model.safetensors"))


def test_local_folder_source_is_copied_into_the_run(tmp_path):
    folder = build_scratch_policy(ModelSpec(**SMALL_MODEL), ["What is 1 + 1? \\boxed{2}"] * 10, tmp_path / "hf", seed=3)
    store = Store(str(tmp_path / "store"))
    [policy] = init_policies(config_with_source(str(folder)), store, "run").values()
    copied = weights_of(store, policy.artifact, tmp_path / "copy")
    original = load_file(str(folder / "model.safetensors"))
    assert copied.keys() == original.keys() and all((copied[k] == original[k]).all() for k in copied)
    assert load_model(store.open(policy.artifact).download(tmp_path / "again")).config.hidden_size == 32


def test_earlier_runs_policy_on_s3_is_a_source(s3_env, tmp_path):
    s3 = Store(f"s3://drmas-test/{uuid.uuid4().hex}", s3_env.endpoint)
    [first] = init_policies(config_with_source("scratch"), s3, "earlier").values()
    uri = s3.uri(first.artifact)
    local = Store(str(tmp_path / "store"))
    config = config_with_source(uri, f"store.endpoint={s3_env.endpoint}")
    [second] = init_policies(config, local, "later").values()
    assert (
        weights_of(s3, first.artifact, tmp_path / "a").keys()
        == weights_of(local, second.artifact, tmp_path / "b").keys()
    )
    a, b = weights_of(s3, first.artifact, tmp_path / "c"), weights_of(local, second.artifact, tmp_path / "d")
    assert all((a[k] == b[k]).all() for k in a)


def test_missing_local_source_is_a_config_error(tmp_path):
    with pytest.raises(
        ConfigError, match=r"models.tiny: source '.*/nope' looks like a local folder but does not exist"
    ):
        config_with_source(str(tmp_path / "nope"))


def test_init_is_written_once(tmp_path):
    store = Store(str(tmp_path / "store"))
    config = config_with_source("scratch")
    [first] = init_policies(config, store, "run").values()
    manifest = (tmp_path / "store" / first.artifact / "_MANIFEST.json").read_bytes()
    init_policies(config, store, "run")
    assert (tmp_path / "store" / first.artifact / "_MANIFEST.json").read_bytes() == manifest
