"""The Kubernetes manifests, rendered and checked offline (no kubectl, no cluster).

`render` is a tiny kustomize (resources, patches, images, namespace; any other kustomization
field is an error rather than being ignored). Core kinds are validated with
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
reach, probed on /health, with a read-only root and the index its Job cached.

Install modes are overlays that hold only the pipeline side (kfp-standalone,
kubeflow-profile); `rendered("base", "kfp-standalone")` is what applying both sends. The
search task's retrieval service (retrieval, and its index Job in retrieval-index) holds
only its own objects too, applied on top of a platform (ADDONS). `applied_sets` lists every
set that is applied together.

`python -m tools.checks.manifests` (from the repository's root, in the project's venv:
the rules read drmas_kfp's names of secrets and labels) checks them all and prints each
problem; it is a pre-commit hook, and tests/test_manifests.py holds every rule to a
deliberately broken copy.
"""

from __future__ import annotations

import configparser
import copy
import json
import re
import sys
from collections.abc import Iterator
from fnmatch import fnmatch
from functools import cache
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import jsonschema
import kubernetes_validate
import yaml
from kubernetes_validate.utils import latest_version
from referencing import Registry, Resource

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

if TYPE_CHECKING:
    from drmas.planning import MemoryPlan

from drmas_kfp.pipelines.platform import (
    MLFLOW_AUTH_KEYS,
    MLFLOW_AUTH_SECRET,
    POD_LABEL,
    RAY_TOKEN_KEY,
    RAY_TOKEN_SECRET,
    S3_SECRET,
)

ROOT = Path(__file__).resolve().parents[2]
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
# The retrieval service (drmas.tasks.search.service): `drmas serve-retrieval`, GET
# /health. Loading a wiki-scale index from the store, or building it when the index Job's
# cache is missing, takes minutes to hours (not measured): the startup probe must give it
# at least this long before the liveness probe may restart the pod.
RETRIEVAL_COMMAND = ["drmas", "serve-retrieval"]
RETRIEVAL_HEALTH = "/health"
RETRIEVAL_STARTUP_S = 3600
# Arguments that only the server takes; every other one names what is indexed and where
# its cache lives, and must be the same in the index Job.
RETRIEVAL_SERVER_ARGS = {"--host", "--port", "--build-only"}


class ManifestError(ValueError):
    """The manifests use something `render` does not implement, or a lookup found not one
    document: what kubectl would do with them is not known here."""


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ManifestError(message)


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
    _require(
        kustomization.get("apiVersion") == "kustomize.config.k8s.io/v1beta1"
        and kustomization.get("kind") == "Kustomization",
        f"{directory}: not a kustomize.config.k8s.io/v1beta1 Kustomization",
    )
    unknown = set(kustomization) - KUSTOMIZATION_FIELDS
    _require(not unknown, f"{directory}: render() does not implement {sorted(unknown)}")

    docs: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            docs += render(path)
        else:
            docs += [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    for patch in kustomization.get("patches", []):
        _require(set(patch) == {"path"}, f"{directory}: only file patches are implemented")
        body = yaml.safe_load((directory / patch["path"]).read_text())
        targets = [doc for doc in docs if key(doc)[:2] == key(body)[:2] and key(body)[2] in (None, key(doc)[2])]
        _require(len(targets) == 1, f"patch {patch['path']} matches {len(targets)} documents")
        merge(targets[0], body)
    for rule in kustomization.get("images", []):
        _require(set(rule) <= {"name", "newName", "newTag"}, f"{directory}: image rule {rule}")
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
            _require(not isinstance(value, list), f"{name}: list patches are not implemented")
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
    _require(len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}")
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
        text = json.dumps(without_secret_checks(doc))
        if PLACEHOLDER in text:
            problems.append(
                "{}/{}: holds the placeholder {} (it would be applied as it is)".format(*key(doc)[:2], PLACEHOLDER)
            )
    return problems


def without_secret_checks(doc: dict) -> dict:
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


def consumed_secrets(
    template: dict, namespace: str | None, docs: list[dict], *, init: bool = False
) -> dict[str, tuple]:
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
        wanted = set(consumed_secrets(template, namespace, docs).values())
        inits = (template.get("spec") or {}).get("initContainers", [])
        if not wanted:
            continue
        if not inits or inits[0].get("name") != SECRET_CHECK:
            problems.append(f"{where}: gets secrets {sorted(wanted)} but its first init container is no {SECRET_CHECK}")
            continue
        check = inits[0]
        commands.add(json.dumps(check.get("command")))
        given = consumed_secrets(template, namespace, docs, init=True)
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


def pod_labels(template: dict) -> dict:
    return (template.get("metadata") or {}).get("labels") or {}


def selects(selector: dict | None, labels: dict) -> bool:
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


def s3_endpoint(url_or_host: str, disable_ssl: bool | None = None) -> tuple[str, str]:
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


def guarded_pods(docs: list[dict]) -> list[tuple[str, dict, str | None]]:
    """(where, labels, namespace) of every pod that must sit behind a NetworkPolicy."""
    guarded = []
    for where, template, doc in all_templates(docs):
        ports = {p.get("containerPort") for c in pod_containers(template) for p in c.get("ports", [])}
        if doc["kind"] == "RayCluster" or ports & GUARDED_PORTS:
            guarded.append((where, pod_labels(template), key(doc)[2]))
    return guarded


def _ingress_policies(docs: list[dict], labels: dict, namespace: str | None) -> list[dict]:
    return [
        policy
        for policy in find(docs, "NetworkPolicy")
        if key(policy)[2] == namespace
        and "Ingress" in policy["spec"].get("policyTypes", ["Ingress"])
        and selects(policy["spec"].get("podSelector"), labels)
    ]


def _admits(peer: dict, labels: dict, namespace: str, policy_namespace: str | None) -> bool:
    """Whether a `from` peer admits a pod with these labels in this namespace."""
    if "namespaceSelector" in peer:
        if not selects(peer["namespaceSelector"], {"kubernetes.io/metadata.name": namespace}):
            return False
    elif namespace != policy_namespace:
        return False
    return selects(peer.get("podSelector"), labels)


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
    for where, labels, namespace in guarded_pods(docs):
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
        for where, labels, namespace in guarded_pods(docs):
            if not selects({"matchLabels": target}, labels):
                continue
            for pipelines in sorted(pipeline_namespaces, key=str):
                if not _reaches(docs, labels, namespace, port, PIPELINE_POD_LABEL, pipelines):
                    problems.append(f"{where}: pipeline pods in {pipelines} cannot reach port {port}")
    ray_pods = [
        (where, labels, namespace)
        for where, labels, namespace in guarded_pods(docs)
        if selects({"matchLabels": RAY_POD_LABEL}, labels)
    ]
    for target, port in RAY_TARGETS:
        for where, labels, namespace in guarded_pods(docs):
            if not selects({"matchLabels": target}, labels):
                continue
            # Without a RayCluster rendered (an add-on alone), the platform's Ray pods.
            clients = [(w, pod) for w, pod, n in ray_pods if n == namespace] or [("Ray pods", RAY_POD_LABEL)]
            for client, client_labels in clients:
                if not _reaches(docs, labels, namespace, port, client_labels, namespace):
                    problems.append(f"{where}: Ray pods ({client}) cannot reach port {port}")
    return problems


def secret_refs(template: dict) -> set[str]:
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
        for name in sorted(secret_refs(template)):
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
            labels = pod_labels(template)
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


GPU_RECIPES = tuple(sorted((ROOT / "configs").glob("*_gpu.yaml")))
"""The recipes the GPU pool is for: its worker pods must hold each one's memory plan."""
QUANTITY = re.compile(r"(\d+(?:\.\d+)?)([KMGTP]i?)?")


def quantity_bytes(text: object) -> int | None:
    """A Kubernetes memory or storage quantity ('1600Gi', '512Mi', '2G', '1000') in bytes;
    None for anything else."""
    match = QUANTITY.fullmatch(str(text))
    if match is None:
        return None
    unit = match[2] or ""
    power = "KMGTP".index(unit[0]) + 1 if unit else 0
    return round(float(match[1]) * (1024 if unit.endswith("i") else 1000) ** power)


@cache
def recipe_plans() -> tuple[tuple[str, MemoryPlan], ...]:
    """(recipe, its memory plan) for every GPU recipe."""
    from drmas.config import load_config  # noqa: PLC0415 - seconds to import: only when a cluster is checked
    from drmas.planning import plan_memory  # noqa: PLC0415

    return tuple((path.name, plan_memory(load_config(path))) for path in GPU_RECIPES)


def pod_sizing_problems(docs: list[dict]) -> list[str]:
    """Each RayCluster GPU worker pod is sized from the recipes' memory plans
    (``drmas plan --gpus-per-node N``, ``MemoryPlan.pod``): memory (request and limit),
    its memory-backed /dev/shm and its ephemeral storage hold what every recipe needs on a
    pod of that many GPUs, and a recipe's ``ray.host_memory_gb`` is at most the pod's
    memory per GPU (the plan refuses configs against that figure)."""
    found = []
    for doc in find(docs, "RayCluster"):
        for group in doc.get("spec", {}).get("workerGroupSpecs", []):
            where = f"RayCluster/{doc['metadata']['name']}/{group.get('groupName')}"
            template = group.get("template", {})
            for container in template.get("spec", {}).get("containers", []):
                gpus = int((container.get("resources", {}).get("limits") or {}).get("nvidia.com/gpu", 0))
                if gpus:
                    found += _pod_size_problems(f"{where}/{container.get('name')}", template, container, gpus)
    return found


def _pod_size_problems(where: str, template: dict, container: dict, gpus: int) -> list[str]:
    resources = container.get("resources", {})
    shm = next(
        (
            volume.get("emptyDir", {}).get("sizeLimit")
            for volume in template.get("spec", {}).get("volumes", [])
            for mount in container.get("volumeMounts", [])
            if mount.get("mountPath") == "/dev/shm" and mount.get("name") == volume.get("name")
        ),
        None,
    )
    given = {
        "memory request": resources.get("requests", {}).get("memory"),
        "memory limit": resources.get("limits", {}).get("memory"),
        "/dev/shm sizeLimit": shm,
        "ephemeral-storage request": resources.get("requests", {}).get("ephemeral-storage"),
    }
    found = []
    for recipe, plan in recipe_plans():
        pod = plan.pod(gpus)
        needs = {
            "memory request": pod.memory,
            "memory limit": pod.memory,
            "/dev/shm sizeLimit": pod.shm,
            "ephemeral-storage request": pod.disk,
        }
        for item, need in needs.items():
            have = quantity_bytes(given[item])
            if have is None or have < need:
                found.append(
                    f"{where}: {item} {given[item] or 'not set'} is less than {recipe} needs on a pod of {gpus} GPU(s) "
                    f"({pod.resources()}; drmas plan configs/{recipe} --gpus-per-node {gpus})"
                )
        host = plan.host_memory
        limit = quantity_bytes(given["memory limit"])
        if host is not None and limit is not None and host * gpus > limit:
            found.append(
                f"{where}: {recipe} says each slot has ray.host_memory_gb {host / 10**9:g}, more than the "
                f"pod's memory limit {given['memory limit']} over its {gpus} GPU(s)"
            )
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
        + pod_sizing_problems(docs)
    )


def server_args(container: dict) -> dict[str, str | bool]:
    """--flag=value arguments of a container as a dict (a bare --flag maps to True)."""
    parsed: dict[str, str | bool] = {}
    for arg in container.get("args", []):
        name, sep, value = arg.partition("=")
        parsed[name] = value if sep else True
    return parsed


def applied_sets() -> list[tuple[str, ...]]:
    """Every set of kustomizations that is applied together: each alone (an add-on on top
    of base, whose secrets it names), and each platform with each install mode, with and
    without the add-ons."""
    alone = [("base", name) if name in ADDONS else (name,) for name in KUSTOMIZATIONS]
    together = [
        (platform, overlay, *addons)
        for platform in PLATFORMS
        for overlay in sorted(PIPELINE_OVERLAYS)
        for addons in ((), ADDONS)
    ]
    return alone + together


def main(argv: list[str] | None = None) -> int:
    """Check every applied set (or the kustomization folders named, each alone); print each
    problem. 0 when there is none."""
    folders = [Path(arg) for arg in (sys.argv[1:] if argv is None else argv)]
    found = []
    try:
        sets = [render(folder) for folder in folders] or [rendered(*names) for names in applied_sets()]
    except ManifestError as error:
        print(f"manifests: {error}", file=sys.stderr)
        return 1
    for docs in sets:
        found += [problem for problem in problems(docs) if problem not in found]
    for problem in found:
        print(problem, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
