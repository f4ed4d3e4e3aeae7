"""docs/cluster-checklist.md, the page an operator follows before the first submit, holds
to the manifests and the code: its secrets and keys are exactly those the operator creates
(``OPERATOR_SECRETS``, which tests/test_manifests.py holds to every pod and compiled step),
every file it names exists, every config field it names is one, the objects it names are
what the manifests deploy, and its commands are the ones ``drmas pool`` prints."""

from __future__ import annotations

import re
import types
import typing
from pathlib import Path

from pydantic import BaseModel

from drmas.config import DrmasConfig
from drmas.generation.named_pool import CLIENT_PORT, HEAD_SERVICE, TOKEN_COMMAND, port_forward_command
from tools.checks.manifests import OPERATOR_SECRETS, PIPELINE_ROLE, PLATFORM_NAMESPACE, ROOT, find, rendered

PAGE = ROOT / "docs" / "cluster-checklist.md"
TEXT = PAGE.read_text()
NAMESPACES = {"drmas": PLATFORM_NAMESPACE, "pipeline": "pipelines"}
GENERATED = {"images/.last-build": "images/build.sh"}
"""Files the page names that a command makes, and the file of that command."""


def _secrets_table() -> dict[str, dict[str, set[str]]]:
    """namespace -> secret -> keys, from the page's table rows ``| `name` | `keys` | namespaces |``."""
    found: dict[str, dict[str, set[str]]] = {}
    for name, keys, namespaces in re.findall(r"^\| `(drmas-[\w-]+)` \| (.+?) \| (.+?) \|$", TEXT, re.MULTILINE):
        for namespace in namespaces.split(", "):
            found.setdefault(NAMESPACES[namespace], {})[name] = set(re.findall(r"`([\w]+)`", keys))
    return found


def test_its_secrets_and_keys_are_exactly_those_the_operator_creates():
    assert _secrets_table() == OPERATOR_SECRETS


def test_every_file_it_names_exists():
    paths = set(re.findall(r"(?<![\w/.-])((?:manifests|configs|images|docs|tests|bench)/[\w./-]*\w)", TEXT))
    assert {"manifests/base/raycluster.yaml", "configs/math_qwen3_4b_gpu.yaml"} <= paths  # the pattern finds them
    for path in sorted(paths):
        if path in GENERATED:
            assert path in (ROOT / GENERATED[path]).read_text(), path
        else:
            assert (ROOT / path).exists(), f"docs/cluster-checklist.md names {path}, which does not exist"


def _field(model: type[BaseModel], dotted: str) -> bool:
    """Whether ``dotted`` (``eval.final.data``) names a field of ``model``, through nested models."""
    head, _, rest = dotted.partition(".")
    if head not in model.model_fields:
        return False
    if not rest:
        return True
    annotation = model.model_fields[head].annotation
    options = typing.get_args(annotation) if isinstance(annotation, types.UnionType) else (annotation,)
    return any(isinstance(t, type) and issubclass(t, BaseModel) and _field(t, rest) for t in options)


def test_every_config_field_it_names_is_one():
    sections = "|".join(DrmasConfig.model_fields)
    fields = set(re.findall(rf"`((?:{sections})\.[a-z_.]+[a-z_])`", TEXT))
    assert {"ray.address", "eval.final.data", "kubeflow.gpu_node_selector"} <= fields
    assert [field for field in sorted(fields) if not _field(DrmasConfig, field)] == []


def test_the_objects_it_names_are_what_the_manifests_deploy():
    platform = rendered("base")
    [cluster] = find(platform, "RayCluster", "drmas-raycluster")
    assert f"{cluster['metadata']['name']}-head-svc" == HEAD_SERVICE  # KubeRay's name of the head Service
    [gpu] = cluster["spec"]["workerGroupSpecs"]
    assert (gpu["groupName"], gpu["minReplicas"], gpu["maxReplicas"]) == ("gpu", 0, 2)
    assert "nodeSelector" not in gpu["template"]["spec"]  # "the Ray gpu group has no node selector"
    assert '\\"pool_slot\\": 8' in gpu["rayStartParams"]["resources"]
    resources = gpu["template"]["spec"]["containers"][0]["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == "8"
    assert (resources["limits"]["memory"], resources["requests"]["ephemeral-storage"]) == ("1600Gi", "900Gi")
    assert {claim["metadata"]["name"] for claim in find(platform, "PersistentVolumeClaim")} == {
        "drmas-data",
        "mlflow-db",
    }
    pipeline_side = rendered("kubeflow-profile")
    assert find(pipeline_side, "Role", PIPELINE_ROLE) and find(pipeline_side, "ConfigMap", "kfp-launcher")
    for config in ("math_qwen3_4b_gpu", "search_qwen25_7b_gpu"):
        recipe = (ROOT / "configs" / f"{config}.yaml").read_text()
        assert f"address: ray://{HEAD_SERVICE}.drmas.svc.cluster.local:{CLIENT_PORT}" in recipe
        assert "root: s3://drmas/runs" in recipe and "uri: http://mlflow.drmas.svc.cluster.local:5000" in recipe


def test_its_commands_are_the_ones_drmas_pool_prints():
    """The page's port-forward and token commands are those of drmas pool's messages."""
    assert port_forward_command(CLIENT_PORT) in TEXT
    assert TOKEN_COMMAND in TEXT


def test_readme_and_the_manifests_page_link_it():
    for page in (ROOT / "README.md", ROOT / "manifests" / "README.md"):
        assert "docs/cluster-checklist.md" in Path(page).read_text(), page
