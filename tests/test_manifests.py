"""The Kubernetes manifests against the project's rules (``tools/checks/manifests.py``: a
tiny kustomize, the schemas and the rules; ``python -m tools.checks.manifests`` runs them),
and what the rules alone do not say: what each kustomization renders to, that the configs
and the compiled pipelines name what the manifests deploy, that the documented secret
commands create the secrets the pods read. Deliberately broken copies show that every rule
can fail.
"""

from __future__ import annotations

import configparser
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

import pytest
import yaml

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from drmas.config import RayConfig, load_config
from drmas_kfp.pipelines.build import build_pipeline, compile_pipeline
from drmas_kfp.pipelines.platform import MLFLOW_AUTH_KEYS, MLFLOW_AUTH_SECRET, S3_SECRET, S3_SECRET_KEYS
from tools.checks.manifests import (
    ADDONS,
    CREDENTIAL_KEY,
    KFP_POD_LABEL,
    KUSTOMIZATIONS,
    LAUNCHER_CONFIGMAP,
    MANIFESTS,
    MLFLOW_AUTH_APP,
    MLFLOW_AUTH_ENV,
    MLFLOW_POD_LABEL,
    OPERATOR_SECRETS,
    PIPELINE_OVERLAYS,
    PIPELINE_POD_LABEL,
    PIPELINE_ROLE,
    PLACEHOLDER,
    PLATFORM_NAMESPACE,
    PLATFORMS,
    RAY_HEAD_LABEL,
    RAY_POD_LABEL,
    RETRIEVAL_COMMAND,
    RETRIEVAL_POD_LABEL,
    RETRIEVAL_PORT,
    ROOT,
    SECRET_CHECK,
    SECRET_USERS,
    UI_NAMESPACE_LABEL,
    all_templates,
    applied_sets,
    consumed_secrets,
    containers_anywhere,
    find,
    guarded_pods,
    key,
    launcher_problems,
    main,
    mlflow_problems,
    network_problems,
    one,
    pod_labels,
    pod_problems,
    problems,
    ray_auth_problems,
    ray_cluster_templates,
    reference_problems,
    render,
    rendered,
    retrieval_problems,
    s3_endpoint,
    schema_problems,
    secret_check_problems,
    secret_problems,
    secret_refs,
    secret_user_problems,
    selects,
    server_args,
    split_image,
    without_secret_checks,
)

GPU_CONFIGS = sorted((ROOT / "configs").glob("*_gpu.yaml"))


def gpu_configs() -> list[dict]:
    return [yaml.safe_load(path.read_text()) for path in GPU_CONFIGS]


# ----------------------------------------------------------------------------- tests


@pytest.mark.parametrize("names", applied_sets(), ids="+".join)
def test_every_set_applied_together_keeps_every_rule(names: tuple[str, ...]) -> None:
    """Each kustomization (an add-on on top of base, whose secrets it names), and what
    `kubectl apply -k <platform>`, `kubectl apply -k <overlay>` (and the retrieval service's
    kustomizations) send together."""
    docs = rendered(*names)
    assert docs and problems(docs) == []


def test_the_check_command_names_each_problem_of_the_folders_it_is_given(tmp_path: Path, capsys) -> None:
    """`python -m tools.checks.manifests FOLDER...` (a pre-commit hook without folders):
    0 on a kustomization that keeps the rules; 1 and the problem on one that does not, and
    on one that render() cannot read."""
    assert main([str(MANIFESTS / "jobs")]) == 0
    overlay = {
        "apiVersion": "kustomize.config.k8s.io/v1beta1",
        "kind": "Kustomization",
        "resources": [str(MANIFESTS / "jobs")],
        "images": [{"name": "ghcr.io/drmas/drmas-cpu", "newTag": "latest"}],
    }
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump(overlay))
    capsys.readouterr()
    assert main([str(tmp_path)]) == 1
    assert "image 'ghcr.io/drmas/drmas-cpu:latest' is not pinned to a version tag" in capsys.readouterr().err
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({**overlay, "replacements": []}))
    assert main([str(tmp_path)]) == 1
    assert "render() does not implement ['replacements']" in capsys.readouterr().err


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


def test_the_manifests_mlflow_server_authenticates_with_the_packages_the_image_installs(tmp_path: Path) -> None:
    """The image installs the project (images/Dockerfile.cpu: ``pip install ".[kubeflow]"``),
    whose mlflow requirement carries the ``auth`` extra (Flask-WTF: without it ``mlflow
    server --app-name basic-auth`` exits with an ImportError). Run as the manifest runs it,
    its settings from the ConfigMap (the database a file here, not PostgreSQL) and the admin
    account from the environment: /health stays open for the probes, a request without the
    account or with a wrong password gets 401, and a client with the account drmas's
    clients use (MLFLOW_TRACKING_USERNAME/PASSWORD) logs and reads a run."""
    import base64
    import secrets
    import urllib.error
    import urllib.request

    import mlflow
    import tomllib
    from localmlflow import MlflowServer

    requirements = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert any(re.fullmatch(r"mlflow\[auth\]==[\d.]+", r.split("#")[0].strip()) for r in requirements)
    assert (
        'pip install -c constraints.txt -c /tmp/image-constraints.txt ".[kubeflow]"'
        in (ROOT / "images" / "Dockerfile.cpu").read_text()
    )

    base = rendered("base")
    (container,) = one(base, "Deployment", "mlflow")["spec"]["template"]["spec"]["containers"]
    settings = configparser.ConfigParser()
    settings.read_string(one(base, "ConfigMap", "mlflow-auth")["data"]["basic_auth.ini"])
    settings["mlflow"]["database_uri"] = f"sqlite:///{tmp_path / 'auth.db'}"
    with (tmp_path / "basic_auth.ini").open("w") as file:
        settings.write(file)
    user, password = "drmas-runs", secrets.token_hex(12)
    server = MlflowServer(
        tmp_path / "server",
        args=(f"--app-name={server_args(container)['--app-name']}",),
        env={
            "MLFLOW_AUTH_CONFIG_PATH": str(tmp_path / "basic_auth.ini"),
            "MLFLOW_AUTH_ADMIN_USERNAME": user,
            "MLFLOW_AUTH_ADMIN_PASSWORD": password,
            "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16),
        },
    ).start()  # start() waits for /health, which answers without an account
    try:

        def status(account: tuple[str, str] | None) -> int:
            request = urllib.request.Request(f"{server.uri}/api/2.0/mlflow/experiments/search?max_results=1")
            if account:
                token = base64.b64encode(":".join(account).encode()).decode()
                request.add_header("Authorization", f"Basic {token}")
            try:
                with urllib.request.urlopen(request, timeout=10) as reply:
                    return reply.status
            except urllib.error.HTTPError as refused:
                return refused.code

        assert status(None) == 401
        assert status((user, "not-" + password)) == 401
        assert status((user, password)) == 200
        with pytest.MonkeyPatch.context() as env:
            env.setenv("MLFLOW_TRACKING_USERNAME", user)
            env.setenv("MLFLOW_TRACKING_PASSWORD", password)
            client = mlflow.MlflowClient(server.uri)
            run = client.create_run(client.create_experiment("auth-check"))
            client.log_metric(run.info.run_id, "eval/avg", 0.5)
            assert client.get_run(run.info.run_id).data.metrics == {"eval/avg": 0.5}
    finally:
        server.kill()


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
        where for where, t, doc in all_templates(docs) if consumed_secrets(t, key(doc)[2], docs)
    }
    assert len(checks) == 7 and secret_check_problems(docs) == []
    for where, check in checks:
        given = consumed_secrets({"spec": {"initContainers": [check]}}, PLATFORM_NAMESPACE, docs, init=True)
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
    assert PLACEHOLDER not in json.dumps([without_secret_checks(doc) for doc in docs])
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
    assert s3_endpoint(endpoint) == s3_endpoint(default["endpoint"], default["disableSSL"]), (
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
    assert selects(pipelines["podSelector"], pod_labels(head))
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
    guarded = {where for where, _, _ in guarded_pods(docs)}
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
        name: sorted(where for where, template, _ in all_templates(docs) if name in secret_refs(template))
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
    readers = {where for where, t, _ in all_templates(docs) if S3_SECRET in secret_refs(t)}
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
    indexed = {flag: value for flag, value in args.items() if flag not in ("--host", "--port")}
    assert server_args(job) == {**indexed, "--build-only": True}
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
        task = config["task"]
        assert args.get("--method", "bm25") == task.get("retrieval_method", "bm25"), "it retrieves as the run does"
        if args.get("--method") == "dense":
            assert args["--encoder"] == task["retrieval_encoder"], "with the run's encoder"
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


def _worker_resources(docs: list[dict]) -> dict:
    return _worker(docs)["template"]["spec"]["containers"][0]["resources"]


def _worker_pod_of_96gi(docs: list[dict]) -> None:
    _worker_resources(docs)["limits"]["memory"] = "96Gi"


def _worker_pod_without_disk(docs: list[dict]) -> None:
    del _worker_resources(docs)["requests"]["ephemeral-storage"]


def _worker_pod_with_small_shm(docs: list[dict]) -> None:
    (dshm,) = [v for v in _worker(docs)["template"]["spec"]["volumes"] if v["name"] == "dshm"]
    dshm["emptyDir"]["sizeLimit"] = "8Gi"


def _worker_pod_of_4_gpus_with_less_than_host_memory_gb(docs: list[dict]) -> None:
    """4 GPUs and 790Gi: what the search plan needs on 4 GPUs (788Gi), but less than 4 x the
    recipes' ray.host_memory_gb of 214 GB (797Gi)."""
    resources = _worker_resources(docs)
    for side in ("requests", "limits"):
        resources[side]["nvidia.com/gpu"] = "4"
        resources[side]["memory"] = "790Gi"


BREAKAGES: dict[str, tuple[Callable[[list[dict]], None], str]] = {
    "GPU worker pod with less memory than the plan": (
        _worker_pod_of_96gi,
        "gpu/ray-worker: memory limit 96Gi is less than search_qwen25_7b_gpu.yaml needs on a pod of 8 GPU(s)",
    ),
    "GPU worker pod without ephemeral storage": (
        _worker_pod_without_disk,
        "gpu/ray-worker: ephemeral-storage request not set is less than math_qwen3_4b_gpu.yaml needs",
    ),
    "GPU worker pod with a small /dev/shm": (_worker_pod_with_small_shm, "/dev/shm sizeLimit 8Gi is less than"),
    "GPU worker pod with less than ray.host_memory_gb per GPU": (
        _worker_pod_of_4_gpus_with_less_than_host_memory_gb,
        "says each slot has ray.host_memory_gb 214, more than the pod's memory limit 790Gi over its 4 GPU(s)",
    ),
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
