"""deploy/: the kustomize base and every overlay render with the real tool (``kubectl kustomize``), every rendered
manifest validates against the Kubernetes schemas (kubernetes-validate, strict: no unknown field), KEDA's kinds
against tests/keda-v1alpha1.schema.json, and the rendered objects keep the promises the deployment rests on: one
GPU per worker, warm-shutdown grace over the longest job, probes on the heartbeat, secrets only from Secrets,
settings the service knows, KEDA on each pool's backlog as the API's ``/backlog`` reports it.

Where kubectl (with kustomize v5) is missing these tests skip and say so; ``make test`` installs it when it can.
"""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlparse

import jsonschema
import kubernetes_validate
import pytest
import yaml

from auk_worker.deploy import load_deploy_config
from auk_worker.service.connect import settings as settings_module
from api.responses import BacklogView, QueueBacklog
from auk_worker.service.queues.backlog import PRIORITIES as BACKLOG_PRIORITIES
from auk_worker.service.worker.board import tasks_at_once
from auk_worker.service.worker.stopping import RELEASE_S
from auk_worker.service.connect.settings import Settings

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "overlays").iterdir() if (p / "kustomization.yaml").exists())
TARGETS = ["base", *(f"overlays/{name}" for name in OVERLAYS)]
KEDA_SCHEMA = json.loads((Path(__file__).parent / "keda-v1alpha1.schema.json").read_text())
KEDA_KINDS = {"ScaledObject", "TriggerAuthentication"}
# The oldest Kubernetes whose kubectl carries kustomize v5, and the newest the validator knows.
K8S_VERSIONS = ("1.27", kubernetes_validate.latest_version())

SECRET_SETTINGS = ("AUK_API_KEYS", "AUK_S3_ACCESS_KEY", "AUK_S3_SECRET_KEY")
# AUK_* variables that the processes of these pods read outside the settings object, and the file that reads each:
# none (connect/settings.py reads every one; tests/test_settings_doc.py keeps docs/settings.md in step).
READ_OUTSIDE_SETTINGS: dict[str, str] = {}
APP_DIR = PurePosixPath("/app")  # the image's WORKDIR: /app/config/*.yaml is the repository's config/


# ------------------------------------------------------------------------------------------------ rendering


def kubectl() -> str:
    binary = shutil.which("kubectl")
    if binary is None:
        pytest.skip("kubectl is not installed (`make test` tries `apt-get install kubectl`); deploy/ not rendered")
    out = subprocess.run([binary, "version", "--client", "-o", "json"], capture_output=True, text=True, timeout=60)
    version = json.loads(out.stdout or "{}").get("kustomizeVersion", "")
    if not re.match(r"v?([5-9]|\d{2,})\.", version):
        pytest.skip(f"kubectl at {binary} carries kustomize {version or 'unknown'}; deploy/ needs kustomize v5 "
                    "(kubectl 1.27 or newer; Debian 12's kubernetes-client 1.20 is too old)")  # fmt: skip
    return binary


def planted_secrets(example: Path) -> dict[str, str]:
    """Distinctive values for every key of a secrets.env.example, to find wherever they end up."""
    keys = [line.split("=", 1)[0] for line in example.read_text().splitlines() if "=" in line and line[0] != "#"]
    return {key: f"planted-{key.lower().replace('_', '-')}-7f3a9c" for key in keys}


@pytest.fixture(scope="module")
def deploy_copy(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, str]]:
    """deploy/ copied, with each secrets.env written from its example with planted values (never the real file)."""
    root = tmp_path_factory.mktemp("k8s") / "deploy"
    shutil.copytree(DEPLOY, root, ignore=shutil.ignore_patterns("secrets.env"))
    planted: dict[str, str] = {}
    for example in root.glob("overlays/*/secrets.env.example"):
        values = planted_secrets(example)
        planted.update(values)
        example.with_name("secrets.env").write_text("".join(f"{k}={v}\n" for k, v in values.items()))
    return root, planted


def render(root: Path, target: str) -> list[dict[str, Any]]:
    proc = subprocess.run([kubectl(), "kustomize", str(root / target)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"kubectl kustomize {target}:\n{proc.stderr}"
    return [doc for doc in yaml.safe_load_all(proc.stdout) if doc]


@pytest.fixture(scope="module")
def rendered(deploy_copy) -> dict[str, list[dict[str, Any]]]:
    root, _ = deploy_copy
    return {target: render(root, target) for target in TARGETS}


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [doc for doc in docs if doc["kind"] == kind]


def named(docs: list[dict], kind: str, name: str) -> dict:
    (doc,) = [d for d in of_kind(docs, kind) if d["metadata"]["name"] == name]
    return doc


def component(deployment: dict) -> str:
    return deployment["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]


def containers(docs: list[dict], role: str) -> Iterator[tuple[dict, dict]]:
    for deployment in of_kind(docs, "Deployment"):
        if component(deployment) == role:
            for container in deployment["spec"]["template"]["spec"]["containers"]:
                yield deployment, container


def env_of(container: dict) -> dict[str, dict]:
    return {entry["name"]: entry for entry in container.get("env", [])}


def effective_env(docs: list[dict], container: dict) -> dict[str, str]:
    """What the kubelet would give the container: envFrom ConfigMaps, then env entries. Secrets rendered here are
    decoded; a Secret made outside the render gives a stand-in, or nothing for an optional key."""
    configmaps = {d["metadata"]["name"]: d.get("data", {}) for d in of_kind(docs, "ConfigMap")}
    secrets = {d["metadata"]["name"]: d.get("data", {}) for d in of_kind(docs, "Secret")}
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        env.update(configmaps[source["configMapRef"]["name"]])
    for name, entry in env_of(container).items():
        if "value" in entry:
            env[name] = entry["value"]
        elif "secretKeyRef" in entry["valueFrom"]:
            ref = entry["valueFrom"]["secretKeyRef"]
            if ref["name"] in secrets and ref["key"] in secrets[ref["name"]]:
                env[name] = base64.b64decode(secrets[ref["name"]][ref["key"]]).decode()
            elif not ref.get("optional"):
                env[name] = f"from-secret-{ref['key'].lower()}"
        elif "fieldRef" in entry["valueFrom"]:
            env[name] = "auk-worker-pod-0"
    return env


def settings_names() -> set[str]:
    """Every AUK_* name the settings object reads: recorded while it reads an empty environment, and named in its
    source (a name read only on some path still appears there)."""

    class Recorder(dict):
        seen: set[str] = set()

        def get(self, key, default=None):
            self.seen.add(key)
            return default

        def __getitem__(self, key):
            self.seen.add(key)
            raise KeyError(key)

        def __contains__(self, key):
            self.seen.add(key)
            return False

    Settings.from_env(Recorder())
    named_in_source = set(re.findall(r"\"(AUK_[A-Z0-9_]+)\"", Path(settings_module.__file__).read_text()))
    return Recorder.seen | named_in_source


def test_a_storage_outage_is_ridden_out_within_the_visibility_timeout(rendered) -> None:
    for target, docs in rendered.items():
        for _, container in containers(docs, "worker"):
            settings = Settings.from_env(effective_env(docs, container))
            assert settings.storage_retry_deadline_s < settings.visibility_timeout, target


def longest_job_s(docs: list[dict]) -> int:
    """AUK_VISIBILITY_TIMEOUT of the workers: this deployment's bound on the longest job."""
    values = {Settings.from_env(effective_env(docs, c)).visibility_timeout for _, c in containers(docs, "worker")}
    assert len(values) == 1, f"workers disagree on AUK_VISIBILITY_TIMEOUT: {values}"
    return values.pop()


def repo_config(path: str) -> Path:
    """The repository file behind an image path /app/config/NAME.yaml."""
    relative = PurePosixPath(path).relative_to(APP_DIR)
    return REPO / relative


# ------------------------------------------------------------------------------------------------ the tool


@pytest.mark.parametrize("target", TARGETS)
def test_renders_with_kubectl_kustomize(rendered, target: str) -> None:
    kinds = {doc["kind"] for doc in rendered[target]}
    assert {"Deployment", "Service", "ConfigMap", "ServiceAccount", "PodDisruptionBudget"} <= kinds


def test_overlay_with_a_secret_generator_refuses_to_render_without_its_file(tmp_path: Path) -> None:
    binary = kubectl()
    root = tmp_path / "deploy"
    shutil.copytree(DEPLOY, root, ignore=shutil.ignore_patterns("secrets.env"))
    for example in root.glob("overlays/*/secrets.env.example"):
        proc = subprocess.run([binary, "kustomize", str(example.parent)], capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and "secrets.env" in proc.stderr, example.parent.name


# ------------------------------------------------------------------------------------------------ schemas


@pytest.mark.parametrize("target", TARGETS)
@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_manifest_validates(rendered, target: str, version: str) -> None:
    for doc in rendered[target]:
        where = f"{target}: {doc['kind']}/{doc['metadata']['name']}"
        if doc["kind"] in KEDA_KINDS:
            try:
                jsonschema.validate(doc, KEDA_SCHEMA)
            except jsonschema.ValidationError as exc:
                pytest.fail(f"{where} (KEDA schema): {exc.message} at {list(exc.absolute_path)}")
            behavior = doc["spec"].get("advanced", {}).get("horizontalPodAutoscalerConfig", {}).get("behavior")
            if behavior:  # KEDA hands it to the HPA it makes: the HPA's own schema decides
                hpa = {"apiVersion": "autoscaling/v2", "kind": "HorizontalPodAutoscaler", "metadata": {"name": "h"},
                       "spec": {"scaleTargetRef": {"kind": "Deployment", "name": "d"}, "maxReplicas": 1,
                                "behavior": behavior}}  # fmt: skip
                kubernetes_validate.validate(hpa, version, strict=True)
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as exc:
            pytest.fail(f"{where} (Kubernetes {version}): {exc.message} at {list(exc.absolute_path)}")


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_plain_manifests_validate(version: str) -> None:
    for path in sorted((DEPLOY / "jobs").glob("*.yaml")):
        for doc in yaml.safe_load_all(path.read_text()):
            kubernetes_validate.validate(doc, version, strict=True)


def test_keda_schema_refuses_what_keda_would() -> None:
    good = {"apiVersion": "keda.sh/v1alpha1", "kind": "ScaledObject", "metadata": {"name": "s"},
            "spec": {"scaleTargetRef": {"name": "d"}, "triggers": [{"type": "redis", "metadata": {
                "address": "r:6379", "listName": "q", "listLength": "5"}}]}}  # fmt: skip
    jsonschema.validate(good, KEDA_SCHEMA)
    trigger = good["spec"]["triggers"][0]
    for bad_metadata in ({**trigger["metadata"], "listLength": 5},  # metadata is a map of strings
                         {**trigger["metadata"], "listname": "q"},  # a misspelt key
                         {"address": "r:6379", "listLength": "5"},  # no list
                         {"listName": "q", "listLength": "5"}):  # no server  # fmt: skip
        bad = {**good, "spec": {**good["spec"], "triggers": [{**trigger, "metadata": bad_metadata}]}}
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, KEDA_SCHEMA)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**good, "spec": {**good["spec"], "cooldown": 300}}, KEDA_SCHEMA)
    api = {"type": "metrics-api", "metadata": {"url": "http://a.ns.svc.cluster.local/backlog",
                                               "valueLocation": "base.bulk.demand", "targetValue": "60"}}  # fmt: skip
    jsonschema.validate({**good, "spec": {**good["spec"], "triggers": [api]}}, KEDA_SCHEMA)
    for bad_metadata in ({**api["metadata"], "targetValue": 60},  # a number, not a string
                         {**api["metadata"], "valuelocation": "x"},  # a misspelt key
                         {"url": api["metadata"]["url"], "targetValue": "60"},  # nowhere to read the value
                         {**api["metadata"], "url": "auk-api/backlog"}):  # not a URL  # fmt: skip
        bad = {**good, "spec": {**good["spec"], "triggers": [{**api, "metadata": bad_metadata}]}}
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, KEDA_SCHEMA)


# ------------------------------------------------------------------------------------------------ workers


@pytest.mark.parametrize("target", TARGETS)
def test_each_worker_takes_exactly_one_gpu_and_the_api_none(rendered, target: str) -> None:
    docs = rendered[target]
    pools = {d["metadata"]["name"] for d in of_kind(docs, "Deployment") if component(d) == "worker"}
    assert pools == {"auk-worker-interactive", "auk-worker-flash", "auk-worker-bulk"}
    for deployment, container in containers(docs, "worker"):
        resources = container["resources"]
        assert str(resources["limits"]["nvidia.com/gpu"]) == "1", deployment["metadata"]["name"]
        assert str(resources.get("requests", {}).get("nvidia.com/gpu", "1")) == "1"
        # A surge pod would wait for a GPU that only the pod it replaces frees.
        assert deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0
    for _, container in containers(docs, "api"):
        assert "nvidia.com/gpu" not in str(container.get("resources"))


@pytest.mark.parametrize("target", TARGETS)
def test_pools_run_their_variant_config_and_checkpoint(rendered, target: str) -> None:
    docs = rendered[target]
    expected = {"auk-worker-interactive": ("base", "auk.yaml"), "auk-worker-flash": ("flash", "auk-flash.yaml"),
                "auk-worker-bulk": ("base", "auk-bulk.yaml")}  # fmt: skip
    for deployment, container in containers(docs, "worker"):
        env = effective_env(docs, container)
        variant, config = expected[deployment["metadata"]["name"]]
        assert env["AUK_VARIANT"] == variant and PurePosixPath(env["AUK_DEPLOY_CONFIG"]).name == config
        load_deploy_config(repo_config(env["AUK_DEPLOY_CONFIG"]))  # the file exists in the image and parses
        settings = Settings.from_env(env)
        settings.require_worker()
        mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
        assert any(PurePosixPath(env["AUK_CHECKPOINT"]).is_relative_to(m) for m in mounts), env["AUK_CHECKPOINT"]
        assert any(PurePosixPath(env["HF_HOME"]).is_relative_to(m) for m in mounts), "HF_HOME is not on a volume"


@pytest.mark.parametrize("target", TARGETS)
def test_compile_caches_live_on_a_claimed_volume(rendered, target: str) -> None:
    docs = rendered[target]
    claims = {d["metadata"]["name"] for d in of_kind(docs, "PersistentVolumeClaim")}
    for deployment, container in containers(docs, "worker"):
        env = effective_env(docs, container)
        cache = PurePosixPath(env["AUK_CACHE_DIR"])
        for name in ("TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR"):
            assert PurePosixPath(env[name]).is_relative_to(cache), name
        (mount,) = [m for m in container["volumeMounts"] if cache.is_relative_to(m["mountPath"])]
        assert not mount.get("readOnly")
        volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
        assert volumes[mount["name"]]["persistentVolumeClaim"]["claimName"] in claims


@pytest.mark.parametrize("target", TARGETS)
def test_termination_grace_covers_the_stop_grace_and_the_release(rendered, target: str) -> None:
    """Kubernetes' SIGKILL comes only after the worker's own stop: its grace for the running job (AUK_STOP_GRACE),
    the release of a job past it (stopping.RELEASE_S) and the exit; the stop grace lets the longest job finish."""
    docs = rendered[target]
    longest = longest_job_s(docs)
    for deployment, container in containers(docs, "worker"):
        name = deployment["metadata"]["name"]
        grace = deployment["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        stop_grace = Settings.from_env(effective_env(docs, container)).stop_grace_s
        assert grace >= stop_grace + RELEASE_S + 30, f"{name}: grace {grace} s, stop grace {stop_grace} s"
        assert stop_grace >= longest, f"{name}: a job of {longest} s is released at {stop_grace} s"
        assert container["command"][:2] == ["auk", "worker"]  # SIGTERM reaches the worker itself


@pytest.mark.parametrize("target", TARGETS)
def test_worker_probes_read_this_pods_heartbeat(rendered, target: str) -> None:
    probe = ["python", "-m", "auk_worker.service.ops.probe"]
    for deployment, container in containers(rendered[target], "worker"):
        worker_id = env_of(container)["AUK_WORKER_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
        assert worker_id == "metadata.name"
        assert "--hostname" not in container.get("args", []) and "--worker-id" not in container.get("args", [])
        assert container["readinessProbe"]["exec"]["command"] == probe
        assert container["startupProbe"]["exec"]["command"] == probe
        assert container["livenessProbe"]["exec"]["command"] == [*probe, "--live"]
        for kind in ("readinessProbe", "startupProbe", "livenessProbe"):
            assert container[kind]["timeoutSeconds"] > 3  # the probe's own Redis timeout is 3 s
        # A long job never fails liveness (the heartbeat thread writes while busy); the start-up probe gives a cold
        # start (weights, graph capture, compile) minutes, not seconds.
        startup = container["startupProbe"]
        assert startup["periodSeconds"] * startup["failureThreshold"] >= 600


# ------------------------------------------------------------------------------------------------ API


@pytest.mark.parametrize("target", TARGETS)
def test_api_probes_service_and_settings(rendered, target: str) -> None:
    docs = rendered[target]
    ((deployment, container),) = list(containers(docs, "api"))
    assert container["command"] == ["python", "-m", "api"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["resources"]["requests"]["cpu"] and container["resources"]["requests"]["memory"]
    env = effective_env(docs, container)
    port = {p["name"]: p["containerPort"] for p in container["ports"]}["http"]
    assert env["AUK_API_HOST"] == "0.0.0.0" and int(env["AUK_API_PORT"]) == port
    settings = Settings.from_env(env)
    settings.require_api_keys()
    settings.require_storage()
    # The API cuts batches into groups of the size the bulk pool renders in one pass.
    bulk = next(c for d, c in containers(docs, "worker") if d["metadata"]["name"] == "auk-worker-bulk")
    assert env["AUK_DEPLOY_CONFIG"] == effective_env(docs, bulk)["AUK_DEPLOY_CONFIG"]
    (service,) = of_kind(docs, "Service")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"


@pytest.mark.parametrize("target", TARGETS)
def test_every_budget_selects_a_deployment(rendered, target: str) -> None:
    docs = rendered[target]
    pods = [d["spec"]["template"]["metadata"]["labels"] for d in of_kind(docs, "Deployment")]
    budgets = of_kind(docs, "PodDisruptionBudget")
    assert len(budgets) == 4  # the API and each worker pool
    for budget in budgets:
        selector = budget["spec"]["selector"]["matchLabels"]
        assert sum(selector.items() <= labels.items() for labels in pods) == 1, budget["metadata"]["name"]
        assert budget["spec"]["maxUnavailable"] == 1  # drains proceed one pod at a time, never blocked


# ------------------------------------------------------------------------------------------------ settings, secrets


@pytest.mark.parametrize("target", TARGETS)
def test_every_auk_variable_is_one_the_service_reads(rendered, target: str) -> None:
    for name, path in READ_OUTSIDE_SETTINGS.items():
        assert name in (REPO / path).read_text(), f"{name} is no longer read by {path}"
    known = settings_names() | set(READ_OUTSIDE_SETTINGS)
    docs = rendered[target]
    names: set[str] = set()
    for configmap in of_kind(docs, "ConfigMap"):
        names |= set(configmap.get("data", {}))
    for secret in of_kind(docs, "Secret"):
        names |= set(secret.get("data", {}))
    for _, container in [*containers(docs, "api"), *containers(docs, "worker")]:
        names |= set(env_of(container))
        names |= {e["valueFrom"]["secretKeyRef"]["key"] for e in container.get("env", [])
                  if "secretKeyRef" in e.get("valueFrom", {})}  # fmt: skip
    unknown = sorted(n for n in names if n.startswith("AUK_") and n not in known)
    assert not unknown, f"{target}: AUK_* variables no process reads: {unknown}"


@pytest.mark.parametrize("target", TARGETS)
def test_secrets_come_only_from_secrets(rendered, deploy_copy, target: str) -> None:
    _, planted = deploy_copy
    docs = rendered[target]
    for configmap in of_kind(docs, "ConfigMap"):
        data = configmap.get("data", {})
        assert not set(SECRET_SETTINGS) & set(data), configmap["metadata"]["name"]
        assert urlparse(data.get("AUK_REDIS_URL", "redis://h/0")).password is None  # a password: Secret only
        for value in planted.values():
            assert value not in json.dumps(data), f"{target}: a Secret value in {configmap['metadata']['name']}"
    for doc in docs:
        if doc["kind"] != "Secret":
            assert not any(value in json.dumps(doc) for value in planted.values()), f"{target}: {doc['kind']}"
    for _, container in [*containers(docs, "api"), *containers(docs, "worker")]:
        env = env_of(container)
        for name in SECRET_SETTINGS:
            if name in env:
                assert env[name]["valueFrom"]["secretKeyRef"]["name"].startswith("auk-secrets"), name
    if target == "overlays/single-node":  # the only render that makes the Secret: it holds what was planted
        (secret,) = of_kind(docs, "Secret")
        assert {k: base64.b64decode(v).decode() for k, v in secret["data"].items()} == planted


@pytest.mark.parametrize("target", [t for t in TARGETS if t != "base"])
def test_overlays_set_every_endpoint(rendered, target: str) -> None:
    text = yaml.safe_dump_all(rendered[target])
    assert ".invalid" not in text, f"{target} leaves a placeholder endpoint of the base"


# ------------------------------------------------------------------------------------------------ KEDA


def backlog_sample() -> dict:
    """A ``GET /backlog`` answer as the API's model describes it: where a trigger's valueLocation must lead."""
    fields = QueueBacklog.model_fields
    return {variant: {priority: {name: 0 for name in fields} for priority in BACKLOG_PRIORITIES}
            for variant in BacklogView.model_fields}  # fmt: skip


def gjson_get(document: dict, path: str) -> Any:
    """A plain dotted GJSON path (what the triggers use: no wildcards or modifiers)."""
    assert re.fullmatch(r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*", path), path
    value: Any = document
    for part in path.split("."):
        value = value[part]
    return value


# Which pool serves which work: the pool's variant, and the priorities it must scale on.
POOL_WORK = {"auk-worker-interactive": ("base", {"interactive", "recovery"}),
             "auk-worker-flash": ("flash", {"interactive", "recovery", "bulk"}),
             "auk-worker-bulk": ("base", {"bulk"})}  # fmt: skip


@pytest.mark.parametrize("target", TARGETS)
def test_keda_scales_every_pool_on_its_backlog(rendered, target: str) -> None:
    docs = rendered[target]
    scaled = of_kind(docs, "ScaledObject")
    pools = {d["metadata"]["name"]: d for d in of_kind(docs, "Deployment") if component(d) == "worker"}
    if not scaled:  # an overlay without an autoscaler sizes every pool itself
        assert all("replicas" in pool["spec"] for pool in pools.values()), f"{target}: a pool with no size"
        return
    assert {obj["spec"]["scaleTargetRef"]["name"] for obj in scaled} == set(pools), "a pool without its autoscaler"
    (service,) = of_kind(docs, "Service")
    namespace = service["metadata"].get("namespace", "default")
    sample = backlog_sample()
    for obj in scaled:
        spec = obj["spec"]
        name = spec["scaleTargetRef"]["name"]
        pool = pools[name]
        assert spec["scaleTargetRef"].get("kind", "Deployment") == "Deployment"
        assert "replicas" not in pool["spec"], f"KEDA owns {name}'s replicas; a count here fights it on apply"
        assert spec["minReplicaCount"] == 0 and spec["maxReplicaCount"] >= 1  # from zero to the maximum and back
        # Scale to zero only after every job taken before the backlog emptied has had time to finish.
        assert spec["cooldownPeriod"] >= longest_job_s(docs)
        variant, priorities = POOL_WORK[name]
        env = effective_env(docs, pool["spec"]["template"]["spec"]["containers"][0])
        assert env["AUK_VARIANT"] == variant  # the pool consumes auk.<variant>.*, so it drains that backlog
        covered = set()
        for trigger in spec["triggers"]:
            assert trigger["type"] == "metrics-api"
            metadata = trigger["metadata"]
            url = urlparse(metadata["url"])
            # The API's Service, in the namespace it is deployed to, on the Service's port.
            assert url.hostname == f"{service['metadata']['name']}.{namespace}.svc.cluster.local", metadata["url"]
            assert (url.port or 80) == service["spec"]["ports"][0]["port"] and url.path == "/backlog"
            assert isinstance(gjson_get(sample, metadata["valueLocation"]), int), metadata["valueLocation"]
            trigger_variant, priority, field = metadata["valueLocation"].split(".")
            assert trigger_variant == variant and field == "demand", metadata["valueLocation"]
            assert float(metadata.get("activationTargetValue", "0")) == 0  # the first task starts a worker
            covered.add(priority)
        assert covered == priorities, f"{name} scales on {covered}, serves {priorities}"


@pytest.mark.parametrize("target", TARGETS)
def test_bulk_queue_depth_covers_every_worker_taking_bulk_work(rendered, target: str) -> None:
    """The feeder keeps AUK_BULK_QUEUE_DEPTH bulk tasks released per variant; a worker finding none released waits
    for the next feed even with thousands staged, so the depth must cover every task the workers consuming
    auk.base.bulk hold at once: the bulk pool (two tasks a worker: it stores one group while it renders the next)
    and the interactive pool (which takes bulk work when idle), at their largest."""
    docs = rendered[target]
    largest = {obj["spec"]["scaleTargetRef"]["name"]: obj["spec"]["maxReplicaCount"]
               for obj in of_kind(docs, "ScaledObject")}  # fmt: skip
    takers = 0
    for deployment, container in containers(docs, "worker"):
        env = effective_env(docs, container)
        if env["AUK_VARIANT"] == "base":
            name = deployment["metadata"]["name"]
            settings = Settings.from_env(env)
            deploy = load_deploy_config(REPO / "config" / Path(env["AUK_DEPLOY_CONFIG"]).name)
            each = tasks_at_once(settings.store_behind, deploy.dit.max_num_seqs)
            takers += each * largest.get(name, deployment["spec"].get("replicas", 1))
    depths = {Settings.from_env(effective_env(docs, c)).bulk_queue_depth
              for _, c in [*containers(docs, "worker"), *containers(docs, "api")]}  # fmt: skip
    assert len(depths) == 1, f"{target}: processes disagree on AUK_BULK_QUEUE_DEPTH: {depths}"
    assert depths.pop() >= takers, f"{target}: depth below the {takers} tasks workers taking base bulk work hold"


@pytest.mark.parametrize("target", TARGETS)
def test_a_variant_whose_pools_scale_to_zero_is_never_refused(rendered, target: str) -> None:
    """AUK_VARIANT_CHECK=live refuses a job whose variant no live worker serves; with pools at zero that would
    refuse the job that should start them."""
    docs = rendered[target]
    if not of_kind(docs, "ScaledObject"):
        return
    for _, container in containers(docs, "api"):
        assert Settings.from_env(effective_env(docs, container)).variant_check == "off", target
