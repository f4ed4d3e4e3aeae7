"""The Kubernetes manifests, rendered and validated offline (no kubectl, no cluster).

`render` is a tiny kustomize (resources, patches, images, namespace; any other kustomization
field fails the test rather than being ignored). Core kinds are validated with
kubernetes-validate's strict schemas of the newest Kubernetes it ships; KubeRay's
RayCluster/RayJob with the hand-written schemas in manifests/schemas, whose pod templates
refer to the same core definitions. On top of the schemas, `problems` holds the rules of
the project: resources, non-root, no privilege escalation, dropped capabilities, pinned
images, least RBAC (named grants only: Argo's executor, KFP's launcher), no API token in a
pod that does not use the API, no Secret and no placeholder in anything applied (the
operator creates the secrets, OPERATOR_SECRETS, with the commands of manifests/README.md),
every pod that gets a secret refusing an empty or placeholder value in a first init
container that names the secret, references that resolve, KFP's launcher settings as
KFP's source reads them, NetworkPolicies that admit only drmas's own pipeline steps (its
label, never KFP's) and the Ray pods, MLflow behind its basic-auth app, Ray token
authentication, each secret only in the pods that use it, fully qualified names for
Services in other namespaces, and a retrieval service that a Service and its clients
reach, probed on /health, with a read-only root and the index its Job cached. Deliberately
broken copies show that every rule can fail.

Install modes are overlays that hold only the pipeline side (kfp-standalone,
kubeflow-profile); `rendered("base", "kfp-standalone")` is what applying both sends. The
search task's retrieval service (retrieval, and its index Job in retrieval-index) holds
only its own objects too, applied on top of a platform (ADDONS).
"""

from __future__ import annotations

import configparser
import copy
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable, Iterator
from fnmatch import fnmatch
from functools import cache
from pathlib import Path
from urllib.parse import urlparse

import jsonschema
import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version
from referencing import Registry, Resource

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from drmas.config import RayConfig, load_config
from drmas_kfp.pipelines.build import build_pipeline, compile_pipeline
from drmas_kfp.pipelines.platform import (
    MLFLOW_AUTH_KEYS,
    MLFLOW_AUTH_SECRET,
    POD_LABEL,
    RAY_TOKEN_KEY,
    RAY_TOKEN_SECRET,
    S3_SECRET,
    S3_SECRET_KEYS,
)

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "manifests"
KUSTOMIZATIONS = (
    "base",
    "object-store",
    "jobs",
    "kfp-standalone",
    "kubeflow-profile",
    "retrieval",
    "retrieval-index",
)
PLATFORMS = ("base", "object-store")
# Kustomizations applied on top of a platform, holding only their own objects: they refer
# to its secrets, so they are checked rendered together with it.
ADDONS = ("retrieval", "retrieval-index")
PIPELINE_OVERLAYS = {"kfp-standalone": "kubeflow", "kubeflow-profile": "kubeflow-user-example-com"}
K8S_VERSION = ".".join(latest_version().split(".")[:2])  # the newest schemas it ships
KUSTOMIZATION_FIELDS = {"apiVersion", "kind", "namespace", "resources", "patches", "images"}
CLUSTER_SCOPED = {
    "Namespace",
    "ClusterRole",
    "ClusterRoleBinding",
    "CustomResourceDefinition",
    "PersistentVolume",
    "StorageClass",
    "PriorityClass",
}
WORKLOADS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}
ALLOWED_VERBS = {"get", "list", "watch"}
# Writes a Role may hold, each on one named resource and for one reason, nothing broader:
# Argo's executor (>= v3.4) reports a step's outputs as WorkflowTaskResults
# (argoproj/argo-workflows docs/workflow-rbac.md, "the minimum for the executor").
NAMED_GRANTS = {("argoproj.io", "workflowtaskresults"): {"create", "patch"}}
# Accounts a RoleBinding may name without rendering them: a Kubeflow profile's pipeline
# pods run as default-editor, which Kubeflow's profile controller creates.
EXTERNAL_ACCOUNTS = {"default-editor"}
PIPELINE_ROLE = "drmas-pipeline"
PLACEHOLDER = "REPLACE_ME"
CREDENTIAL_KEY = re.compile(r"KEY|SECRET|PASSWORD|TOKEN|USERNAME", re.IGNORECASE)
# The secrets the operator creates (manifests/README.md, "Secrets": one `kubectl create
# secret generic` each), by namespace: the platform's and each pipeline namespace's (where the
# Role drmas-pipeline is). None is in a kustomization: applying one would deploy its value,
# and applying it again would overwrite the operator's.
PLATFORM_NAMESPACE = "drmas"
OPERATOR_SECRETS = {
    PLATFORM_NAMESPACE: {
        S3_SECRET: {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"},
        RAY_TOKEN_SECRET: {RAY_TOKEN_KEY},
        MLFLOW_AUTH_SECRET: set(MLFLOW_AUTH_KEYS),
        "drmas-mlflow-db": {"POSTGRES_PASSWORD"},
        "drmas-mlflow-server": {"MLFLOW_FLASK_SERVER_SECRET_KEY"},
    },
    "pipelines": {
        S3_SECRET: {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"},
        RAY_TOKEN_SECRET: {RAY_TOKEN_KEY},
        MLFLOW_AUTH_SECRET: set(MLFLOW_AUTH_KEYS),
    },
}
# Every pod that gets a secret runs this first: an init container that refuses an empty
# value or the placeholder, naming the secret. Its arguments are VAR=secret/key.
SECRET_CHECK = "check-secrets"
# MLflow's own authentication (mlflow 3.17: `mlflow server --app-name basic-auth`, settings
# in the file MLFLOW_AUTH_CONFIG_PATH names; the admin account from MLFLOW_AUTH_ADMIN_*, the
# form-signing key from MLFLOW_FLASK_SERVER_SECRET_KEY, both read from the environment).
MLFLOW_AUTH_APP = "basic-auth"
MLFLOW_AUTH_ENV = ("MLFLOW_AUTH_ADMIN_USERNAME", "MLFLOW_AUTH_ADMIN_PASSWORD", "MLFLOW_FLASK_SERVER_SECRET_KEY")
MLFLOW_PERMISSIONS = {"READ", "EDIT", "MANAGE", "NO_PERMISSIONS"}
DRMAS_UID = 1000  # USER 1000:1000 in images/Dockerfile.*
GPU_CONFIGS = sorted((ROOT / "configs").glob("*_gpu.yaml"))

# KFP's launcher settings (kubeflow/pipelines backend/src/v2/config/env.go: the ConfigMap
# kfp-launcher, keys defaultPipelineRoot and providers; s3.go: the s3 provider's fields).
# Go's decoder ignores a field it does not know, so a misspelling would silently drop a
# setting: every field is checked against these.
LAUNCHER_CONFIGMAP = "kfp-launcher"
LAUNCHER_KEYS = {"defaultPipelineRoot", "providers"}
LAUNCHER_PROVIDERS = {"minio", "s3", "gs"}
S3_PROVIDER_FIELDS = {"default", "overrides"}
S3_DEFAULT_FIELDS = {"endpoint", "credentials", "region", "disableSSL", "forcePathStyle", "maxRetries"}
S3_OVERRIDE_FIELDS = S3_DEFAULT_FIELDS | {"bucketName", "keyPrefix"}
S3_CREDENTIAL_FIELDS = {"fromEnv", "secretRef"}
S3_SECRET_REF_FIELDS = {"secretName", "accessKeyKey", "secretKeyKey"}

# drmas labels every step's pod so (drmas_kfp.pipelines.platform.place, kfp-kubernetes'
# add_pod_label): the NetworkPolicies admit that. Not KFP's own label, which KFP puts on
# every pod of every v2 pipeline (backend/src/v2/compiler/argocompiler/argo.go).
PIPELINE_POD_LABEL = {POD_LABEL[0]: POD_LABEL[1]}
KFP_POD_LABEL = "pipelines.kubeflow.org/v2_component"
RAY_POD_LABEL = {"app.kubernetes.io/name": "drmas-raycluster"}
RAY_HEAD_LABEL = {**RAY_POD_LABEL, "app.kubernetes.io/component": "ray-head"}
MLFLOW_POD_LABEL = {"app.kubernetes.io/name": "mlflow"}
RETRIEVAL_POD_LABEL = {"app.kubernetes.io/name": "drmas-retrieval"}
RETRIEVAL_PORT = 8080
# What pipeline pods connect to: Ray Client on the head, MLflow, the retrieval service.
PIPELINE_TARGETS = ((RAY_HEAD_LABEL, 10001), (MLFLOW_POD_LABEL, 5000), (RETRIEVAL_POD_LABEL, RETRIEVAL_PORT))
# What Ray pods connect to outside Ray: the retrieval service (rollout and evaluation on
# the pool, RayJob drivers on the head).
RAY_TARGETS = ((RETRIEVAL_POD_LABEL, RETRIEVAL_PORT),)
# Ports no pod outside the allowed ones may reach: GCS, dashboard, Ray Client, MLflow,
# PostgreSQL, the retrieval service. Ray pods are guarded whatever they declare (raylets
# listen on many ports).
GUARDED_PORTS = {6379, 8265, 10001, 5000, 5432, RETRIEVAL_PORT}
# The only port a NetworkPolicy may open to every pod: SeaweedFS' S3, which checks the keys
# of drmas-s3 itself (pipeline pods of any namespace reach it).
OPEN_PORTS = {8333}
# A namespace label that admits a whole namespace (an Ingress controller's) to MLflow's UI.
UI_NAMESPACE_LABEL = "drmas.io/mlflow-ui"
# Ray token authentication: KubeRay's authOptions.secretName and its key
# (ray-project/kuberay ray-operator/controllers/ray/utils/constant.go), and the variables
# Ray reads (ray 2.60 ray/_private/authentication, the C++ token loader: RAY_AUTH_MODE,
# RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH).
RAY_TOKEN_SECRET_KEY = "auth_token"
# The pods that use each secret (fnmatch patterns of pod_templates' names), and why. Any
# other pod that gets the secret fails: a credential lives only where it is used.
SECRET_USERS = {
    "drmas-s3": {
        "RayCluster/*/head": "RayJob drivers (drmas run) read and write the store",
        "RayCluster/*/gpu": "pool workers load policies and optimizer state",
        "Deployment/mlflow": "the artifact proxy (--serve-artifacts) writes to S3",
        "StatefulSet/seaweedfs": "the S3 server enforces these keys",
        "Deployment/drmas-retrieval": "the retrieval service loads its corpus and index from the store",
        "Job/drmas-retrieval-index": "the index Job reads the corpus and caches the index in the store",
    },
    "drmas-mlflow-db": {
        "Deployment/mlflow-db": "PostgreSQL's password",
        "Deployment/mlflow": "the tracking server logs in (PGPASSWORD)",
    },
    "drmas-ray-token": {
        "RayCluster/*/head": "Ray token authentication",
        "RayCluster/*/gpu": "Ray token authentication",
    },
    MLFLOW_AUTH_SECRET: {
        "RayCluster/*/head": "RayJob drivers (drmas run) log to MLflow",
        "Deployment/mlflow": "basic-auth creates its admin account from it",
    },
    "drmas-mlflow-server": {
        "Deployment/mlflow": "the key that signs basic-auth's forms",
    },
}
BUCKET_SCHEMES = {"s3", "gs", "minio"}  # URI hosts that are buckets, not Services
# The retrieval service (drmas.tasks.retrieval_service): `drmas serve-retrieval`, GET
# /health. Loading a wiki-scale index from the store, or building it when the index Job's
# cache is missing, takes minutes to hours (not measured): the startup probe must give it
# at least this long before the liveness probe may restart the pod.
RETRIEVAL_COMMAND = ["drmas", "serve-retrieval"]
RETRIEVAL_HEALTH = "/health"
RETRIEVAL_STARTUP_S = 3600
# Arguments that only the server takes; every other one names what is indexed and where
# its cache lives, and must be the same in the index Job.
RETRIEVAL_SERVER_ARGS = {"--host", "--port", "--build-only"}


# ----------------------------------------------------------------------------- rendering


def render(directory: Path) -> list[dict]:
    """The documents `kubectl apply -k directory` would send, as far as these manifests go.

    resources: files (multi-document YAML) and directories, recursively; patches: a file
    naming its target by kind and name (and namespace, if it names one), merged like a
    strategic merge patch on maps (lists and scalars replace, so patches must not hold
    lists); images: every containers and
    initContainers list at any depth, as kustomize does, CRDs included; namespace: set on
    every namespaced document.
    """
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    unknown = set(kustomization) - KUSTOMIZATION_FIELDS
    assert not unknown, f"{directory}: render() does not implement {sorted(unknown)}"

    docs: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            docs += render(path)
        else:
            docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    for patch in kustomization.get("patches", []):
        assert set(patch) == {"path"}, f"{directory}: only file patches are implemented"
        body = yaml.safe_load((directory / patch["path"]).read_text())
        targets = [doc for doc in docs if key(doc)[:2] == key(body)[:2] and key(body)[2] in (None, key(doc)[2])]
        assert len(targets) == 1, f"patch {patch['path']} matches {len(targets)} documents"
        merge(targets[0], body)
    for rule in kustomization.get("images", []):
        assert set(rule) <= {"name", "newName", "newTag"}, rule
        for container in containers_anywhere(docs):
            name, tag = split_image(container["image"])
            if name == rule["name"]:
                tag = rule.get("newTag", tag)
                container["image"] = rule.get("newName", name) + (f":{tag}" if tag else "")
    if namespace := kustomization.get("namespace"):
        for doc in docs:
            if doc["kind"] not in CLUSTER_SCOPED:
                doc["metadata"]["namespace"] = namespace
    return docs


def merge(target: dict, patch: dict) -> None:
    for name, value in patch.items():
        if isinstance(value, dict) and isinstance(target.get(name), dict):
            merge(target[name], value)
        else:
            assert not isinstance(value, list), "list patches are not implemented"
            target[name] = copy.deepcopy(value)


def containers_anywhere(node: object) -> Iterator[dict]:
    if isinstance(node, dict):
        for name, value in node.items():
            if name in ("containers", "initContainers") and isinstance(value, list):
                yield from (c for c in value if isinstance(c, dict) and "image" in c)
            else:
                yield from containers_anywhere(value)
    elif isinstance(node, list):
        for item in node:
            yield from containers_anywhere(item)


def split_image(image: str) -> tuple[str, str | None]:
    """('registry/name', 'tag') of an image reference (a registry port is not a tag)."""
    slash = image.rfind("/")
    colon = image.rfind(":")
    return (image[:colon], image[colon + 1 :]) if colon > slash else (image, None)


def key(doc: dict) -> tuple[str, str, str | None]:
    meta = doc.get("metadata", {})
    return doc.get("kind", "?"), meta.get("name", "?"), meta.get("namespace")


@cache
def _rendered(name: str) -> tuple[str, ...]:
    return tuple(json.dumps(doc) for doc in render(MANIFESTS / name))


def rendered(*names: str) -> list[dict]:
    """A fresh copy of the kustomizations' documents (tests may mutate it): several names
    are what `kubectl apply -k` of each sends together (a kustomization listing them)."""
    return [json.loads(doc) for name in names for doc in _rendered(name)]


def find(docs: list[dict], kind: str, name: str | None = None) -> list[dict]:
    return [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]


def one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = find(docs, kind, name)
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


# ----------------------------------------------------------------------------- walking


def ray_cluster_templates(where: str, spec: dict) -> list[tuple[str, dict]]:
    templates = [(f"{where}/head", spec.get("headGroupSpec", {}).get("template", {}))]
    for group in spec.get("workerGroupSpecs", []):
        templates.append((f"{where}/{group.get('groupName')}", group.get("template", {})))
    return templates


def pod_templates(doc: dict) -> list[tuple[str, dict]]:
    kind, name, _ = key(doc)
    spec = doc.get("spec", {})
    where = f"{kind}/{name}"
    if kind in WORKLOADS:
        return [(where, spec.get("template", {}))]
    if kind == "CronJob":
        return [(where, spec.get("jobTemplate", {}).get("spec", {}).get("template", {}))]
    if kind == "Pod":
        return [(where, {"metadata": doc.get("metadata", {}), "spec": spec})]
    if kind == "RayCluster":
        return ray_cluster_templates(where, spec)
    if kind == "RayJob":
        templates = []
        if "submitterPodTemplate" in spec:
            templates.append((f"{where}/submitter", spec["submitterPodTemplate"]))
        if "rayClusterSpec" in spec:
            templates += ray_cluster_templates(where, spec["rayClusterSpec"])
        return templates
    return []


def all_templates(docs: list[dict]) -> list[tuple[str, dict, dict]]:
    """(where, pod template, the document it belongs to) for every pod the docs create."""
    return [(where, t, doc) for doc in docs for where, t in pod_templates(doc)]


def pod_containers(template: dict) -> list[dict]:
    spec = template.get("spec") or {}
    return list(spec.get("initContainers", [])) + list(spec.get("containers", []))


# ----------------------------------------------------------------------------- schemas


@cache
def ray_validators() -> dict[str, jsonschema.protocols.Validator]:
    """Validators for ray.io/v1 kinds: the repository's schemas plus the core definitions."""
    package = Path(kubernetes_validate.__file__).parent / "kubernetes-json-schema"
    definitions = json.loads((package / f"v{latest_version()}-local-strict" / "_definitions.json").read_text())
    schemas = {
        kind: json.loads((MANIFESTS / "schemas" / f"{kind.lower()}.json").read_text())
        for kind in ("RayCluster", "RayJob")
    }
    resources = [(definitions["$id"], Resource.from_contents(definitions))]
    resources += [(schema["$id"], Resource.from_contents(schema)) for schema in schemas.values()]
    registry = Registry().with_resources(resources)
    validators = {}
    for kind, schema in schemas.items():
        jsonschema.Draft202012Validator.check_schema(schema)
        validators[kind] = jsonschema.Draft202012Validator(schema, registry=registry)
    return validators


def schema_problems(docs: list[dict]) -> list[str]:
    problems = []
    for doc in docs:
        where = "{}/{}".format(*key(doc)[:2])
        if doc.get("apiVersion") == "ray.io/v1":
            validator = ray_validators().get(doc.get("kind"))
            if validator is None:
                problems.append(f"{where}: no schema for ray.io/v1 {doc.get('kind')}")
                continue
            for error in validator.iter_errors(doc):
                problems.append(f"{where}: schema: {error.json_path}: {error.message}")
            continue
        try:
            kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = "/".join(str(part) for part in error.path)
            problems.append(f"{where}: schema: {path}: {error.message}")
        except kubernetes_validate.SchemaNotFoundError as error:
            problems.append(f"{where}: {error.message}")
    return problems


# ----------------------------------------------------------------------------- the rules


def image_problems(where: str, image: str) -> list[str]:
    name, tag = split_image(image)
    if not tag or tag == "latest" or not re.search(r"\d", tag):
        return [f"{where}: image {image!r} is not pinned to a version tag"]
    if name.endswith(("/drmas-cpu", "/drmas-gpu")):
        version = re.escape(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"])
        if not re.fullmatch(rf"{version}(-[0-9a-f]{{7,40}})?", tag):
            return [f"{where}: drmas image tag {tag!r} is not one images/build.sh makes"]
    return []


def hardening_problems(where: str, context: dict, pod_context: dict) -> list[str]:
    problems = []
    if context.get("runAsNonRoot", pod_context.get("runAsNonRoot")) is not True:
        problems.append(f"{where}: runAsNonRoot is not true")
    user = context.get("runAsUser", pod_context.get("runAsUser"))
    if not isinstance(user, int) or user == 0:
        problems.append(f"{where}: no non-zero runAsUser")
    if context.get("allowPrivilegeEscalation") is not False:
        problems.append(f"{where}: allowPrivilegeEscalation is not false")
    if "ALL" not in context.get("capabilities", {}).get("drop", []):
        problems.append(f"{where}: capabilities do not drop ALL")
    if context.get("capabilities", {}).get("add") or context.get("privileged"):
        problems.append(f"{where}: adds capabilities or runs privileged")
    return problems


def resource_problems(where: str, resources: dict | None) -> list[str]:
    resources = resources or {}
    return [
        f"{where}: no resources.{part}.{name}"
        for part in ("requests", "limits")
        for name in ("cpu", "memory")
        if name not in (resources.get(part) or {})
    ]


def uses_the_api(where: str, doc: dict) -> bool:
    """Whether a pod talks to the Kubernetes API: only the head of an autoscaling Ray
    cluster does (its autoscaler sidecar resizes the worker group with the head's token)."""
    cluster = doc.get("spec", {})
    cluster = cluster.get("rayClusterSpec", cluster) if doc.get("kind") == "RayJob" else cluster
    return where.endswith("/head") and bool(cluster.get("enableInTreeAutoscaling"))


def pod_problems(docs: list[dict]) -> list[str]:
    problems = []
    for where, template, doc in all_templates(docs):
        spec = template.get("spec") or {}
        pod_context = spec.get("securityContext") or {}
        if not spec.get("containers"):
            problems.append(f"{where}: no containers")
        if spec.get("automountServiceAccountToken") is not False and not uses_the_api(where, doc):
            problems.append(f"{where}: mounts a ServiceAccount token it never uses (automountServiceAccountToken)")
        if pod_context.get("seccompProfile", {}).get("type") != "RuntimeDefault":
            problems.append(f"{where}: seccompProfile is not RuntimeDefault")
        for flag in ("hostNetwork", "hostPID", "hostIPC"):
            if spec.get(flag):
                problems.append(f"{where}: {flag}")
        for volume in spec.get("volumes", []):
            if "hostPath" in volume:
                problems.append(f"{where}: hostPath volume {volume.get('name')}")
        for container in pod_containers(template):
            at = f"{where}/{container.get('name')}"
            problems += resource_problems(at, container.get("resources"))
            problems += hardening_problems(at, container.get("securityContext") or {}, pod_context)
            problems += image_problems(at, container.get("image", ""))
            user = (container.get("securityContext") or {}).get("runAsUser", pod_context.get("runAsUser"))
            if "/drmas-" in container.get("image", "") and user != DRMAS_UID:
                problems.append(f"{at}: drmas images run as uid {DRMAS_UID}, not {user}")
    for cluster in find(docs, "RayCluster") + [
        {"metadata": j["metadata"], "spec": j["spec"]["rayClusterSpec"]}
        for j in find(docs, "RayJob")
        if "rayClusterSpec" in j.get("spec", {})
    ]:
        # The autoscaler sidecar KubeRay adds to the head pod is configured here.
        if cluster["spec"].get("enableInTreeAutoscaling"):
            options = cluster["spec"].get("autoscalerOptions") or {}
            head = cluster["spec"]["headGroupSpec"]["template"].get("spec", {})
            at = f"RayCluster/{cluster['metadata']['name']}/autoscaler"
            problems += resource_problems(at, options.get("resources"))
            problems += hardening_problems(at, options.get("securityContext") or {}, head.get("securityContext") or {})
    return problems


def rbac_problems(docs: list[dict]) -> list[str]:
    problems = []
    for doc in docs:
        kind, name, _ = key(doc)
        if kind in ("ClusterRole", "ClusterRoleBinding"):
            problems.append(f"{kind}/{name}: cluster-wide RBAC; the pipeline needs a namespaced Role")
        if kind == "Role":
            for index, rule in enumerate(doc.get("rules", [])):
                at = f"Role/{name} rule {index}"
                verbs = set(rule.get("verbs", []))
                pairs = {(g, r) for g in rule.get("apiGroups", []) for r in rule.get("resources", [])}
                granted = set.intersection(*(NAMED_GRANTS.get(p, set()) for p in pairs)) if pairs else set()
                if not verbs <= ALLOWED_VERBS | granted:
                    problems.append(f"{at}: verbs {sorted(verbs - ALLOWED_VERBS - granted)} not allowed")
                for field in ("apiGroups", "resources", "verbs", "resourceNames"):
                    if "*" in rule.get(field, []):
                        problems.append(f"{at}: wildcard in {field}")
                if "secrets" in rule.get("resources", []):
                    if not rule.get("resourceNames"):
                        problems.append(f"{at}: secrets without resourceNames")
                    if verbs != {"get"}:
                        problems.append(f"{at}: secrets allow only get (list ignores resourceNames)")
        if kind == "RoleBinding":
            ref = doc.get("roleRef", {})
            if ref.get("kind") != "Role" or not find(docs, "Role", ref.get("name")):
                problems.append(f"RoleBinding/{name}: roleRef {ref} is not a Role here")
            for subject in doc.get("subjects", []):
                accounts = find(docs, subject.get("kind", ""), subject.get("name"))
                external = subject.get("kind") == "ServiceAccount" and subject.get("name") in EXTERNAL_ACCOUNTS
                if subject.get("kind") != "ServiceAccount" or not (accounts or external):
                    problems.append(f"RoleBinding/{name}: subject {subject} is not a ServiceAccount here")
                elif subject.get("namespace") != key(doc)[2] or (
                    accounts and subject.get("namespace") != accounts[0]["metadata"].get("namespace")
                ):
                    # A Role grants in its own namespace: its pods run there.
                    problems.append(f"RoleBinding/{name}: subject namespace {subject.get('namespace')}")
    return problems


def secret_problems(docs: list[dict]) -> list[str]:
    """No Secret is applied (its value would be deployed, and applying again would overwrite
    the operator's), and no placeholder is either, anywhere: the only REPLACE_ME allowed is
    in the command of the init containers that refuse it."""
    problems = []
    for secret in find(docs, "Secret"):
        kind, name, namespace = key(secret)
        problems.append(
            f"Secret/{name} ({namespace}): applied with the manifests, so `kubectl apply -k` deploys its "
            "value; the operator creates it (manifests/README.md, Secrets)"
        )
    for doc in docs:
        text = json.dumps(_without_secret_checks(doc))
        if PLACEHOLDER in text:
            problems.append(
                "{}/{}: holds the placeholder {} (it would be applied as it is)".format(*key(doc)[:2], PLACEHOLDER)
            )
    return problems


def _without_secret_checks(doc: dict) -> dict:
    """The document without the commands of its check-secrets init containers."""
    doc = copy.deepcopy(doc)
    for _, template in pod_templates(doc):
        for container in (template.get("spec") or {}).get("initContainers", []):
            if container.get("name") == SECRET_CHECK:
                container.pop("command", None)
    return doc


def _secret_keys(docs: list[dict], namespace: str | None) -> dict[str, set[str]]:
    """The secrets the operator creates in ``namespace`` and their keys: the platform's in
    `drmas`, the pipeline side's where the Role drmas-pipeline is."""
    if namespace == PLATFORM_NAMESPACE:
        return OPERATOR_SECRETS[PLATFORM_NAMESPACE]
    if any(key(role)[2] == namespace for role in find(docs, "Role", PIPELINE_ROLE)):
        return OPERATOR_SECRETS["pipelines"]
    return {}


def _consumed(template: dict, namespace: str | None, docs: list[dict], *, init: bool = False) -> dict[str, tuple]:
    """VAR -> (secret, key) for every secret value the pod's containers get as a variable
    (``init``: its check-secrets init container; otherwise every other container)."""
    spec = template.get("spec") or {}
    containers = [
        c
        for c in list(spec.get("initContainers", [])) + list(spec.get("containers", []))
        if (c.get("name") == SECRET_CHECK) == init
    ]
    found: dict[str, tuple] = {}
    for container in containers:
        for source in container.get("envFrom", []):
            name = (source.get("secretRef") or {}).get("name")
            if name:
                for entry in sorted(_secret_keys(docs, namespace).get(name, ())):
                    found[source.get("prefix", "") + entry] = (name, entry)
        for env in container.get("env", []):
            ref = (env.get("valueFrom") or {}).get("secretKeyRef")
            if ref:
                found[env["name"]] = (ref.get("name"), ref.get("key"))
    return found


def secret_check_problems(docs: list[dict]) -> list[str]:
    """Every pod that gets a secret starts with an init container, check-secrets, that is
    given each such value and refuses it empty or holding the placeholder, naming the
    secret and key: VAR=secret/key arguments that match the container's own variables."""
    problems = []
    commands = set()
    for where, template, doc in all_templates(docs):
        namespace = key(doc)[2]
        wanted = set(_consumed(template, namespace, docs).values())
        inits = (template.get("spec") or {}).get("initContainers", [])
        if not wanted:
            continue
        if not inits or inits[0].get("name") != SECRET_CHECK:
            problems.append(f"{where}: gets secrets {sorted(wanted)} but its first init container is no {SECRET_CHECK}")
            continue
        check = inits[0]
        commands.add(json.dumps(check.get("command")))
        given = _consumed(template, namespace, docs, init=True)
        checked = set()
        for arg in check.get("args", []):
            var, _, ref = str(arg).partition("=")
            secret, _, entry = ref.partition("/")
            if given.get(var) != (secret, entry):
                problems.append(f"{where}: {SECRET_CHECK} checks {var} as {ref}, but its {var} is {given.get(var)}")
            else:
                checked.add((secret, entry))
        for secret, entry in sorted(wanted - checked):
            problems.append(f"{where}: gets {secret}/{entry} but {SECRET_CHECK} does not refuse a placeholder there")
    if len(commands) > 1:
        problems.append(f"{SECRET_CHECK}: {len(commands)} different commands; one script checks every pod")
    return problems


def reference_problems(docs: list[dict]) -> list[str]:
    """Every secret, key, claim and Service selector names something that is rendered."""
    problems = []
    claims = {c["metadata"]["name"] for c in find(docs, "PersistentVolumeClaim")}
    configs = {key(c)[1:]: set(c.get("data") or {}) for c in find(docs, "ConfigMap")}
    for where, template, doc in all_templates(docs):
        spec = template.get("spec") or {}
        secrets = _secret_keys(docs, key(doc)[2])
        for container in pod_containers(template):
            for env in container.get("env", []):
                ref = (env.get("valueFrom") or {}).get("secretKeyRef")
                if ref and ref.get("key") not in secrets.get(ref.get("name"), set()):
                    problems.append(f"{where}: env {env['name']} refers to missing {ref}")
            for source in container.get("envFrom", []):
                ref = source.get("secretRef")
                if ref and ref.get("name") not in secrets:
                    problems.append(f"{where}: envFrom refers to missing secret {ref}")
        for volume in spec.get("volumes", []):
            claim = (volume.get("persistentVolumeClaim") or {}).get("claimName")
            if claim and claim not in claims:
                problems.append(f"{where}: volume {volume['name']} claims missing PVC {claim}")
            config = (volume.get("configMap") or {}).get("name")
            if config and (config, key(doc)[2]) not in configs:
                problems.append(f"{where}: volume {volume['name']} mounts missing ConfigMap {config}")
    labels = [(t.get("metadata") or {}).get("labels") or {} for _, t, _ in all_templates(docs)]
    for service in find(docs, "Service"):
        selector = service["spec"].get("selector") or {}
        if not any(selector.items() <= pod.items() for pod in labels):
            problems.append(f"Service/{service['metadata']['name']}: selector {selector} selects no pod")
    return problems


def mlflow_problems(docs: list[dict]) -> list[str]:
    """An MLflow server keeps runs in a database and proxies artifacts to S3."""
    problems = []
    for where, template, _ in all_templates(docs):
        for container in pod_containers(template):
            if container.get("command", [])[:2] != ["mlflow", "server"]:
                continue
            args = server_args(container)
            backend = urlparse(str(args.get("--backend-store-uri", "")))
            if backend.scheme.split("+")[0] not in ("postgresql", "mysql"):
                problems.append(f"{where}: --backend-store-uri is not a database (file store?)")
            elif backend.password is not None:
                problems.append(f"{where}: database password in --backend-store-uri")
            if urlparse(str(args.get("--artifacts-destination", ""))).scheme != "s3":
                problems.append(f"{where}: --artifacts-destination is not s3://")
            if args.get("--serve-artifacts") is not True or "--no-serve-artifacts" in args:
                problems.append(f"{where}: artifacts are not served (--serve-artifacts)")
            if "--default-artifact-root" in args:
                problems.append(f"{where}: --default-artifact-root bypasses the artifact proxy")
            problems += _mlflow_auth_problems(where, template, container, args, docs)
    return problems


def _mlflow_auth_problems(where: str, template: dict, container: dict, args: dict, docs: list[dict]) -> list[str]:
    """MLflow's basic-auth app: on, its admin account and form key from secrets, and its
    settings from a ConfigMap file that keeps users in a database and holds no password."""
    if args.get("--app-name") != MLFLOW_AUTH_APP:
        return [f"{where}: no authentication (--app-name={MLFLOW_AUTH_APP}): anyone who reaches it may write"]
    problems = []
    env = {e.get("name"): e for e in container.get("env", [])}
    for name in MLFLOW_AUTH_ENV:
        if not ((env.get(name) or {}).get("valueFrom") or {}).get("secretKeyRef"):
            problems.append(f"{where}: {name} does not come from a secret")
    path = str((env.get("MLFLOW_AUTH_CONFIG_PATH") or {}).get("value", ""))
    mounts = {m.get("mountPath", "").rstrip("/"): m.get("name") for m in container.get("volumeMounts", [])}
    volumes = {v.get("name"): v for v in (template.get("spec") or {}).get("volumes", [])}
    directory, _, file = path.rpartition("/")
    config_map = (volumes.get(mounts.get(directory)) or {}).get("configMap") or {}
    text = next(
        ((c.get("data") or {}).get(file) for c in find(docs, "ConfigMap", config_map.get("name")) if config_map),
        None,
    )
    if text is None:
        return problems + [
            f"{where}: MLFLOW_AUTH_CONFIG_PATH {path!r} is no file of a mounted ConfigMap (MLflow's default keeps "
            "users in a SQLite file inside the container, lost on restart)"
        ]
    settings = configparser.ConfigParser()
    settings.read_string(text)
    mlflow = settings["mlflow"] if settings.has_section("mlflow") else {}
    database = urlparse(str(mlflow.get("database_uri", "")))
    if database.scheme.split("+")[0] not in ("postgresql", "mysql"):
        problems.append(f"{where}: basic-auth's database_uri is not a database (users lost on restart)")
    elif database.password is not None:
        problems.append(f"{where}: database password in basic-auth's database_uri")
    if "admin_password" in mlflow:
        problems.append(f"{where}: admin_password in basic-auth's settings, a ConfigMap (it comes from a secret)")
    if mlflow.get("default_permission") not in MLFLOW_PERMISSIONS:
        problems.append(f"{where}: basic-auth's default_permission {mlflow.get('default_permission')!r}")
    return problems


def _labels(template: dict) -> dict:
    return (template.get("metadata") or {}).get("labels") or {}


def _matches(selector: dict | None, labels: dict) -> bool:
    """Whether a label selector (matchLabels only: these manifests use nothing else)
    selects these labels."""
    selector = selector or {}
    if selector.get("matchExpressions"):
        return False
    return (selector.get("matchLabels") or {}).items() <= labels.items()


def _unknown_fields(where: str, node: object, allowed: set[str]) -> list[str]:
    if not isinstance(node, dict):
        return [f"{where}: expected a mapping, got {node!r}"]
    return [f"{where}: unknown field {name!r} (the launcher ignores it)" for name in sorted(set(node) - allowed)]


def _endpoint(url_or_host: str, disable_ssl: bool | None = None) -> tuple[str, str]:
    """(scheme, host:port) of an S3 endpoint given as a URL or, as KFP's launcher takes it,
    host[:port] with disableSSL choosing http."""
    if "://" in url_or_host:
        parsed = urlparse(url_or_host)
        return parsed.scheme, parsed.netloc
    return ("http" if disable_ssl else "https"), url_or_host


def launcher_problems(docs: list[dict]) -> list[str]:
    """KFP's launcher settings: an s3:// pipeline root (not KFP's minio://mlpipeline
    fallback) and an s3 provider whose fields are the ones KFP's source reads, with
    credentials from a secret the operator creates there (with those keys) and the Role
    lets the launcher read, and an endpoint as host[:port]. (Which endpoint the operator's
    drmas-s3 names, the manifests cannot know: test_the_documented_secrets_... checks the
    shipped endpoint against the documented command.)"""
    problems = []
    for config in find(docs, "ConfigMap", LAUNCHER_CONFIGMAP):
        namespace = key(config)[2]
        at = f"ConfigMap/{LAUNCHER_CONFIGMAP} ({namespace})"
        data = config.get("data") or {}
        problems += [f"{at}: unknown key {k!r}" for k in sorted(set(data) - LAUNCHER_KEYS)]
        root = str(data.get("defaultPipelineRoot", ""))
        if urlparse(root).scheme != "s3":
            problems.append(f"{at}: defaultPipelineRoot {root!r} is not s3:// (KFP falls back to minio://mlpipeline)")
        try:
            providers = yaml.safe_load(str(data.get("providers", ""))) or {}
        except yaml.YAMLError as error:
            problems.append(f"{at}: providers is not YAML: {error}")
            continue
        problems += _unknown_fields(f"{at} providers", providers, LAUNCHER_PROVIDERS)
        s3 = providers.get("s3") if isinstance(providers, dict) else None
        if not isinstance(s3, dict) or not isinstance(s3.get("default"), dict):
            problems.append(f"{at}: no providers.s3.default (the launcher opens s3:// URIs with no credentials)")
            continue
        problems += _unknown_fields(f"{at} s3", s3, S3_PROVIDER_FIELDS)
        secrets = _secret_keys(docs, namespace)
        roles = [r for r in find(docs, "Role") if key(r)[2] == namespace]
        sources = [("s3.default", s3["default"], S3_DEFAULT_FIELDS)]
        sources += [(f"s3.overrides[{i}]", o, S3_OVERRIDE_FIELDS) for i, o in enumerate(s3.get("overrides") or [])]
        for where, source, fields in sources:
            where = f"{at} {where}"
            problems += _unknown_fields(where, source, fields)
            credentials = source.get("credentials") or {}
            problems += _unknown_fields(f"{where}.credentials", credentials, S3_CREDENTIAL_FIELDS)
            if credentials.get("fromEnv") is not False:
                problems.append(f"{where}: credentials.fromEnv is not false (the launcher has no S3 keys in its env)")
                continue
            ref = credentials.get("secretRef") or {}
            problems += _unknown_fields(f"{where}.credentials.secretRef", ref, S3_SECRET_REF_FIELDS)
            name = ref.get("secretName")
            if name not in secrets:
                problems.append(
                    f"{where}: secretRef names secret {name!r}, not one the operator creates in {namespace}"
                )
                continue
            for field in ("accessKeyKey", "secretKeyKey"):
                if ref.get(field) not in secrets[name]:
                    problems.append(f"{where}: secretRef.{field} {ref.get(field)!r} is missing in secret {name}")
            if roles and not any(
                "secrets" in rule.get("resources", [])
                and "get" in rule.get("verbs", [])
                and name in rule.get("resourceNames", [])
                for role in roles
                for rule in role.get("rules", [])
            ):
                problems.append(f"{where}: no Role in {namespace} lets the launcher get secret {name}")
            endpoint = str(source.get("endpoint") or "")
            if not endpoint:
                if "overrides" not in where:
                    problems.append(f"{where}: no endpoint")
                continue
            if "://" in endpoint:
                problems.append(f"{where}: endpoint {endpoint!r} has a scheme (host[:port]; disableSSL chooses http)")
            if not isinstance(source.get("disableSSL", False), bool):
                problems.append(f"{where}: disableSSL is not a boolean")
    return problems


def _guarded_pods(docs: list[dict]) -> list[tuple[str, dict, str | None]]:
    """(where, labels, namespace) of every pod that must sit behind a NetworkPolicy."""
    guarded = []
    for where, template, doc in all_templates(docs):
        ports = {p.get("containerPort") for c in pod_containers(template) for p in c.get("ports", [])}
        if doc["kind"] == "RayCluster" or ports & GUARDED_PORTS:
            guarded.append((where, _labels(template), key(doc)[2]))
    return guarded


def _ingress_policies(docs: list[dict], labels: dict, namespace: str | None) -> list[dict]:
    return [
        policy
        for policy in find(docs, "NetworkPolicy")
        if key(policy)[2] == namespace
        and "Ingress" in policy["spec"].get("policyTypes", ["Ingress"])
        and _matches(policy["spec"].get("podSelector"), labels)
    ]


def _admits(peer: dict, labels: dict, namespace: str, policy_namespace: str | None) -> bool:
    """Whether a `from` peer admits a pod with these labels in this namespace."""
    if "namespaceSelector" in peer:
        if not _matches(peer["namespaceSelector"], {"kubernetes.io/metadata.name": namespace}):
            return False
    elif namespace != policy_namespace:
        return False
    return _matches(peer.get("podSelector"), labels)


def _reaches(docs: list[dict], labels: dict, namespace: str | None, port: int, source: dict, origin: str) -> bool:
    """Whether the policies selecting a pod (labels, namespace) admit pods with the labels
    `source` in the namespace `origin` on `port`."""
    return any(
        (not rule.get("ports") or port in {p.get("port") for p in rule["ports"]})
        and any(_admits(peer, source, origin, namespace) for peer in rule.get("from", []))
        for policy in _ingress_policies(docs, labels, namespace)
        for rule in policy["spec"].get("ingress", [])
    )


def network_problems(docs: list[dict]) -> list[str]:
    """Ray, MLflow, its database and the retrieval service admit only the pods that use
    them: every guarded pod is selected by a NetworkPolicy; every rule names its sources by
    pod labels (a whole namespace only for MLflow's UI label) and its ports (unless it
    admits the selected pods themselves); the pipeline pods of each namespace the pipeline
    Role is bound in do reach the Ray head, MLflow and the retrieval service; and the Ray
    pods reach the retrieval service."""
    problems = []
    for where, labels, namespace in _guarded_pods(docs):
        if not _ingress_policies(docs, labels, namespace):
            problems.append(f"{where}: open to every pod in the cluster (no NetworkPolicy selects it)")
    for policy in find(docs, "NetworkPolicy"):
        name, namespace = key(policy)[1:]
        selector = policy["spec"].get("podSelector") or {}
        for index, rule in enumerate(policy["spec"].get("ingress", [])):
            at = f"NetworkPolicy/{name} ingress {index}"
            ports = {p.get("port") for p in rule.get("ports", [])}
            if rule.get("ports") and ports <= OPEN_PORTS:
                continue
            if not rule.get("from"):
                problems.append(f"{at}: admits every source")
                continue
            for peer in rule["from"]:
                pods = (peer.get("podSelector") or {}).get("matchLabels")
                spaces = (peer.get("namespaceSelector") or {}).get("matchLabels") or {}
                if "ipBlock" in peer:
                    problems.append(f"{at}: admits an ipBlock")
                elif not pods and set(spaces) != {UI_NAMESPACE_LABEL}:
                    problems.append(f"{at}: admits every pod of {spaces or 'the namespace'} (no podSelector)")
                elif not rule.get("ports") and (peer != {"podSelector": selector}):
                    problems.append(f"{at}: admits {pods or spaces} on every port (name the ports)")
                elif pods == PIPELINE_POD_LABEL and not ports <= GUARDED_PORTS - {5432}:
                    problems.append(f"{at}: admits pipeline pods on ports {sorted(ports - GUARDED_PORTS)}")
                if KFP_POD_LABEL in (pods or {}):
                    problems.append(
                        f"{at}: admits every KFP v2 pod ({KFP_POD_LABEL}, on every pod of every pipeline), "
                        f"not drmas's steps ({POD_LABEL[0]})"
                    )
    pipeline_namespaces = {
        key(binding)[2]
        for binding in find(docs, "RoleBinding")
        if binding.get("roleRef", {}).get("name") == PIPELINE_ROLE
    }
    for target, port in PIPELINE_TARGETS:
        for where, labels, namespace in _guarded_pods(docs):
            if not _matches({"matchLabels": target}, labels):
                continue
            for pipelines in sorted(pipeline_namespaces, key=str):
                if not _reaches(docs, labels, namespace, port, PIPELINE_POD_LABEL, pipelines):
                    problems.append(f"{where}: pipeline pods in {pipelines} cannot reach port {port}")
    ray_pods = [
        (where, labels, namespace)
        for where, labels, namespace in _guarded_pods(docs)
        if _matches({"matchLabels": RAY_POD_LABEL}, labels)
    ]
    for target, port in RAY_TARGETS:
        for where, labels, namespace in _guarded_pods(docs):
            if not _matches({"matchLabels": target}, labels):
                continue
            # Without a RayCluster rendered (an add-on alone), the platform's Ray pods.
            clients = [(w, pod) for w, pod, n in ray_pods if n == namespace] or [("Ray pods", RAY_POD_LABEL)]
            for client, client_labels in clients:
                if not _reaches(docs, labels, namespace, port, client_labels, namespace):
                    problems.append(f"{where}: Ray pods ({client}) cannot reach port {port}")
    return problems


def _secret_refs(template: dict) -> set[str]:
    """The secrets a pod gets: env, envFrom, volumes (projected too)."""
    spec = template.get("spec") or {}
    names = set()
    for container in pod_containers(template):
        for env in container.get("env", []):
            names.add(((env.get("valueFrom") or {}).get("secretKeyRef") or {}).get("name"))
        for source in container.get("envFrom", []):
            names.add((source.get("secretRef") or {}).get("name"))
    for volume in spec.get("volumes", []):
        names.add((volume.get("secret") or {}).get("secretName"))
        for source in (volume.get("projected") or {}).get("sources", []):
            names.add((source.get("secret") or {}).get("name"))
    return names - {None}


def secret_user_problems(docs: list[dict]) -> list[str]:
    """Each secret reaches only the pods that use it (SECRET_USERS)."""
    problems = []
    for where, template, _ in all_templates(docs):
        for name in sorted(_secret_refs(template)):
            users = SECRET_USERS.get(name, {})
            if not any(fnmatch(where, pattern) for pattern in users):
                problems.append(f"{where}: gets secret {name} but does not use it")
    return problems


def ray_auth_problems(docs: list[dict]) -> list[str]:
    """Ray token authentication: KubeRay's authOptions name a Secret with the token, and the
    head and workers set RAY_AUTH_MODE=token and RAY_AUTH_TOKEN from that Secret."""
    problems = []
    clusters = [(f"RayCluster/{key(c)[1]}", c["spec"], c) for c in find(docs, "RayCluster")]
    clusters += [
        (f"RayJob/{key(j)[1]}", j["spec"]["rayClusterSpec"], j)
        for j in find(docs, "RayJob")
        if "rayClusterSpec" in j.get("spec", {})
    ]
    for at, spec, doc in clusters:
        options = spec.get("authOptions") or {}
        secret = options.get("secretName")
        if options.get("mode") != "token":
            problems.append(f"{at}: no token authentication (authOptions.mode: token)")
        elif RAY_TOKEN_SECRET_KEY not in _secret_keys(docs, key(doc)[2]).get(secret, {}):
            problems.append(f"{at}: authOptions.secretName {secret!r} is no secret with key {RAY_TOKEN_SECRET_KEY}")
        for where, template in ray_cluster_templates(at, spec):
            (container, *_) = template.get("spec", {}).get("containers") or [{}]
            env = {e.get("name"): e for e in container.get("env", [])}
            if (env.get("RAY_AUTH_MODE") or {}).get("value") != "token":
                problems.append(f"{where}: RAY_AUTH_MODE is not token")
            ref = ((env.get("RAY_AUTH_TOKEN") or {}).get("valueFrom") or {}).get("secretKeyRef") or {}
            if ref != {"name": secret, "key": RAY_TOKEN_SECRET_KEY}:
                problems.append(f"{where}: RAY_AUTH_TOKEN does not come from {secret}/{RAY_TOKEN_SECRET_KEY}")
    for where, template, _ in all_templates(docs):
        for container in pod_containers(template):
            for env in container.get("env", []):
                if env.get("name") == "RAY_AUTH_MODE" and env.get("value") != "token":
                    problems.append(f"{where}: RAY_AUTH_MODE={env.get('value')}")
    return problems


def _port_number(container: dict, port: object) -> object:
    """A probe's or Service's port as a number: a name is looked up in the container's ports."""
    named = {p.get("name"): p.get("containerPort") for p in container.get("ports", [])}
    return named.get(port, port) if isinstance(port, str) else port


def retrieval_problems(docs: list[dict]) -> list[str]:
    """The retrieval service (`drmas serve-retrieval`): it binds all addresses on a declared
    port that a Service sends to; startup, readiness and liveness probes GET /health there,
    the startup probe allowing RETRIEVAL_STARTUP_S for the index to load; its root
    filesystem is read-only, with TMPDIR=/tmp on an emptyDir (the index is fetched there).
    `--build-only` runs only as a Job (it exits), with the same corpus and store as every
    server, so that the server loads the cache the Job built instead of building its own."""
    problems = []
    servers, builders = [], []
    for where, template, doc in all_templates(docs):
        spec = template.get("spec") or {}
        for container in spec.get("containers", []):
            if container.get("command", [])[:2] != RETRIEVAL_COMMAND:
                continue
            at = f"{where}/{container.get('name')}"
            args = server_args(container)
            build_only = args.get("--build-only") is True
            (builders if build_only else servers).append((at, args))
            for flag in ("--corpus", "--store"):
                if not isinstance(args.get(flag), str) or not args[flag]:
                    problems.append(f"{at}: no {flag}=... (the default is not the cluster's)")
            if (container.get("securityContext") or {}).get("readOnlyRootFilesystem") is not True:
                problems.append(f"{at}: readOnlyRootFilesystem is not true")
            mounts = {m.get("mountPath"): m.get("name") for m in container.get("volumeMounts", [])}
            volumes = {v.get("name"): v for v in spec.get("volumes", [])}
            if "emptyDir" not in volumes.get(mounts.get("/tmp"), {}):
                problems.append(f"{at}: /tmp is not an emptyDir (a read-only root has nowhere to fetch the index)")
            if {e.get("name"): e.get("value") for e in container.get("env", [])}.get("TMPDIR") != "/tmp":
                problems.append(f"{at}: TMPDIR is not /tmp")
            if build_only:
                if doc["kind"] != "Job":
                    problems.append(f"{at}: --build-only exits when the index is cached: run it as a Job")
                continue
            host = args.get("--host", "127.0.0.1")
            if host != "0.0.0.0":
                problems.append(f"{at}: --host {host} binds {host}: no Service or other pod reaches it")
            port = int(str(args.get("--port", 0))) if str(args.get("--port", "")).isdigit() else None
            if port is None or port not in {p.get("containerPort") for p in container.get("ports", [])}:
                problems.append(f"{at}: --port {args.get('--port')} is not one of the container's ports")
            for name in ("startupProbe", "readinessProbe", "livenessProbe"):
                get = (container.get(name) or {}).get("httpGet") or {}
                if get.get("path") != RETRIEVAL_HEALTH or _port_number(container, get.get("port")) != port:
                    problems.append(f"{at}: {name} is not GET {RETRIEVAL_HEALTH} on port {port}")
            startup = container.get("startupProbe") or {}
            budget = startup.get("initialDelaySeconds", 0) + startup.get("periodSeconds", 10) * startup.get(
                "failureThreshold", 3
            )
            if budget < RETRIEVAL_STARTUP_S:
                problems.append(
                    f"{at}: startupProbe allows {budget} s, under {RETRIEVAL_STARTUP_S} s: the pod is "
                    "restarted while a wiki-scale index loads"
                )
            labels = _labels(template)
            if not any(
                (service["spec"].get("selector") or {}).items() <= labels.items()
                and key(service)[2] == key(doc)[2]
                and any(
                    _port_number(container, p.get("targetPort", p.get("port"))) == port
                    for p in service["spec"].get("ports", [])
                )
                for service in find(docs, "Service")
            ):
                problems.append(f"{at}: no Service sends to port {port}")
    for at, args in servers:
        wanted = {k: v for k, v in args.items() if k not in RETRIEVAL_SERVER_ARGS}
        for job, job_args in builders:
            cached = {k: v for k, v in job_args.items() if k not in RETRIEVAL_SERVER_ARGS}
            if cached != wanted:
                problems.append(
                    f"{job}: indexes {cached}, but {at} serves {wanted}: the service would build its own index"
                )
    return problems


HOST = re.compile(
    r"(?:(?P<scheme>[a-z][a-z0-9+.-]*)://(?:[^@/\s]*@)?)?"
    r"(?P<host>[a-z0-9](?:[a-z0-9-]*[a-z0-9])?(?:\.[a-z0-9](?:[a-z0-9-]*[a-z0-9])?)*)"
    r"(?::(?P<port>\d+))?"
)


def _addresses(doc: dict) -> Iterator[tuple[str, str]]:
    """(where, text) of the values that may name a Service: secret and ConfigMap values,
    container commands, args and env values (not --allowed-hosts, which lists Host headers
    MLflow accepts, not addresses it connects to)."""
    kind, name, _ = key(doc)
    for field in ("stringData", "data"):
        if kind in ("Secret", "ConfigMap"):
            for entry, value in (doc.get(field) or {}).items():
                yield f"{kind}/{name} {entry}", str(value)
    for where, template in pod_templates(doc):
        for container in pod_containers(template):
            at = f"{where}/{container.get('name')}"
            for arg in container.get("command", []) + container.get("args", []):
                if not str(arg).startswith("--allowed-hosts"):
                    yield at, str(arg)
            for env in container.get("env", []):
                if "value" in env:
                    yield f"{at} env {env['name']}", str(env["value"])


def service_name_problems(docs: list[dict]) -> list[str]:
    """A Service in another namespace is named name.namespace.svc.cluster.local: pods in
    other namespaces resolve a short name in their own namespace, and name.namespace.svc
    depends on the resolver's search path."""
    problems = []
    services = {(key(s)[1], key(s)[2]) for s in find(docs, "Service")}
    names = {name for name, _ in services}
    for doc in docs:
        for where, text in _addresses(doc):
            for match in HOST.finditer(text):
                scheme, host, port = match.group("scheme", "host", "port")
                if scheme in BUCKET_SCHEMES or not (scheme or port or ".svc" in host):
                    continue
                labels = host.split(".")
                if ".svc" in host and not host.endswith(".svc.cluster.local"):
                    problems.append(f"{where}: {host} is not fully qualified (.svc.cluster.local)")
                elif len(labels) == 2 and tuple(labels) in services:
                    problems.append(f"{where}: {host} is not fully qualified (.svc.cluster.local)")
                elif len(labels) == 1 and host in names and (host, key(doc)[2]) not in services:
                    problems.append(f"{where}: {host} names a Service of another namespace by its short name")
    return problems


def ephemeral_storage_problems(docs: list[dict]) -> list[str]:
    """Each pipeline namespace (where the steps' Role is) gives its containers a default
    ephemeral-storage request (KFP cannot ask per task) and no default limit (one under
    what an update writes would evict it)."""
    found = []
    for role in find(docs, "Role", "drmas-pipeline"):
        namespace = role["metadata"].get("namespace")
        limits = [
            limit
            for doc in find(docs, "LimitRange")
            if doc["metadata"].get("namespace") == namespace
            for limit in doc["spec"].get("limits", [])
            if limit.get("type") == "Container"
        ]
        if not any("ephemeral-storage" in limit.get("defaultRequest", {}) for limit in limits):
            found.append(f"pipeline namespace {namespace}: no default ephemeral-storage request (LimitRange)")
        if any("ephemeral-storage" in limit.get("default", {}) for limit in limits):
            found.append(f"pipeline namespace {namespace}: a default ephemeral-storage limit would evict updates")
    return found


def duplicate_problems(docs: list[dict]) -> list[str]:
    keys = [key(doc) for doc in docs]
    return [f"{k}: defined twice" for k in sorted(set(keys), key=str) if keys.count(k) > 1]


def problems(docs: list[dict]) -> list[str]:
    return (
        duplicate_problems(docs)
        + schema_problems(docs)
        + pod_problems(docs)
        + rbac_problems(docs)
        + secret_problems(docs)
        + secret_check_problems(docs)
        + reference_problems(docs)
        + mlflow_problems(docs)
        + launcher_problems(docs)
        + network_problems(docs)
        + secret_user_problems(docs)
        + ray_auth_problems(docs)
        + service_name_problems(docs)
        + retrieval_problems(docs)
        + ephemeral_storage_problems(docs)
    )


def server_args(container: dict) -> dict[str, str | bool]:
    """--flag=value arguments of a container as a dict (a bare --flag maps to True)."""
    parsed: dict[str, str | bool] = {}
    for arg in container.get("args", []):
        name, sep, value = arg.partition("=")
        parsed[name] = value if sep else True
    return parsed


def gpu_configs() -> list[dict]:
    return [yaml.safe_load(path.read_text()) for path in GPU_CONFIGS]


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_kustomization_renders_and_keeps_every_rule(name: str) -> None:
    docs = rendered(name)
    assert docs
    if name in ADDONS:  # on top of the platform, whose secrets it names
        docs = rendered("base") + docs
    assert problems(docs) == []


def test_rendering_applies_namespace_images_and_patches() -> None:
    base, store, jobs, standalone, profile, retrieval, index = (rendered(name) for name in KUSTOMIZATIONS)
    assert sorted(doc["kind"] for doc in base) == sorted(
        ["Namespace", "ConfigMap", "RayCluster"]
        + ["PersistentVolumeClaim"] * 2
        + ["Deployment", "Service"] * 2
        + ["NetworkPolicy"] * 3
    )
    assert {d["kind"] for d in store} - {d["kind"] for d in base} == {"StatefulSet"}
    assert [d["kind"] for d in jobs] == ["RayJob"]
    # The retrieval service and its index Job: their own objects only, none of the platform's.
    assert sorted(d["kind"] for d in retrieval) == ["Deployment", "NetworkPolicy", "Service"]
    assert [d["kind"] for d in index] == ["Job"]
    for doc in base + store + jobs + retrieval + index:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "drmas", key(doc)
    assert one(base, "Namespace")["metadata"]["name"] == "drmas"
    # The install modes: the pipeline side in the pipeline namespace, the policies that
    # admit it next to what they guard. No Namespace objects: those namespaces are KFP's.
    for docs, pipelines in ((standalone, "kubeflow"), (profile, "kubeflow-user-example-com")):
        assert not find(docs, "Namespace")
        for doc in docs:
            expected = "drmas" if doc["kind"] == "NetworkPolicy" else pipelines
            assert doc["metadata"]["namespace"] == expected, key(doc)
    assert sorted(d["kind"] for d in standalone) == sorted(
        ["ServiceAccount", "Role", "RoleBinding", "ConfigMap", "LimitRange"] + ["NetworkPolicy"] * 3
    )
    assert sorted(d["kind"] for d in profile) == sorted(d["kind"] for d in standalone if d["kind"] != "ServiceAccount")
    # Every object is one the validators know: core kinds (kubernetes-validate) or ray.io/v1.
    assert {d["apiVersion"] for d in base + store + jobs + standalone + profile + retrieval + index} <= {
        "v1",
        "apps/v1",
        "batch/v1",
        "rbac.authorization.k8s.io/v1",
        "networking.k8s.io/v1",
        "ray.io/v1",
    }
    # No secret anywhere: the operator creates them.
    assert not find(base + store + jobs + standalone + profile + retrieval + index, "Secret")


@pytest.mark.parametrize("addons", [(), ADDONS], ids=["platform", "with-retrieval"])
@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("overlay", sorted(PIPELINE_OVERLAYS))
def test_platform_and_install_mode_keep_every_rule_together(
    platform: str, overlay: str, addons: tuple[str, ...]
) -> None:
    """What `kubectl apply -k <platform>`, `kubectl apply -k <overlay>` (and the retrieval
    service's kustomizations) send together."""
    docs = rendered(platform, overlay, *addons)
    assert problems(docs) == []
    assert network_problems(docs) == [], "the overlay's pipeline pods reach Ray, MLflow and retrieval"


def test_an_overlay_retags_images_inside_the_raycluster(tmp_path: Path) -> None:
    """What `kustomize edit set image` does to base: CRD containers are rewritten too."""
    new = "registry.example.com:5000/ml/drmas-gpu"
    overlay = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [str(MANIFESTS / "base")],
        "images": [{"name": "ghcr.io/drmas/drmas-gpu", "newName": new, "newTag": "0.1.0-1a2b3c4d5e6f"}],
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    docs = render(tmp_path)
    ray_images = [c["image"] for c in containers_anywhere(find(docs, "RayCluster"))]
    assert ray_images == [f"{new}:0.1.0-1a2b3c4d5e6f"] * 4, "head, worker and their check-secrets"
    assert _container(docs, "Deployment", "mlflow")["image"] == "ghcr.io/drmas/drmas-cpu:0.1.0"
    assert problems(docs) == []
    assert split_image(new) == (new, None)


def test_raycluster_is_the_pool_drmas_schedules_on() -> None:
    base = rendered("base")
    cluster = one(base, "RayCluster")
    spec = cluster["spec"]
    assert spec["enableInTreeAutoscaling"] is True
    ray_pin = next(
        d
        for d in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
        if d.startswith("ray[")
    )
    assert ray_pin.endswith(f"=={spec['rayVersion']}")

    pool_resource = RayConfig.model_fields["pool_resource"].default
    (group,) = spec["workerGroupSpecs"]
    assert 0 <= group["minReplicas"] <= group.get("replicas", 0) <= group["maxReplicas"]
    raw = group["rayStartParams"]["resources"].strip()
    assert raw.startswith('"') and raw.endswith('"'), "KubeRay wants the JSON quoted: '\"{...}\"'"
    advertised = json.loads(raw[1:-1].replace('\\"', '"'))
    (container,) = group["template"]["spec"]["containers"]
    gpus = int(container["resources"]["limits"]["nvidia.com/gpu"])
    assert advertised == {pool_resource: gpus}, "one pool slot per GPU of the worker"
    assert container["resources"]["requests"]["nvidia.com/gpu"] == container["resources"]["limits"]["nvidia.com/gpu"]

    head = spec["headGroupSpec"]["template"]["spec"]["containers"][0]
    ports = {p["containerPort"] for p in head["ports"]}
    for config in gpu_configs():
        address = urlparse(config["ray"]["address"])
        assert address.scheme == "ray" and address.port in ports
        # The head Service, by its short name or (pipeline steps run in other namespaces)
        # fully qualified.
        service = f"{cluster['metadata']['name']}-head-svc"
        assert address.hostname in (service, f"{service}.{cluster['metadata']['namespace']}.svc.cluster.local")
        slots_per_pod = advertised[pool_resource] if config["ray"]["pool_resource"] == pool_resource else gpus
        assert config["ray"]["pool_size"] <= group["maxReplicas"] * slots_per_pod
    assert GPU_CONFIGS, "the GPU configs are what the cluster is for"


def test_mlflow_server_uses_a_database_and_serves_artifacts_from_s3() -> None:
    base = rendered("base")
    deployment = one(base, "Deployment", "mlflow")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == ["mlflow", "server"]
    assert mlflow_problems(base) == []
    args = server_args(container)
    backend = urlparse(str(args["--backend-store-uri"]))
    database = one(base, "Service", backend.hostname)
    assert backend.port in {p["port"] for p in database["spec"]["ports"]}
    artifacts = urlparse(str(args["--artifacts-destination"]))
    env = {e["name"]: e for e in container["env"]}
    assert env["PGPASSWORD"]["valueFrom"]["secretKeyRef"]["name"] == "drmas-mlflow-db"
    assert env["MLFLOW_S3_ENDPOINT_URL"]["valueFrom"]["secretKeyRef"]["key"] == "AWS_ENDPOINT_URL"
    assert env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"]["value"] == "false"  # no GenAI job runner

    service = one(base, "Service", "mlflow")
    allowed = str(args["--allowed-hosts"]).split(",")
    for config in gpu_configs():
        tracking = urlparse(config["tracking"]["uri"])
        name, namespace = tracking.hostname.split(".")[:2]
        assert (name, namespace) == (service["metadata"]["name"], service["metadata"]["namespace"])
        assert tracking.port in {p["port"] for p in service["spec"]["ports"]}
        assert tracking.netloc in allowed, "MLflow would answer 403 to the runs' Host header"
        assert urlparse(config["store"]["root"]).netloc == artifacts.netloc, "one bucket"


def test_mlflow_runs_with_authentication() -> None:
    """MLflow's basic-auth app: the admin account it creates is the one drmas's clients log
    in with (the same keys of drmas-mlflow-auth: RayJob drivers on the Ray head here, the
    tracking steps in the pipeline namespace), its users live in the tracking database, and
    its probes use /health, which basic-auth leaves open."""
    base = rendered("base")
    deployment = one(base, "Deployment", "mlflow")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = server_args(container)
    assert args["--app-name"] == MLFLOW_AUTH_APP
    env = {e["name"]: e for e in container["env"]}
    refs = {name: env[name]["valueFrom"]["secretKeyRef"] for name in MLFLOW_AUTH_ENV}
    assert [refs["MLFLOW_AUTH_ADMIN_USERNAME"], refs["MLFLOW_AUTH_ADMIN_PASSWORD"]] == [
        {"name": MLFLOW_AUTH_SECRET, "key": key} for key in MLFLOW_AUTH_KEYS
    ]
    head = one(base, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    head_env = {e["name"]: e for e in head["env"]}
    for key_ in MLFLOW_AUTH_KEYS:  # MLflow's client reads MLFLOW_TRACKING_USERNAME/PASSWORD
        assert head_env[key_]["valueFrom"]["secretKeyRef"] == {"name": MLFLOW_AUTH_SECRET, "key": key_}
    settings = configparser.ConfigParser()
    settings.read_string(one(base, "ConfigMap", "mlflow-auth")["data"]["basic_auth.ini"])
    assert env["MLFLOW_AUTH_CONFIG_PATH"]["value"] == "/etc/mlflow-auth/basic_auth.ini"
    assert settings["mlflow"]["database_uri"] == args["--backend-store-uri"], "users in the tracking database"
    for probe in ("readinessProbe", "livenessProbe"):
        assert container[probe]["httpGet"]["path"] == "/health"
    assert mlflow_problems(base) == []


@pytest.mark.xfail(
    strict=True,
    reason="images/Dockerfile.cpu does not install mlflow[auth] (Flask-WTF) yet: `mlflow server --app-name "
    "basic-auth` exits with an ImportError until it does; remove this mark with that change",
)
def test_the_mlflow_image_has_the_basic_auth_app() -> None:
    """mlflow 3.17's basic-auth app imports flask_wtf, which only the mlflow[auth] extra brings."""
    dockerfile = (ROOT / "images" / "Dockerfile.cpu").read_text().lower()
    assert "mlflow[auth]" in dockerfile or "flask-wtf" in dockerfile or "flask_wtf" in dockerfile


def _secret_checks(docs: list[dict]) -> list[tuple[str, dict]]:
    return [
        (where, template["spec"]["initContainers"][0])
        for where, template, _ in all_templates(docs)
        if (template.get("spec") or {}).get("initContainers", [{}])[0].get("name") == SECRET_CHECK
    ]


def test_every_pod_that_gets_a_secret_refuses_a_placeholder_naming_the_secret(tmp_path: Path) -> None:
    """Each pod's check-secrets init container, run with sh as the kubelet would (its
    command and arguments, its secret variables): real values pass; an empty value or
    REPLACE_ME in any one key it gets fails it, with a message that names the secret and
    the key and never the value."""
    docs = rendered("object-store", *ADDONS)
    checks = _secret_checks(docs)
    assert {where for where, _ in checks} == {
        where for where, t, doc in all_templates(docs) if _consumed(t, key(doc)[2], docs)
    }
    assert len(checks) == 7 and secret_check_problems(docs) == []
    for where, check in checks:
        given = _consumed({"spec": {"initContainers": [check]}}, PLATFORM_NAMESPACE, docs, init=True)
        values = {var: f"value-of-{secret}-{entry}-x7" for var, (secret, entry) in given.items()}

        def run(env: dict[str, str], check: dict = check, given: dict = given) -> subprocess.CompletedProcess:
            clean = {k: v for k, v in os.environ.items() if k not in given}
            return subprocess.run(
                check["command"] + check["args"], env={**clean, **env}, capture_output=True, text=True, timeout=30
            )

        assert check["command"][:2] == ["sh", "-c"]
        done = run(values)
        assert done.returncode == 0 and done.stderr == "", (where, done.stderr)
        for var, (secret, entry) in given.items():
            for bad in (PLACEHOLDER, "", f"https://{PLACEHOLDER}.example.com"):
                done = run({**values, var: bad})
                assert done.returncode == 1, (where, var, bad)
                assert f"secret {secret}: key {entry} is empty or the placeholder" in done.stderr, done.stderr
                assert "value-of-" not in done.stderr
            missing = {k: v for k, v in values.items() if k != var}
            assert run(missing).returncode == 1, (where, var)


@pytest.mark.parametrize("overlay", sorted(PIPELINE_OVERLAYS))
def test_rbac_grants_only_named_gets_and_the_executor(overlay: str) -> None:
    docs = rendered(overlay)
    namespace = PIPELINE_OVERLAYS[overlay]
    role = one(docs, "Role")
    assert role["metadata"]["name"] == PIPELINE_ROLE
    by_resource = {(tuple(r["apiGroups"]), tuple(r["resources"])): r for r in role["rules"]}
    assert by_resource == {
        (("",), ("secrets",)): {
            "apiGroups": [""],
            "resources": ["secrets"],
            "resourceNames": ["drmas-s3"],
            "verbs": ["get"],
        },
        (("",), ("configmaps",)): {
            "apiGroups": [""],
            "resources": ["configmaps"],
            "resourceNames": [LAUNCHER_CONFIGMAP],
            "verbs": ["get"],
        },
        # Argo's executor >= 3.4 (docs/workflow-rbac.md): its outputs as WorkflowTaskResults.
        (("argoproj.io",), ("workflowtaskresults",)): {
            "apiGroups": ["argoproj.io"],
            "resources": ["workflowtaskresults"],
            "verbs": ["create", "patch"],
        },
    }
    binding = one(docs, "RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": PIPELINE_ROLE}
    account = "drmas-pipeline" if overlay == "kfp-standalone" else "default-editor"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": namespace}]
    assert [key(a) for a in find(docs, "ServiceAccount")] == (
        [("ServiceAccount", "drmas-pipeline", namespace)] if overlay == "kfp-standalone" else []
    )


@pytest.mark.parametrize(
    "names",
    [(name,) for name in KUSTOMIZATIONS] + [(p, o, *ADDONS) for p in PLATFORMS for o in sorted(PIPELINE_OVERLAYS)],
    ids=lambda names: "+".join(names),
)
def test_no_secret_and_no_placeholder_is_applied(names: tuple[str, ...]) -> None:
    """What `kubectl apply -k` sends holds no Secret (no value to deploy, none to overwrite)
    and no REPLACE_ME anywhere but in the check that refuses it."""
    docs = rendered(*names)
    assert not find(docs, "Secret")
    assert PLACEHOLDER not in json.dumps([_without_secret_checks(doc) for doc in docs])
    assert secret_problems(docs) == []


def documented_secret_commands(tmp_path: Path) -> list[dict]:
    """Runs the commands of manifests/README.md's "Secrets" section with a stand-in
    kubectl (and the real openssl): what they would create, one dict per command."""
    text = (MANIFESTS / "README.md").read_text()
    section = text[text.index("\n## Secrets\n") :]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    calls = tmp_path / "calls.jsonl"
    kubectl = tmp_path / "bin" / "kubectl"
    kubectl.parent.mkdir(parents=True)
    kubectl.write_text(
        f"#!{sys.executable}\nimport json, sys\nopen({str(calls)!r}, 'a').write(json.dumps(sys.argv[1:]) + '\\n')\n"
    )
    kubectl.chmod(0o755)
    env = {**os.environ, "PATH": f"{kubectl.parent}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(["bash", "-euo", "pipefail", "-c", block], check=True, env=env, cwd=ROOT, timeout=60)
    created = []
    for line in calls.read_text().splitlines():
        argv = json.loads(line)
        if "create" not in argv:
            continue
        namespace = argv[argv.index("-n") + 1]
        name = argv[argv.index("generic") + 1]
        literals = dict(
            a.removeprefix("--from-literal=").split("=", 1) for a in argv if a.startswith("--from-literal=")
        )
        created.append({"namespace": namespace, "name": name, "data": literals, "argv": argv})
    return created


def test_the_documented_secrets_are_the_ones_the_manifests_use(tmp_path: Path) -> None:
    """manifests/README.md's commands create exactly OPERATOR_SECRETS in `drmas` and in the
    pipeline namespace (the same values in both: one store, one Ray cluster, one MLflow), no
    value empty or a placeholder, fresh random ones each time; and the S3 endpoint they give
    is the one the shipped kfp-launcher opens."""
    first = documented_secret_commands(tmp_path / "1")
    second = documented_secret_commands(tmp_path / "2")
    pipelines = PIPELINE_OVERLAYS["kfp-standalone"]  # the block's default pipeline namespace
    made = {"drmas": {}, "pipelines": {}}
    for secret in first:
        where = "drmas" if secret["namespace"] == PLATFORM_NAMESPACE else "pipelines"
        assert secret["namespace"] in (PLATFORM_NAMESPACE, pipelines), secret["argv"]
        made[where][secret["name"]] = set(secret["data"])
        for entry, value in secret["data"].items():
            assert value and PLACEHOLDER not in value, (secret["name"], entry)
    assert made == {"drmas": OPERATOR_SECRETS[PLATFORM_NAMESPACE], "pipelines": OPERATOR_SECRETS["pipelines"]}
    values = {(s["namespace"], s["name"]): s["data"] for s in first}
    for name in OPERATOR_SECRETS["pipelines"]:
        assert values[(PLATFORM_NAMESPACE, name)] == values[(pipelines, name)], name
    again = {(s["namespace"], s["name"]): s["data"] for s in second}
    for (namespace, name), data in values.items():
        for entry, value in data.items():
            if CREDENTIAL_KEY.search(entry) and not entry.endswith("USERNAME"):
                assert again[(namespace, name)][entry] != value, f"{name}/{entry} is the same on every install"
    # Every secret the manifests and the compiled pipelines name is among them.
    for names in [(p, o, *ADDONS) for p in PLATFORMS for o in PIPELINE_OVERLAYS] + [("jobs",)]:
        assert reference_problems(rendered(*names)) == []
    endpoint = values[(pipelines, S3_SECRET)]["AWS_ENDPOINT_URL"]
    default = yaml.safe_load(one(rendered("kfp-standalone"), "ConfigMap", LAUNCHER_CONFIGMAP)["data"]["providers"])
    default = default["s3"]["default"]
    assert _endpoint(endpoint) == _endpoint(default["endpoint"], default["disableSSL"]), (
        "the launcher and the steps would use different stores"
    )
    service = one(rendered("object-store"), "Service", "seaweedfs")
    assert urlparse(endpoint).hostname == f"seaweedfs.{service['metadata']['namespace']}.svc.cluster.local"


@pytest.mark.parametrize("overlay", sorted(PIPELINE_OVERLAYS))
def test_kfp_launcher_reads_the_drmas_bucket_with_drmas_s3(overlay: str) -> None:
    """The format of backend/src/v2/config/{env,s3}.go: keys defaultPipelineRoot and
    providers (YAML), s3.default with the secret's key names."""
    docs = rendered(overlay)
    config = one(docs, "ConfigMap", LAUNCHER_CONFIGMAP)
    assert config["metadata"]["namespace"] == PIPELINE_OVERLAYS[overlay], "the launcher reads its own namespace"
    root = urlparse(config["data"]["defaultPipelineRoot"])
    assert root.scheme == "s3"
    for gpu in gpu_configs():
        assert urlparse(gpu["store"]["root"]).netloc == root.netloc, "one bucket for runs and KFP"
    providers = yaml.safe_load(config["data"]["providers"])
    assert set(providers) == {"s3"}
    default = providers["s3"]["default"]
    assert default["credentials"] == {
        "fromEnv": False,
        "secretRef": {
            "secretName": "drmas-s3",
            "accessKeyKey": "AWS_ACCESS_KEY_ID",
            "secretKeyKey": "AWS_SECRET_ACCESS_KEY",
        },
    }
    assert "://" not in default["endpoint"] and isinstance(default["disableSSL"], bool)
    assert default["forcePathStyle"] is True, "MinIO and SeaweedFS serve buckets by path"
    assert launcher_problems(docs) == []


def test_an_overlay_of_your_own_points_the_launcher_at_your_store(tmp_path: Path) -> None:
    """The private overlay manifests/README.md describes for a store of your own: the
    platform and an install mode, the launcher's endpoint patched (no secret in it)."""
    providers = yaml.safe_load(one(rendered("kfp-standalone"), "ConfigMap", LAUNCHER_CONFIGMAP)["data"]["providers"])
    providers["s3"]["default"].update(endpoint="minio.minio.svc.cluster.local:9000", disableSSL=True)
    patch = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": LAUNCHER_CONFIGMAP, "namespace": "kubeflow"},
        "data": {"providers": yaml.safe_dump(providers)},
    }
    (tmp_path / "launcher.yaml").write_text(yaml.safe_dump(patch))
    overlay = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [str(MANIFESTS / "base"), str(MANIFESTS / "kfp-standalone")],
        "patches": [{"path": "launcher.yaml"}],
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    docs = render(tmp_path)
    assert problems(docs) == []
    endpoint = yaml.safe_load(one(docs, "ConfigMap", LAUNCHER_CONFIGMAP)["data"]["providers"])["s3"]["default"]
    assert endpoint["endpoint"] == "minio.minio.svc.cluster.local:9000"

    # A short name, or a secret put in the overlay, fails.
    providers["s3"]["default"].update(endpoint="mlflow:5000")
    patch["data"]["providers"] = yaml.safe_dump(providers)
    (tmp_path / "launcher.yaml").write_text(yaml.safe_dump(patch))
    assert any("names a Service of another namespace by its short name" in p for p in problems(render(tmp_path)))
    (tmp_path / "s3.yaml").write_text(
        yaml.safe_dump({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "drmas-s3"}, "stringData": {}})
    )
    overlay["resources"].append("s3.yaml")
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    assert any("applied with the manifests" in p for p in problems(render(tmp_path)))


def test_network_policies_admit_the_pipeline_and_ray_pods_only() -> None:
    docs = rendered("base", "kfp-standalone", "retrieval")
    ray = one(docs, "NetworkPolicy", "drmas-raycluster")["spec"]
    assert ray["podSelector"]["matchLabels"] == RAY_POD_LABEL
    assert ray["ingress"][0] == {"from": [{"podSelector": {"matchLabels": RAY_POD_LABEL}}]}
    assert {p["port"] for p in ray["ingress"][1]["ports"]} == {8265}, "submitters and KubeRay: the dashboard"
    pipelines = one(docs, "NetworkPolicy", "drmas-raycluster-from-kubeflow")["spec"]
    assert pipelines["podSelector"]["matchLabels"] == RAY_HEAD_LABEL
    ((rule),) = pipelines["ingress"]
    assert rule["from"] == [
        {
            "namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kubeflow"}},
            "podSelector": {"matchLabels": PIPELINE_POD_LABEL},
        }
    ]
    assert {p["port"] for p in rule["ports"]} == {10001, 8265, 6379}
    head = one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]
    assert {p["containerPort"] for p in head["spec"]["containers"][0]["ports"]} == {6379, 8265, 10001}
    assert _matches(pipelines["podSelector"], _labels(head))
    mlflow = [
        p["spec"] for p in find(docs, "NetworkPolicy") if p["spec"]["podSelector"]["matchLabels"] == MLFLOW_POD_LABEL
    ]
    assert {port["port"] for spec in mlflow for rule in spec["ingress"] for port in rule["ports"]} == {5000}
    assert {"namespaceSelector": {"matchLabels": {UI_NAMESPACE_LABEL: "true"}}} in mlflow[0]["ingress"][0]["from"]
    # Every pod with a guarded port, and every Ray pod, is behind a policy.
    # The retrieval service: the Ray pods and the install mode's pipeline pods, on 8080 only.
    retrieval = one(docs, "NetworkPolicy", "drmas-retrieval")["spec"]
    assert retrieval["podSelector"]["matchLabels"] == RETRIEVAL_POD_LABEL
    assert retrieval["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": RAY_POD_LABEL}}], "ports": [{"protocol": "TCP", "port": 8080}]}
    ]
    (rule,) = one(docs, "NetworkPolicy", "drmas-retrieval-from-kubeflow")["spec"]["ingress"]
    assert rule["from"] == pipelines["ingress"][0]["from"]
    assert rule["ports"] == [{"protocol": "TCP", "port": 8080}]
    server = one(docs, "Deployment", "drmas-retrieval")["spec"]["template"]
    assert {p["containerPort"] for p in server["spec"]["containers"][0]["ports"]} == {RETRIEVAL_PORT}
    # Every pod with a guarded port, and every Ray pod, is behind a policy.
    guarded = {where for where, _, _ in _guarded_pods(docs)}
    assert guarded == {
        "RayCluster/drmas-raycluster/head",
        "RayCluster/drmas-raycluster/gpu",
        "Deployment/mlflow",
        "Deployment/mlflow-db",
        "Deployment/drmas-retrieval",
    }
    assert network_problems(docs) == []
    # The platform and the service alone admit no pipeline pods: no pipeline namespace.
    assert not any(
        "namespaceSelector" in peer and peer.get("podSelector", {}).get("matchLabels") == PIPELINE_POD_LABEL
        for policy in find(rendered("base", *ADDONS), "NetworkPolicy")
        for rule in policy["spec"]["ingress"]
        for peer in rule["from"]
    )


def test_ray_token_authentication() -> None:
    base = rendered("base")
    cluster = one(base, "RayCluster")
    assert cluster["spec"]["authOptions"] == {"mode": "token", "secretName": "drmas-ray-token"}
    assert tuple(int(x) for x in cluster["spec"]["rayVersion"].split(".")) >= (2, 52, 0), "KubeRay's minimum"
    for _, template in ray_cluster_templates("ray", cluster["spec"]):
        env = {e["name"]: e for e in template["spec"]["containers"][0]["env"]}
        assert env["RAY_AUTH_MODE"] == {"name": "RAY_AUTH_MODE", "value": "token"}
        assert env["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "drmas-ray-token", "key": "auth_token"}
    assert ray_auth_problems(base) == []


def test_each_secret_reaches_only_the_pods_that_use_it() -> None:
    docs = rendered("object-store", "jobs", *ADDONS)
    holders = {
        name: sorted(where for where, template, _ in all_templates(docs) if name in _secret_refs(template))
        for name in SECRET_USERS
    }
    assert holders == {
        "drmas-s3": [
            "Deployment/drmas-retrieval",
            "Deployment/mlflow",
            "Job/drmas-retrieval-index",
            "RayCluster/drmas-raycluster/gpu",
            "RayCluster/drmas-raycluster/head",
            "StatefulSet/seaweedfs",
        ],
        "drmas-mlflow-db": ["Deployment/mlflow", "Deployment/mlflow-db"],
        "drmas-ray-token": ["RayCluster/drmas-raycluster/gpu", "RayCluster/drmas-raycluster/head"],
        # MLflow's clients: RayJob drivers on the head (the workers never log); the server.
        MLFLOW_AUTH_SECRET: ["Deployment/mlflow", "RayCluster/drmas-raycluster/head"],
        "drmas-mlflow-server": ["Deployment/mlflow"],
    }
    assert secret_user_problems(docs) == []
    # The S3 keys reach only the pods that read the store: not PostgreSQL, not the RayJob
    # submitter (KubeRay gives it the Ray token itself).
    readers = {where for where, t, _ in all_templates(docs) if S3_SECRET in _secret_refs(t)}
    assert {where for where, _, _ in all_templates(docs)} - readers == {
        "Deployment/mlflow-db",
        "RayJob/drmas-math-qwen3-4b/submitter",
    }


def test_every_step_of_a_compiled_pipeline_carries_the_label_the_policies_admit(tmp_path: Path) -> None:
    """The pipeline side of the fences, in a compiled pipeline of the GPU recipe: every
    step's pod carries drmas's label (the one each overlay's NetworkPolicies admit, and no
    other), gets the S3 keys (every step reads the store), MLflow's credentials only where it
    logs (the tracking steps), and only secrets the operator creates in the pipeline
    namespace, with the keys it gives them."""
    config = load_config(
        ROOT / "configs" / "math_qwen3_4b_gpu.yaml", ["experiment.epochs=null", "experiment.iterations=2"]
    )
    func, _ = build_pipeline("train", config, "run-1", 0)
    spec, platform = yaml.safe_load_all(compile_pipeline(func, tmp_path / "train.yaml").read_text())
    executors = platform["platforms"]["kubernetes"]["deploymentSpec"]["executors"]
    assert set(executors) == set(spec["deploymentSpec"]["executors"]), "every step is placed"
    admitted = {
        json.dumps(peer["podSelector"]["matchLabels"], sort_keys=True)
        for overlay in PIPELINE_OVERLAYS
        for policy in find(rendered(overlay), "NetworkPolicy")
        for rule in policy["spec"]["ingress"]
        for peer in rule["from"]
    }
    assert admitted == {json.dumps(PIPELINE_POD_LABEL)}
    tracking = set()
    for label, executor in executors.items():
        assert executor["podMetadata"]["labels"] == PIPELINE_POD_LABEL, label
        secrets: dict[str, set[str]] = {}
        for item in executor["secretAsEnv"]:
            secrets.setdefault(item["secretName"], set()).update(k["secretKey"] for k in item["keyToEnv"])
        for name, keys in secrets.items():
            assert keys <= OPERATOR_SECRETS["pipelines"].get(name, set()), (label, name)
        assert set(S3_SECRET_KEYS) <= secrets[S3_SECRET], label
        if MLFLOW_AUTH_SECRET in secrets:
            assert secrets[MLFLOW_AUTH_SECRET] == set(MLFLOW_AUTH_KEYS)
            tracking.add(label)
    assert tracking == {label for label in executors if label.startswith("exec-track")}, "only the tracking steps"


def test_object_store_serves_the_drmas_bucket() -> None:
    store = rendered("object-store")
    (container,) = one(store, "StatefulSet", "seaweedfs")["spec"]["template"]["spec"]["containers"]
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in container["args"] if "=" in a}
    buckets = args["-bucket"].split(",")
    for config in gpu_configs():
        assert urlparse(config["store"]["root"]).netloc in buckets
    providers = yaml.safe_load(one(rendered("kfp-standalone"), "ConfigMap", LAUNCHER_CONFIGMAP)["data"]["providers"])
    endpoint = urlparse("http://" + providers["s3"]["default"]["endpoint"])  # the shipped default: SeaweedFS
    service = one(store, "Service", "seaweedfs")
    assert endpoint.hostname.split(".")[:2] == [
        service["metadata"]["name"],
        service["metadata"]["namespace"],
    ]
    assert endpoint.port == int(args["-s3.port"]) in {p["port"] for p in service["spec"]["ports"]}
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    assert env["AWS_ACCESS_KEY_ID"] == {"name": "drmas-s3", "key": "AWS_ACCESS_KEY_ID"}
    assert not find(store, "Secret"), "SeaweedFS enforces the operator's keys, never shipped ones"
    policy = one(store, "NetworkPolicy", "seaweedfs-s3-only")
    assert [p["port"] for rule in policy["spec"]["ingress"] for p in rule["ports"]] == [endpoint.port]


def test_rayjob_runs_drmas_on_the_shared_cluster() -> None:
    job = one(rendered("jobs"), "RayJob")
    cluster = one(rendered("base"), "RayCluster")
    assert job["spec"]["clusterSelector"] == {"ray.io/cluster": cluster["metadata"]["name"]}
    assert "rayClusterSpec" not in job["spec"] and not job["spec"].get("shutdownAfterJobFinishes")
    words = job["spec"]["entrypoint"].split()
    assert words[:2] == ["drmas", "run"]
    config = Path(words[2])
    assert config.parent == Path("/opt/drmas/configs"), "the image's WORKDIR holds configs/"
    assert (ROOT / "configs" / config.name).is_file()
    assert "ray.address=auto" in words[3:]


def test_retrieval_service_is_the_one_the_search_configs_name() -> None:
    """The Service is task.retrieval_url of the GPU search configs; the service and its
    index Job read the configs' data.corpus and cache the index under their store.root."""
    docs = rendered("base", *ADDONS)
    assert retrieval_problems(docs) == []
    deployment = one(docs, "Deployment", "drmas-retrieval")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    assert container["command"] == RETRIEVAL_COMMAND
    args = server_args(container)
    assert args["--host"] == "0.0.0.0" and args["--port"] == str(RETRIEVAL_PORT)
    (job,) = one(docs, "Job", "drmas-retrieval-index")["spec"]["template"]["spec"]["containers"]
    assert server_args(job) == {"--corpus": args["--corpus"], "--store": args["--store"], "--build-only": True}
    service = one(docs, "Service", "drmas-retrieval")
    assert service["spec"]["ports"] == [{"name": "http", "port": RETRIEVAL_PORT, "targetPort": "http"}]
    # Sized for wiki-18 (not measured): a request in tens of GiB, /tmp on an emptyDir.
    memory = container["resources"]["requests"]["memory"]
    assert memory.endswith("Gi") and int(memory[:-2]) >= 32
    configs = [c for c in gpu_configs() if (c.get("task") or {}).get("retrieval_url")]
    assert configs, "a GPU search config uses the service"
    for config in configs:
        url = urlparse(config["task"]["retrieval_url"])
        assert url.scheme == "http"
        assert url.hostname == f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc.cluster.local"
        assert url.port == RETRIEVAL_PORT
        assert config["data"]["corpus"] == args["--corpus"], "the service serves the corpus the run names"
        assert config["store"]["root"] == args["--store"], "the index is cached where the run's store is"
        assert f"task.retrieval_url: {config['task']['retrieval_url']}" in (MANIFESTS / "README.md").read_text()


# ----------------------------------------------------------------------------- negatives


def _container(docs: list[dict], kind: str, name: str) -> dict:
    return one(docs, kind, name)["spec"]["template"]["spec"]["containers"][0]


def _worker(docs: list[dict]) -> dict:
    return one(docs, "RayCluster")["spec"]["workerGroupSpecs"][0]


def _misspell_worker_groups(docs: list[dict]) -> None:
    spec = one(docs, "RayCluster")["spec"]
    spec["workerGroupSpec"] = spec.pop("workerGroupSpecs")


def _misspell_in_worker_pod(docs: list[dict]) -> None:
    container = _worker(docs)["template"]["spec"]["containers"][0]
    container["resource"] = container.pop("resources")


def _replicas_as_text(docs: list[dict]) -> None:
    _worker(docs)["maxReplicas"] = "eight"


def _misspell_in_deployment(docs: list[dict]) -> None:
    spec = one(docs, "Deployment", "mlflow")["spec"]
    spec["replica"] = spec.pop("replicas")


def _drop_resources(docs: list[dict]) -> None:
    del _container(docs, "Deployment", "mlflow")["resources"]["limits"]


def _run_as_root(docs: list[dict]) -> None:
    template = one(docs, "Deployment", "mlflow-db")["spec"]["template"]["spec"]
    template["securityContext"]["runAsUser"] = 0
    del template["securityContext"]["runAsNonRoot"]
    del template["containers"][0]["securityContext"]["runAsNonRoot"]


def _keep_capabilities(docs: list[dict]) -> None:
    _worker(docs)["template"]["spec"]["containers"][0]["securityContext"]["capabilities"] = {"drop": []}


def _latest_image(docs: list[dict]) -> None:
    _container(docs, "Deployment", "mlflow-db")["image"] = "postgres:latest"


def _secret_applied(docs: list[dict]) -> None:
    docs.append(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "drmas-s3", "namespace": "drmas"},
            "type": "Opaque",
            "stringData": {"AWS_SECRET_ACCESS_KEY": "wJalrXUtnFEMI/K7MDENG"},
        }
    )


def _placeholder_in_the_launcher(docs: list[dict]) -> None:
    _edit_providers(docs, lambda default: default.update(endpoint=f"{PLACEHOLDER}.example.com"))


def _placeholder_env(docs: list[dict]) -> None:
    _container(docs, "Deployment", "mlflow")["env"].append({"name": "AWS_DEFAULT_REGION", "value": PLACEHOLDER})


def _pipeline_pods_by_kfp_label(docs: list[dict]) -> None:
    for policy in find(docs, "NetworkPolicy"):
        for rule in policy["spec"]["ingress"]:
            for peer in rule.get("from", []):
                if (peer.get("podSelector") or {}).get("matchLabels") == PIPELINE_POD_LABEL:
                    peer["podSelector"]["matchLabels"] = {KFP_POD_LABEL: "true"}


def _drmas_and_kfp_label(docs: list[dict]) -> None:
    peer = one(docs, "NetworkPolicy", "mlflow-from-kubeflow")["spec"]["ingress"][0]["from"][0]
    peer["podSelector"]["matchLabels"] = {**PIPELINE_POD_LABEL, KFP_POD_LABEL: "true"}


def _mlflow_without_auth(docs: list[dict]) -> None:
    container = _container(docs, "Deployment", "mlflow")
    container["args"] = [a for a in container["args"] if not a.startswith("--app-name")]


def _mlflow_admin_password_in_a_configmap(docs: list[dict]) -> None:
    data = one(docs, "ConfigMap", "mlflow-auth")["data"]
    data["basic_auth.ini"] += "admin_password = hunter2hunter2\n"


def _mlflow_users_in_sqlite(docs: list[dict]) -> None:
    data = one(docs, "ConfigMap", "mlflow-auth")["data"]
    data["basic_auth.ini"] = re.sub(
        r"database_uri = .*", "database_uri = sqlite:///basic_auth.db", data["basic_auth.ini"]
    )


def _mlflow_auth_config_unmounted(docs: list[dict]) -> None:
    del _container(docs, "Deployment", "mlflow")["volumeMounts"]


def _mlflow_admin_password_inline(docs: list[dict]) -> None:
    env = _container(docs, "Deployment", "mlflow")["env"]
    entry = next(e for e in env if e["name"] == "MLFLOW_AUTH_ADMIN_PASSWORD")
    entry.pop("valueFrom")
    entry["value"] = "hunter2hunter2"


def _secret_unchecked(docs: list[dict]) -> None:
    check = one(docs, "Deployment", "mlflow")["spec"]["template"]["spec"]["initContainers"][0]
    check["args"] = [a for a in check["args"] if not a.startswith("PGPASSWORD=")]


def _secret_check_misnamed(docs: list[dict]) -> None:
    check = one(docs, "Deployment", "mlflow-db")["spec"]["template"]["spec"]["initContainers"][0]
    check["args"] = ["POSTGRES_PASSWORD=drmas-s3/POSTGRES_PASSWORD"]


def _secret_check_removed(docs: list[dict]) -> None:
    del one(docs, "Job", "drmas-retrieval-index")["spec"]["template"]["spec"]["initContainers"]


def _secret_check_another_script(docs: list[dict]) -> None:
    _worker(docs)["template"]["spec"]["initContainers"][0]["command"] = ["sh", "-c", "exit 0", SECRET_CHECK]


def _mlflow_credentials_in_the_workers(docs: list[dict]) -> None:
    _worker(docs)["template"]["spec"]["containers"][0]["envFrom"].append({"secretRef": {"name": MLFLOW_AUTH_SECRET}})


def _mount_a_missing_configmap(docs: list[dict]) -> None:
    docs.remove(one(docs, "ConfigMap", "mlflow-auth"))


def _list_secrets(docs: list[dict]) -> None:
    rule = one(docs, "Role")["rules"][0]
    rule["verbs"] = ["get", "list"]
    del rule["resourceNames"]


def _create_pods(docs: list[dict]) -> None:
    one(docs, "Role")["rules"].append({"apiGroups": [""], "resources": ["pods"], "verbs": ["create"]})


def _missing_secret_key(docs: list[dict]) -> None:
    env = _container(docs, "Deployment", "mlflow")["env"][0]
    env["valueFrom"]["secretKeyRef"]["key"] = "PASSWORD"


def _mlflow_file_store(docs: list[dict]) -> None:
    container = _container(docs, "Deployment", "mlflow")
    container["args"] = [a for a in container["args"] if not a.startswith("--backend-store-uri")]
    container["args"].append("--backend-store-uri=./mlruns")


def _mount_an_unused_token(docs: list[dict]) -> None:
    del one(docs, "Deployment", "mlflow")["spec"]["template"]["spec"]["automountServiceAccountToken"]


def _autoscaler_unbounded(docs: list[dict]) -> None:
    del one(docs, "RayCluster")["spec"]["autoscalerOptions"]["resources"]


def _launcher(docs: list[dict]) -> dict:
    return one(docs, "ConfigMap", LAUNCHER_CONFIGMAP)["data"]


def _edit_providers(docs: list[dict], edit: Callable[[dict], None]) -> None:
    providers = yaml.safe_load(_launcher(docs)["providers"])
    edit(providers["s3"]["default"])
    _launcher(docs)["providers"] = yaml.safe_dump(providers)


def _launcher_on_minio(docs: list[dict]) -> None:
    _launcher(docs)["defaultPipelineRoot"] = "minio://mlpipeline/v2/artifacts"


def _launcher_without_s3(docs: list[dict]) -> None:
    del _launcher(docs)["providers"]


def _launcher_field_misspelled(docs: list[dict]) -> None:
    def edit(default: dict) -> None:
        ref = default["credentials"]["secretRef"]
        ref["secretKey"] = ref.pop("secretKeyKey")

    _edit_providers(docs, edit)


def _launcher_from_env(docs: list[dict]) -> None:
    _edit_providers(docs, lambda default: default["credentials"].update(fromEnv=True))


def _launcher_missing_key(docs: list[dict]) -> None:
    _edit_providers(docs, lambda default: default["credentials"]["secretRef"].update(accessKeyKey="accesskey"))


def _launcher_endpoint_as_url(docs: list[dict]) -> None:
    _edit_providers(docs, lambda default: default.update(endpoint="http://seaweedfs.drmas.svc.cluster.local:8333"))


def _launcher_secret_unreadable(docs: list[dict]) -> None:
    _edit_providers(docs, lambda default: default["credentials"]["secretRef"].update(secretName="drmas-ray-token"))


def _delete_task_results(docs: list[dict]) -> None:
    one(docs, "Role")["rules"][2]["verbs"].append("delete")


def _patch_workflows(docs: list[dict]) -> None:
    one(docs, "Role")["rules"].append({"apiGroups": ["argoproj.io"], "resources": ["workflows"], "verbs": ["patch"]})


def _task_results_and_pods(docs: list[dict]) -> None:
    one(docs, "Role")["rules"][2]["resources"].append("pods")


def _bind_an_unknown_account(docs: list[dict]) -> None:
    one(docs, "RoleBinding")["subjects"][0]["name"] = "pipeline-runner"


def _bind_across_namespaces(docs: list[dict]) -> None:
    one(docs, "RoleBinding")["subjects"][0]["namespace"] = "drmas"


def _ray_workers_unguarded(docs: list[dict]) -> None:
    docs.remove(one(docs, "NetworkPolicy", "drmas-raycluster"))


def _ray_open_rule(docs: list[dict]) -> None:
    del one(docs, "NetworkPolicy", "drmas-raycluster-from-kubeflow")["spec"]["ingress"][0]["from"]


def _pipeline_pods_on_every_port(docs: list[dict]) -> None:
    del one(docs, "NetworkPolicy", "drmas-raycluster-from-kubeflow")["spec"]["ingress"][0]["ports"]


def _mlflow_to_a_whole_namespace(docs: list[dict]) -> None:
    peer = one(docs, "NetworkPolicy", "mlflow-from-kubeflow")["spec"]["ingress"][0]["from"][0]
    del peer["podSelector"]


def _pipeline_namespace_renamed(docs: list[dict]) -> None:
    for doc in docs:
        if doc["kind"] != "NetworkPolicy" and doc["metadata"].get("namespace") == "kubeflow":
            doc["metadata"]["namespace"] = "team-a"
    one(docs, "RoleBinding")["subjects"][0]["namespace"] = "team-a"


def _s3_to_the_database(docs: list[dict]) -> None:
    _container(docs, "Deployment", "mlflow-db")["envFrom"] = [{"secretRef": {"name": "drmas-s3"}}]


def _ray_without_auth(docs: list[dict]) -> None:
    del one(docs, "RayCluster")["spec"]["authOptions"]


def _ray_worker_without_token(docs: list[dict]) -> None:
    container = _worker(docs)["template"]["spec"]["containers"][0]
    container["env"] = [e for e in container["env"] if e["name"] != "RAY_AUTH_TOKEN"]


def _ray_auth_disabled(docs: list[dict]) -> None:
    env = one(docs, "RayCluster")["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    next(e for e in env if e["name"] == "RAY_AUTH_MODE")["value"] = "disabled"


def _short_service_name(docs: list[dict]) -> None:
    _edit_providers(docs, lambda default: default.update(endpoint="mlflow:5000", disableSSL=True))


def _partly_qualified(docs: list[dict]) -> None:
    _edit_providers(docs, lambda default: default.update(endpoint="seaweedfs.drmas.svc:8333"))


def _retrieval(docs: list[dict]) -> dict:
    return _container(docs, "Deployment", "drmas-retrieval")


def _set_arg(container: dict, flag: str, value: str) -> None:
    container["args"] = [a for a in container["args"] if a.split("=", 1)[0] != flag] + [f"{flag}={value}"]


def _retrieval_on_localhost(docs: list[dict]) -> None:
    _set_arg(_retrieval(docs), "--host", "127.0.0.1")


def _retrieval_startup_too_short(docs: list[dict]) -> None:
    _retrieval(docs)["startupProbe"].update(periodSeconds=10, failureThreshold=30)


def _retrieval_liveness_elsewhere(docs: list[dict]) -> None:
    _retrieval(docs)["livenessProbe"]["httpGet"]["path"] = "/"


def _retrieval_writable_root(docs: list[dict]) -> None:
    del _retrieval(docs)["securityContext"]["readOnlyRootFilesystem"]


def _retrieval_without_tmp(docs: list[dict]) -> None:
    del _retrieval(docs)["volumeMounts"]


def _retrieval_unserved_port(docs: list[dict]) -> None:
    _set_arg(_retrieval(docs), "--port", "8081")


def _index_of_another_corpus(docs: list[dict]) -> None:
    _set_arg(_container(docs, "Job", "drmas-retrieval-index"), "--corpus", "s3://drmas/data/other.jsonl")


def _retrieval_unguarded(docs: list[dict]) -> None:
    for name in ("drmas-retrieval", "drmas-retrieval-from-kubeflow"):
        docs.remove(one(docs, "NetworkPolicy", name))


def _retrieval_closed_to_ray(docs: list[dict]) -> None:
    one(docs, "NetworkPolicy", "drmas-retrieval")["spec"]["ingress"][0]["ports"][0]["port"] = 8081


def _retrieval_closed_to_pipelines(docs: list[dict]) -> None:
    docs.remove(one(docs, "NetworkPolicy", "drmas-retrieval-from-kubeflow"))


def _ray_token_to_retrieval(docs: list[dict]) -> None:
    _retrieval(docs)["envFrom"] = [{"secretRef": {"name": "drmas-ray-token"}}]


def _no_ephemeral_storage_request(docs: list[dict]) -> None:
    docs.remove(one(docs, "LimitRange", "drmas-pipeline-ephemeral-storage"))


def _ephemeral_storage_limit(docs: list[dict]) -> None:
    one(docs, "LimitRange", "drmas-pipeline-ephemeral-storage")["spec"]["limits"][0]["default"] = {
        "ephemeral-storage": "2Gi"
    }


BREAKAGES: dict[str, tuple[Callable[[list[dict]], None], str]] = {
    "pipeline pods ask for no ephemeral storage": (
        _no_ephemeral_storage_request,
        "pipeline namespace kubeflow: no default ephemeral-storage request",
    ),
    "pipeline pods limited in ephemeral storage": (_ephemeral_storage_limit, "would evict updates"),
    "RayCluster field misspelled": (_misspell_worker_groups, "'workerGroupSpec' was unexpected"),
    "field misspelled inside a Ray pod template": (
        _misspell_in_worker_pod,
        "'resource' was unexpected",
    ),
    "RayCluster replicas not an integer": (_replicas_as_text, "maxReplicas"),
    "Deployment field misspelled": (_misspell_in_deployment, "'replica' was unexpected"),
    "container without limits": (_drop_resources, "no resources.limits"),
    "pod running as root": (_run_as_root, "runAsNonRoot is not true"),
    "capabilities kept": (_keep_capabilities, "do not drop ALL"),
    "latest image": (_latest_image, "not pinned"),
    "a Secret applied with the manifests": (_secret_applied, "Secret/drmas-s3 (drmas): applied with the manifests"),
    "placeholder in the launcher settings": (_placeholder_in_the_launcher, "kfp-launcher: holds the placeholder"),
    "placeholder in a pod's environment": (_placeholder_env, "Deployment/mlflow: holds the placeholder"),
    "pipeline pods admitted by KFP's label": (_pipeline_pods_by_kfp_label, "admits every KFP v2 pod"),
    "KFP's label beside drmas's": (
        _drmas_and_kfp_label,
        "NetworkPolicy/mlflow-from-kubeflow ingress 0: admits every KFP",
    ),
    "MLflow without authentication": (_mlflow_without_auth, "Deployment/mlflow: no authentication"),
    "MLflow admin password in a ConfigMap": (_mlflow_admin_password_in_a_configmap, "admin_password in basic-auth's"),
    "MLflow users in a SQLite file": (_mlflow_users_in_sqlite, "database_uri is not a database"),
    "MLflow auth settings not mounted": (_mlflow_auth_config_unmounted, "is no file of a mounted ConfigMap"),
    "MLflow admin password inline": (_mlflow_admin_password_inline, "MLFLOW_AUTH_ADMIN_PASSWORD does not come from"),
    "a secret the pod gets but does not check": (
        _secret_unchecked,
        "Deployment/mlflow: gets drmas-mlflow-db/POSTGRES_PASSWORD but check-secrets does not refuse",
    ),
    "a check of another secret's key": (_secret_check_misnamed, "check-secrets checks POSTGRES_PASSWORD as drmas-s3"),
    "a pod that gets secrets without the check": (
        _secret_check_removed,
        "Job/drmas-retrieval-index: gets secrets",
    ),
    "a check that checks nothing": (_secret_check_another_script, "different commands"),
    "MLflow credentials in the Ray workers": (
        _mlflow_credentials_in_the_workers,
        "gpu: gets secret drmas-mlflow-auth but does not use it",
    ),
    "a volume of a missing ConfigMap": (_mount_a_missing_configmap, "mounts missing ConfigMap mlflow-auth"),
    "list on secrets": (_list_secrets, "secrets without resourceNames"),
    "create on pods": (_create_pods, "not allowed"),
    "env from a missing secret key": (_missing_secret_key, "refers to missing"),
    "autoscaler sidecar without resources": (_autoscaler_unbounded, "autoscaler: no resources"),
    "API token mounted where no API is used": (_mount_an_unused_token, "mounts a ServiceAccount token it never uses"),
    "MLflow on a file store": (_mlflow_file_store, "not a database"),
    "launcher falls back to minio://mlpipeline": (_launcher_on_minio, "is not s3://"),
    "launcher without an s3 provider": (_launcher_without_s3, "no providers.s3.default"),
    "launcher field misspelled": (_launcher_field_misspelled, "unknown field 'secretKey'"),
    "launcher credentials from its environment": (_launcher_from_env, "fromEnv is not false"),
    "launcher names a missing secret key": (_launcher_missing_key, "'accesskey' is missing"),
    "launcher endpoint with a scheme": (_launcher_endpoint_as_url, "has a scheme"),
    "launcher secret the Role does not grant": (_launcher_secret_unreadable, "lets the launcher get"),
    "launcher secret without the S3 keys": (
        _launcher_secret_unreadable,
        "'AWS_ACCESS_KEY_ID' is missing in secret drmas-ray-token",
    ),
    "delete on workflowtaskresults": (_delete_task_results, "['delete'] not allowed"),
    "patch on workflows": (_patch_workflows, "['patch'] not allowed"),
    "executor grant stretched to pods": (_task_results_and_pods, "not allowed"),
    "binding to an account that is not there": (_bind_an_unknown_account, "is not a ServiceAccount here"),
    "binding to another namespace's account": (_bind_across_namespaces, "subject namespace drmas"),
    "Ray workers behind no policy": (_ray_workers_unguarded, "gpu: open to every pod"),
    "Ray rule without sources": (_ray_open_rule, "admits every source"),
    "pipeline pods on every Ray port": (_pipeline_pods_on_every_port, "on every port"),
    "MLflow open to a whole namespace": (_mlflow_to_a_whole_namespace, "(no podSelector)"),
    "pipeline namespace the policies do not admit": (
        _pipeline_namespace_renamed,
        "pipeline pods in team-a cannot reach",
    ),
    "S3 secret in a pod that does not use it": (_s3_to_the_database, "mlflow-db: gets secret drmas-s3"),
    "Ray without token authentication": (_ray_without_auth, "no token authentication"),
    "Ray worker without the token": (_ray_worker_without_token, "gpu: RAY_AUTH_TOKEN does not come from"),
    "Ray authentication disabled": (_ray_auth_disabled, "RAY_AUTH_MODE is not token"),
    "Service of another namespace by its short name": (_short_service_name, "mlflow names a Service of another"),
    "Service name not fully qualified": (_partly_qualified, "not fully qualified"),
    "retrieval service bound to localhost": (_retrieval_on_localhost, "--host 127.0.0.1 binds"),
    "retrieval startup probe shorter than a load": (_retrieval_startup_too_short, "startupProbe allows 300 s"),
    "retrieval liveness probe off /health": (_retrieval_liveness_elsewhere, "livenessProbe is not GET /health"),
    "retrieval with a writable root": (_retrieval_writable_root, "retrieval: readOnlyRootFilesystem is not true"),
    "retrieval without a /tmp volume": (_retrieval_without_tmp, "/tmp is not an emptyDir"),
    "retrieval on a port nothing sends to": (_retrieval_unserved_port, "--port 8081 is not one of"),
    "index Job of another corpus": (_index_of_another_corpus, "the service would build its own index"),
    "retrieval behind no policy": (_retrieval_unguarded, "drmas-retrieval: open to every pod"),
    "retrieval closed to the Ray pods": (
        _retrieval_closed_to_ray,
        "Ray pods (RayCluster/drmas-raycluster/gpu) cannot reach port 8080",
    ),
    "retrieval closed to the pipeline pods": (
        _retrieval_closed_to_pipelines,
        "pipeline pods in kubeflow cannot reach port 8080",
    ),
    "Ray token in the retrieval service": (_ray_token_to_retrieval, "drmas-retrieval: gets secret drmas-ray-token"),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_a_broken_manifest_fails(breakage: str) -> None:
    break_it, expected = BREAKAGES[breakage]
    docs = rendered("base", "kfp-standalone", *ADDONS)
    break_it(docs)
    found = problems(docs)
    assert any(expected in problem for problem in found), found


@pytest.mark.parametrize(
    ("breakage", "expected"),
    [
        ("entrypoint", "'entryPoint' was unexpected"),
        ("both", "is not valid under any of the given schemas"),
        ("submitter", "'imagePullPolicyy' was unexpected"),
    ],
)
def test_a_broken_rayjob_fails(breakage: str, expected: str) -> None:
    docs = rendered("jobs")
    spec = one(docs, "RayJob")["spec"]
    if breakage == "entrypoint":
        spec["entryPoint"] = spec.pop("entrypoint")
    elif breakage == "both":
        spec["rayClusterSpec"] = one(rendered("base"), "RayCluster")["spec"]
    else:
        spec["submitterPodTemplate"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    found = problems(docs)
    assert any(expected in problem for problem in found), found


def test_schemas_alone_miss_what_the_rules_catch() -> None:
    """kubernetes-validate accepts a container without resources; the rules do not."""
    docs = rendered("base")
    _drop_resources(docs)
    assert schema_problems(docs) == []
    assert pod_problems(docs)
