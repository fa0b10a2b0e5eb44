"""Offline checks of deploy/overlays/inference-pool (no cluster): icekv behind a Gateway API
Inference Extension InferencePool with its endpoint picker (EPP).

The built-in kinds validate against the Kubernetes schemas; the Inference Extension's and Gateway
API's kinds (no schema here) are checked by what must line up: the pool selects the icekv pods on
their http port, names the EPP's Service and port, the EPP reads that pool with the rights to, and
the HTTPRoute sends the OpenAI API to the pool.
"""

import re

import kubernetes_validate
import pytest

from icekv.cli import build_parser
from tests.deploy.test_manifests import K8S_VERSION, ROOT, by_kind, kustomize, render, sorted_by_name

OVERLAY = ROOT / "deploy" / "overlays" / "inference-pool"
POOL_GROUP = "inference.networking.k8s.io"
# Kinds with no schema in kubernetes-validate, each checked below (a new one must be added here).
CRDS = {("monitoring.coreos.com", "ServiceMonitor"), (POOL_GROUP, "InferencePool"),
        ("gateway.networking.k8s.io", "HTTPRoute")}
# The EPP's flags (v1.x: pkg/epp/server/options.go and its logging options; controller-runtime's zap flags).
EPP_FLAGS = {
    "grpc-port", "grpc-health-port", "metrics-port", "ha-enable-leader-election", "pool-group", "pool-namespace",
    "pool-name", "endpoint-selector", "endpoint-target-ports", "disable-endpoint-subset-filter",
    "refresh-metrics-interval", "refresh-prometheus-metrics-interval", "metrics-staleness-threshold", "tracing",
    "health-checking", "enable-pprof", "cert-path", "enable-cert-reload", "secure-serving", "metrics-endpoint-auth",
    "config-file", "config-text", "v", "zap-devel", "zap-encoder", "zap-log-level", "zap-stacktrace-level",
    "zap-time-encoding",
}
# Refused when set since v1.4 (deprecated for EndpointPickerConfig engineConfigs); the defaults are vLLM's names.
EPP_METRIC_FLAGS = {"total-queued-requests-metric", "total-running-requests-metric",
                    "kv-cache-usage-percentage-metric", "lora-info-metric", "cache-info-metric"}
# The EPP's default metric names (the vLLM engine config), the ones it schedules on.
EPP_DEFAULT_METRICS = {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc"}
READ = {"get", "list", "watch"}


@pytest.fixture(scope="module")
def docs():
    return render(OVERLAY)


def _group(doc) -> str:
    return doc["apiVersion"].rpartition("/")[0]


def _pool(docs):
    return by_kind(docs, "InferencePool")


def _epp(docs):
    """The Deployment the pool's endpointPickerRef leads to (through its Service's selector)."""
    svc = by_kind(docs, "Service", _pool(docs)["spec"]["endpointPickerRef"]["name"])
    found = [d for d in docs if d["kind"] == "Deployment"
             and svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()]
    assert len(found) == 1, [d["metadata"]["name"] for d in found]
    return found[0]


def _epp_args(docs) -> dict[str, str]:
    args, flags = _epp(docs)["spec"]["template"]["spec"]["containers"][0]["args"], {}
    for arg in args:
        match = re.fullmatch(r"--([a-z-]+)=(.*)", arg)
        assert match, f"not --flag=value: {arg}"
        assert match[1] not in flags, f"twice: {arg}"
        flags[match[1]] = match[2]
    return flags


def test_every_object_validates_or_is_a_checked_crd(docs):
    skipped = set()
    for doc in docs:
        if (_group(doc), doc["kind"]) in CRDS:
            skipped.add((_group(doc), doc["kind"]))
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
    assert skipped == CRDS
    assert by_kind(docs, "InferencePool")["apiVersion"] == f"{POOL_GROUP}/v1"
    assert by_kind(docs, "HTTPRoute")["apiVersion"] == "gateway.networking.k8s.io/v1"


def test_the_overlay_adds_to_the_base_and_changes_none_of_it(docs):
    base = render(ROOT / "deploy" / "base")
    ident = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    assert len(ident) == len(docs)  # no name twice
    for doc in base:
        assert ident[doc["kind"], doc["metadata"]["name"]] == doc
    assert not [d for d in docs if "namespace" in d["metadata"]]  # all in the namespace applied to, with the pool


def test_the_pool_selects_the_icekv_pods_and_no_others(docs):
    selector = _pool(docs)["spec"]["selector"]
    assert set(selector) == {"matchLabels"} and selector["matchLabels"]  # v1 selects by matchLabels only
    for dep in (d for d in docs if d["kind"] == "Deployment"):
        selected = selector["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
        assert selected == (dep["metadata"]["name"] == "icekv"), dep["metadata"]["name"]


def test_the_pool_targets_the_http_port_icekv_serves(docs):
    spec = _pool(docs)["spec"]
    c = by_kind(docs, "Deployment", "icekv")["spec"]["template"]["spec"]["containers"][0]
    http = {p["name"]: p["containerPort"] for p in c["ports"]}["http"]
    assert spec["targetPorts"] == [{"number": http}]
    served = build_parser().parse_args([a for a in c["args"] if "$(" not in a])
    assert served.http_port == http  # the port icekv serve's frontend (OpenAI API, /health, /metrics) listens on
    assert spec.get("appProtocol", "http") == "http"


def test_the_endpoint_picker_ref_names_the_epp_service_and_its_ext_proc_port(docs):
    ref = _pool(docs)["spec"]["endpointPickerRef"]
    assert ref.get("group", "") == "" and ref.get("kind", "Service") == "Service"
    assert ref.get("failureMode", "FailClose") in {"FailOpen", "FailClose"}
    svc = by_kind(docs, "Service", ref["name"])
    port = [p for p in svc["spec"]["ports"] if p["port"] == ref["port"]["number"]]
    assert len(port) == 1
    c = _epp(docs)["spec"]["template"]["spec"]["containers"][0]
    container_ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert container_ports[port[0]["targetPort"]] == int(_epp_args(docs)["grpc-port"])  # the ext-proc server


def test_the_epp_reads_the_pool_with_known_flags_and_no_metric_names(docs):
    flags, pool = _epp_args(docs), _pool(docs)
    assert set(flags) <= EPP_FLAGS, set(flags) - EPP_FLAGS
    assert not set(flags) & EPP_METRIC_FLAGS
    assert flags["pool-name"] == pool["metadata"]["name"]
    assert flags.get("pool-group", POOL_GROUP) == _group(pool)
    c = _epp(docs)["spec"]["template"]["spec"]["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    assert flags["pool-namespace"] == "$(NAMESPACE)"  # its own namespace, the pool's
    assert env["NAMESPACE"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.namespace"
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["grpc-health"] == int(flags["grpc-health-port"])
    assert c["readinessProbe"]["grpc"]["port"] == c["livenessProbe"]["grpc"]["port"] == int(flags["grpc-health-port"])
    assert ports["metrics"] == int(flags["metrics-port"])
    assert set(ports.values()) == {int(flags[f]) for f in ("grpc-port", "grpc-health-port", "metrics-port")}
    metrics = [p for p in by_kind(docs, "Service", pool["spec"]["endpointPickerRef"]["name"])["spec"]["ports"]
               if p["targetPort"] == "metrics"]
    assert len(metrics) == 1
    spec = _epp(docs)["spec"]
    assert spec["replicas"] == 1 or "ha-enable-leader-election" in flags  # one active picker


def test_the_epp_image_is_a_v1_release_and_the_docs_install_its_crds(docs):
    image = _epp(docs)["spec"]["template"]["spec"]["containers"][0]["image"]
    tag = re.fullmatch(r"registry\.k8s\.io/gateway-api-inference-extension/epp:(v1\.\d+\.\d+)", image)
    assert tag, image
    guide = (ROOT / "docs" / "deployment.md").read_text()
    crds = f"github.com/kubernetes-sigs/gateway-api-inference-extension/releases/download/{tag[1]}/manifests.yaml"
    assert crds in guide  # the CRDs of the release the picker comes from


def _rules_for(docs, account: str, binding_kind: str, role_kind: str) -> list[dict]:
    rules = []
    for binding in (d for d in docs if d["kind"] == binding_kind):
        if any(s["kind"] == "ServiceAccount" and s["name"] == account for s in binding["subjects"]):
            assert binding["roleRef"]["kind"] == role_kind
            rules += by_kind(docs, role_kind, binding["roleRef"]["name"])["rules"]
    return rules


def _allows(rules, group: str, resource: str, verbs: set[str]) -> bool:
    return verbs <= {v for r in rules if group in r["apiGroups"] and resource in r["resources"] for v in r["verbs"]}


def test_the_epp_may_read_its_pool_and_pods_and_review_metrics_tokens(docs):
    account = _epp(docs)["spec"]["template"]["spec"]["serviceAccountName"]
    by_kind(docs, "ServiceAccount", account)
    namespaced = _rules_for(docs, account, "RoleBinding", "Role")
    assert _allows(namespaced, POOL_GROUP, "inferencepools", READ)
    assert _allows(namespaced, "", "pods", READ)
    for resource in ("inferenceobjectives", "inferencemodelrewrites"):  # watched when their CRDs exist
        assert _allows(namespaced, "inference.networking.x-k8s.io", resource, READ)
    assert {v for r in namespaced for v in r["verbs"]} <= READ  # it only reads
    cluster = _rules_for(docs, account, "ClusterRoleBinding", "ClusterRole")
    assert _allows(cluster, "authentication.k8s.io", "tokenreviews", {"create"})  # --metrics-endpoint-auth (on)
    assert _allows(cluster, "authorization.k8s.io", "subjectaccessreviews", {"create"})
    assert not _allows(cluster, "", "pods", {"get"})  # nothing cluster-wide beyond the reviews


def test_the_route_sends_the_openai_api_through_the_documented_gateway_to_the_pool(docs):
    route, pool = by_kind(docs, "HTTPRoute"), _pool(docs)
    (rule,) = route["spec"]["rules"]
    assert rule["backendRefs"] == [{"group": _group(pool), "kind": "InferencePool", "name": pool["metadata"]["name"]}]
    assert [m["path"] for m in rule["matches"]] == [{"type": "PathPrefix", "value": "/v1"}]
    (parent,) = route["spec"]["parentRefs"]
    assert parent.get("group", "gateway.networking.k8s.io") == "gateway.networking.k8s.io"
    assert parent.get("kind", "Gateway") == "Gateway"
    guide = (ROOT / "docs" / "deployment.md").read_text()
    assert f"name: {parent['name']}" in guide  # the Gateway the guide has the user create


def test_the_epp_pod_is_hardened_and_reachable_only_on_its_ports(docs):
    epp = _epp(docs)
    spec = epp["spec"]["template"]["spec"]
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    (c,) = spec["containers"]
    sc = c["securityContext"]
    assert sc["allowPrivilegeEscalation"] is False and sc["readOnlyRootFilesystem"] is True
    assert sc["capabilities"]["drop"] == ["ALL"]
    icekv = by_kind(docs, "Deployment", "icekv")["spec"]["template"]["spec"]
    assert spec["terminationGracePeriodSeconds"] >= icekv["terminationGracePeriodSeconds"]
    labels = epp["spec"]["template"]["metadata"]["labels"]
    policy = [d for d in docs if d["kind"] == "NetworkPolicy"
              and d["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
    assert len(policy) == 1
    assert {p["port"] for p in policy[0]["spec"]["ingress"][0]["ports"]} == {p["containerPort"] for p in c["ports"]}


def test_icekv_exports_the_metrics_the_epp_reads_by_default():
    from icekv.serving.openai.engine_metrics import VLLM_METRICS

    assert EPP_DEFAULT_METRICS <= {m.name for m in VLLM_METRICS}


def test_kustomize_renders_what_the_tests_check(docs):
    real = kustomize(OVERLAY)
    if real is None:
        pytest.skip("kubectl not installed")
    assert real == sorted_by_name(docs)
