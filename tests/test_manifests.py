"""The Kubernetes manifests, rendered and validated offline (no kubectl, no cluster).

`render` is a tiny kustomize (resources, patches, images, namespace; any other kustomization
field fails the test rather than being ignored). Core kinds are validated with
kubernetes-validate's strict schemas of the newest Kubernetes it ships; KubeRay's
RayCluster/RayJob with the hand-written schemas in manifests/schemas, whose pod templates
refer to the same core definitions. On top of the schemas, `problems` holds the rules of
the project: resources, non-root, no privilege escalation, dropped capabilities, pinned
images, least RBAC, no API token in a pod that does not use the API, placeholder-only
secrets, references that resolve. Deliberately broken copies show that every rule can fail.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Callable, Iterator
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

from drmas.config import RayConfig

ROOT = Path(__file__).resolve().parents[1]
MANIFESTS = ROOT / "manifests"
KUSTOMIZATIONS = ("base", "object-store", "jobs")
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
PLACEHOLDER = "REPLACE_ME"
CREDENTIAL_KEY = re.compile(r"KEY|SECRET|PASSWORD|TOKEN", re.IGNORECASE)
DRMAS_UID = 1000  # USER 1000:1000 in images/Dockerfile.*
GPU_CONFIGS = sorted((ROOT / "configs").glob("*_gpu.yaml"))


# ----------------------------------------------------------------------------- rendering


def render(directory: Path) -> list[dict]:
    """The documents `kubectl apply -k directory` would send, as far as these manifests go.

    resources: files (multi-document YAML) and directories, recursively; patches: a file
    naming its target by kind and name, merged like a strategic merge patch on maps (lists
    and scalars replace, so patches must not hold lists); images: every containers and
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
        targets = [doc for doc in docs if key(doc)[:2] == key(body)[:2]]
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


def rendered(name: str) -> list[dict]:
    """A fresh copy of a kustomization's documents (tests may mutate it)."""
    return [json.loads(doc) for doc in _rendered(name)]


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
                if not verbs <= ALLOWED_VERBS:
                    problems.append(f"{at}: verbs {sorted(verbs - ALLOWED_VERBS)} not allowed")
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
                if subject.get("kind") != "ServiceAccount" or not accounts:
                    problems.append(f"RoleBinding/{name}: subject {subject} is not a ServiceAccount here")
                elif subject.get("namespace") != accounts[0]["metadata"].get("namespace"):
                    problems.append(f"RoleBinding/{name}: subject namespace {subject.get('namespace')}")
    return problems


def secret_problems(docs: list[dict], *, templates_only: bool) -> list[str]:
    problems = []
    for secret in find(docs, "Secret"):
        name = secret["metadata"]["name"]
        if secret.get("data"):
            problems.append(f"Secret/{name}: base64 data; templates keep readable stringData")
        for entry, value in (secret.get("stringData") or {}).items():
            if CREDENTIAL_KEY.search(entry) and value != PLACEHOLDER:
                problems.append(f"Secret/{name}: {entry} holds a value, not {PLACEHOLDER}")
            elif templates_only and PLACEHOLDER not in str(value):
                problems.append(f"Secret/{name}: {entry} is not a {PLACEHOLDER} placeholder")
    return problems


def reference_problems(docs: list[dict]) -> list[str]:
    """Every secret, key, claim and Service selector names something that is rendered."""
    problems = []
    secrets = {s["metadata"]["name"]: set(s.get("stringData") or {}) for s in find(docs, "Secret")}
    claims = {c["metadata"]["name"] for c in find(docs, "PersistentVolumeClaim")}
    for where, template, _ in all_templates(docs):
        spec = template.get("spec") or {}
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
    return problems


def duplicate_problems(docs: list[dict]) -> list[str]:
    keys = [key(doc) for doc in docs]
    return [f"{k}: defined twice" for k in sorted(set(keys), key=str) if keys.count(k) > 1]


def problems(docs: list[dict], *, templates_only: bool = True) -> list[str]:
    return (
        duplicate_problems(docs)
        + schema_problems(docs)
        + pod_problems(docs)
        + rbac_problems(docs)
        + secret_problems(docs, templates_only=templates_only)
        + reference_problems(docs)
        + mlflow_problems(docs)
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
    assert problems(docs, templates_only=name == "base") == []


def test_rendering_applies_namespace_images_and_patches() -> None:
    base, store, jobs = (rendered(name) for name in KUSTOMIZATIONS)
    assert sorted(doc["kind"] for doc in base) == sorted(
        ["Namespace", "ServiceAccount", "Role", "RoleBinding", "Secret", "Secret", "RayCluster"]
        + ["PersistentVolumeClaim"] * 2
        + ["Deployment", "Service"] * 2
    )
    assert {d["kind"] for d in store} - {d["kind"] for d in base} == {
        "StatefulSet",
        "NetworkPolicy",
    }
    assert [d["kind"] for d in jobs] == ["RayJob"]
    for doc in base + store + jobs:
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "drmas", key(doc)
    assert one(base, "Namespace")["metadata"]["name"] == "drmas"
    # Every object is one the validators know: core kinds (kubernetes-validate) or ray.io/v1.
    assert {d["apiVersion"] for d in base + store + jobs} <= {
        "v1",
        "apps/v1",
        "rbac.authorization.k8s.io/v1",
        "networking.k8s.io/v1",
        "ray.io/v1",
    }
    base_s3 = one(base, "Secret", "drmas-s3")["stringData"]
    store_s3 = one(store, "Secret", "drmas-s3")["stringData"]
    assert PLACEHOLDER in base_s3["AWS_ENDPOINT_URL"]
    assert store_s3["AWS_ENDPOINT_URL"] == "http://seaweedfs.drmas.svc.cluster.local:8333"
    assert store_s3["AWS_ACCESS_KEY_ID"] == base_s3["AWS_ACCESS_KEY_ID"] == PLACEHOLDER


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
    assert ray_images == [f"{new}:0.1.0-1a2b3c4d5e6f"] * 2
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
        assert address.hostname == f"{cluster['metadata']['name']}-head-svc"
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

    service = one(base, "Service", "mlflow")
    allowed = str(args["--allowed-hosts"]).split(",")
    for config in gpu_configs():
        tracking = urlparse(config["tracking"]["uri"])
        name, namespace = tracking.hostname.split(".")[:2]
        assert (name, namespace) == (service["metadata"]["name"], service["metadata"]["namespace"])
        assert tracking.port in {p["port"] for p in service["spec"]["ports"]}
        assert tracking.netloc in allowed, "MLflow would answer 403 to the runs' Host header"
        assert urlparse(config["store"]["root"]).netloc == artifacts.netloc, "one bucket"


def test_rbac_grants_only_named_gets() -> None:
    base = rendered("base")
    role = one(base, "Role")
    assert role["rules"], "the pipeline steps' Role"
    for rule in role["rules"]:
        assert rule["verbs"] == ["get"] and rule["resourceNames"], rule
    secret_rule = next(r for r in role["rules"] if "secrets" in r["resources"])
    assert secret_rule["resourceNames"] == ["drmas-s3"]
    binding = one(base, "RoleBinding")
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "drmas-pipeline", "namespace": "drmas"}]


def test_secret_templates_hold_only_placeholders() -> None:
    base = rendered("base")
    assert {s["metadata"]["name"] for s in find(base, "Secret")} == {"drmas-s3", "drmas-mlflow-db"}
    s3 = one(base, "Secret", "drmas-s3")["stringData"]
    assert set(s3) == {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"}
    assert secret_problems(base, templates_only=True) == []


def test_object_store_serves_the_drmas_bucket() -> None:
    store = rendered("object-store")
    (container,) = one(store, "StatefulSet", "seaweedfs")["spec"]["template"]["spec"]["containers"]
    args = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in container["args"] if "=" in a}
    buckets = args["-bucket"].split(",")
    for config in gpu_configs():
        assert urlparse(config["store"]["root"]).netloc in buckets
    endpoint = urlparse(one(store, "Secret", "drmas-s3")["stringData"]["AWS_ENDPOINT_URL"])
    service = one(store, "Service", "seaweedfs")
    assert endpoint.hostname.split(".")[:2] == [
        service["metadata"]["name"],
        service["metadata"]["namespace"],
    ]
    assert endpoint.port == int(args["-s3.port"]) in {p["port"] for p in service["spec"]["ports"]}
    env = {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container["env"]}
    assert env["AWS_ACCESS_KEY_ID"] == {"name": "drmas-s3", "key": "AWS_ACCESS_KEY_ID"}
    policy = one(store, "NetworkPolicy")
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


def _real_looking_secret(docs: list[dict]) -> None:
    one(docs, "Secret", "drmas-s3")["stringData"]["AWS_SECRET_ACCESS_KEY"] = "wJalrXUtnFEMI/K7MDENG"


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


BREAKAGES: dict[str, tuple[Callable[[list[dict]], None], str]] = {
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
    "real credential in the template": (_real_looking_secret, "holds a value"),
    "list on secrets": (_list_secrets, "secrets without resourceNames"),
    "create on pods": (_create_pods, "not allowed"),
    "env from a missing secret key": (_missing_secret_key, "refers to missing"),
    "autoscaler sidecar without resources": (_autoscaler_unbounded, "autoscaler: no resources"),
    "API token mounted where no API is used": (_mount_an_unused_token, "mounts a ServiceAccount token it never uses"),
    "MLflow on a file store": (_mlflow_file_store, "not a database"),
}


@pytest.mark.parametrize("breakage", sorted(BREAKAGES))
def test_a_broken_manifest_fails(breakage: str) -> None:
    break_it, expected = BREAKAGES[breakage]
    docs = rendered("base")
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
