"""The install manifests (manifests/, kustomize): they render, apply to the real control plane,
pass a security review written as tests, and the operator runs with the least-privilege role
they grant (a real `batchpilot run` authenticated as the ServiceAccount, in a namespace that
enforces the restricted Pod Security Standard)."""

from __future__ import annotations

import copy
import os
import re
import shutil
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from batchpilot_localdev.processes import stop_process
from batchpilot_operator import children
from batchpilot_operator.spec import parse_spec
from bptest import REPO, Kube, free_port, policy

MANIFESTS = REPO / "manifests"
FIXTURES = Path(__file__).resolve().parent / "fixtures"
RENDERED = ["base", "overlays/monitoring", "argocd", "examples"]
SA = "system:serviceaccount:batchpilot-system:batchpilot-operator"

POLICY: dict[str, Any] = policy(
    "scorer",
    lanes=[
        {
            "name": "background",
            "maxBatchSize": 64,
            "maxQueueDelay": "20ms",
            "maxQueueLength": 1024,
            "requestTimeout": "5s",
        }
    ],
    slo={"p99Latency": "1s", "maxQueueAge": "200ms"},
    rollout={"steps": [{"weight": 50, "pause": "1h"}], "analysisInterval": "1s"},
)


def kubectl_bin() -> str:
    from batchpilot_localdev.cluster import bin_dir

    local = bin_dir() / "kubectl"
    return str(local) if local.exists() else (shutil.which("kubectl") or "kubectl")


def render(path: str) -> list[dict[str, Any]]:
    result = subprocess.run(
        [kubectl_bin(), "kustomize", str(MANIFESTS / path)], capture_output=True, text=True, timeout=60, check=False
    )
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def of_kind(docs: list[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d["kind"] == kind]


# --------------------------------------------------------------------------- security review


def pod_security_problems(pod: dict[str, Any], require_limits: bool = True) -> list[str]:
    """Why a pod spec falls short of the restricted profile plus our own rules (empty: fine)."""
    problems: list[str] = []
    psc = pod.get("securityContext") or {}
    if psc.get("seccompProfile", {}).get("type") != "RuntimeDefault":
        problems.append("pod seccompProfile is not RuntimeDefault")
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            problems.append(f"pod uses {key}")
    for vol in pod.get("volumes", []):
        if "hostPath" in vol:
            problems.append(f"volume {vol['name']} is a hostPath")
    for c in pod.get("initContainers", []) + pod["containers"]:
        sc = c.get("securityContext") or {}
        name = c["name"]
        if not (sc.get("runAsNonRoot") or psc.get("runAsNonRoot")):
            problems.append(f"{name}: runAsNonRoot not set")
        if (sc.get("runAsUser", psc.get("runAsUser")) or 0) == 0 and "runAsUser" in {**psc, **sc}:
            problems.append(f"{name}: runs as uid 0")
        if sc.get("readOnlyRootFilesystem") is not True:
            problems.append(f"{name}: root filesystem is writable")
        if sc.get("allowPrivilegeEscalation") is not False:
            problems.append(f"{name}: privilege escalation not disabled")
        if sc.get("privileged"):
            problems.append(f"{name}: privileged")
        if sc.get("capabilities", {}).get("drop") != ["ALL"] or sc.get("capabilities", {}).get("add"):
            problems.append(f"{name}: capabilities not dropped to none")
        seccomp = sc.get("seccompProfile", {}).get("type")
        if seccomp not in (None, "RuntimeDefault"):
            problems.append(f"{name}: seccompProfile {seccomp}")
        resources = c.get("resources") or {}
        if not resources.get("requests"):
            problems.append(f"{name}: no resource requests")
        if require_limits and not resources.get("limits", {}).get("memory"):
            problems.append(f"{name}: no memory limit")
        if ":" not in c["image"].rsplit("/", 1)[-1] or c["image"].endswith(":latest"):
            problems.append(f"{name}: image not pinned to a tag")
    return problems


def test_security_review_catches_bad_pods() -> None:
    # the review itself has teeth
    bad = {"containers": [{"name": "c", "image": "x:latest", "securityContext": {"privileged": True}}]}
    found = pod_security_problems(bad)
    assert len(found) >= 6, found


def test_operator_deployment_is_locked_down() -> None:
    (dep,) = of_kind(render("base"), "Deployment")
    pod = dep["spec"]["template"]["spec"]
    assert pod_security_problems(pod) == []
    assert pod["serviceAccountName"] == "batchpilot-operator"
    (c,) = pod["containers"]
    assert c["image"] == "ghcr.io/batchpilot/operator:0.1.0"
    assert c["args"][0] == "run" and "--health-port=8081" in c["args"] and "--metrics-port=8080" in c["args"]
    for probe in ("livenessProbe", "readinessProbe"):
        assert c[probe]["httpGet"] == {"path": "/healthz", "port": "health"}
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"metrics": 8080, "health": 8081}
    # the metrics Service reaches that port
    svc = next(s for s in of_kind(render("base"), "Service") if s["metadata"]["name"] == "batchpilot-operator-metrics")
    assert svc["spec"]["ports"][0]["targetPort"] == "metrics"
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()


def test_runtime_pods_the_operator_builds_pass_the_same_review() -> None:
    spec = parse_spec(POLICY["spec"] | {"resources": {"gpus": 1, "cpu": "2", "memory": "8Gi"}})
    dep = children.build_deployment("p", "ns", "uid", spec, "stable", spec.revision(), 2)
    pod = dep["spec"]["template"]["spec"]
    pod["containers"][0]["image"] = "ghcr.io/batchpilot/runtime:0.1.0"
    assert pod_security_problems(pod) == []
    assert pod["automountServiceAccountToken"] is False


def test_rbac_is_least_privilege() -> None:
    docs = render("base")
    (role,) = of_kind(docs, "ClusterRole")
    for rule in role["rules"]:
        for key in ("apiGroups", "resources", "verbs"):
            assert "*" not in rule.get(key, []), rule
        assert "nonResourceURLs" not in rule and "resourceNames" not in rule
        assert "secrets" not in rule["resources"]
        assert not {"escalate", "bind", "impersonate"} & set(rule["verbs"])
    granted = {
        (g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]
    }
    # the operator never writes a policy's spec: patch on the object is for kopf's finalizer only,
    # and no update (full replace) of policies at all
    assert ("batchpilot.dev", "batchingpolicies", "update") not in granted
    assert ("batchpilot.dev", "batchingpolicies", "patch") in granted
    (binding,) = of_kind(docs, "ClusterRoleBinding")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "batchpilot-operator", "namespace": "batchpilot-system"}
    ]
    assert binding["roleRef"]["name"] == role["metadata"]["name"]


def test_two_replicas_elect_a_leader_with_exactly_the_lease_verbs() -> None:
    docs = render("base")
    (dep,) = of_kind(docs, "Deployment")
    assert dep["spec"]["replicas"] == 2
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    assert "--leader-elect" in c["args"]
    env = {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in c["env"]}
    assert env["POD_NAMESPACE"] == "metadata.namespace"
    (role,) = of_kind(docs, "Role")
    assert role["metadata"]["namespace"] == "batchpilot-system"
    granted = {
        (g, r, v, tuple(rule.get("resourceNames", ())))
        for rule in role["rules"]
        for g in rule["apiGroups"]
        for r in rule["resources"]
        for v in rule["verbs"]
    }
    assert granted == {
        ("coordination.k8s.io", "leases", "create", ()),
        ("coordination.k8s.io", "leases", "get", ("batchpilot-operator",)),
        ("coordination.k8s.io", "leases", "update", ("batchpilot-operator",)),
    }
    (binding,) = of_kind(docs, "RoleBinding")
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "Role",
        "name": role["metadata"]["name"],
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "batchpilot-operator", "namespace": "batchpilot-system"}
    ]


def test_sync_waves_put_the_crd_first() -> None:
    def wave(d: dict[str, Any]) -> int:
        return int((d["metadata"].get("annotations") or {}).get("argocd.argoproj.io/sync-wave", "0"))

    docs = render("overlays/monitoring")
    (crd,) = of_kind(docs, "CustomResourceDefinition")
    assert wave(crd) == -10
    assert all(wave(d) > wave(crd) for d in docs if d is not crd)
    assert all(wave(d) == 0 for d in render("examples")), "policies sync after the CRD and the operator"


def test_podmonitor_relabels_into_the_labels_analysis_queries() -> None:
    docs = render("overlays/monitoring")
    (pm,) = of_kind(docs, "PodMonitor")
    # it selects exactly the pods the operator builds
    spec = parse_spec(POLICY["spec"])
    pod_labels = children.build_deployment("p", "ns", "u", spec, "canary", "r", 1)["spec"]["template"]["metadata"][
        "labels"
    ]
    assert pm["spec"]["selector"]["matchLabels"].items() <= pod_labels.items()
    assert pm["spec"]["namespaceSelector"] == {"any": True}
    (endpoint,) = pm["spec"]["podMetricsEndpoints"]
    assert endpoint["port"] == "http" and endpoint["path"] == "/metrics"

    def meta(label: str) -> str:
        return "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", label)

    relabel = {r["targetLabel"]: r["sourceLabels"] for r in endpoint["relabelings"]}
    assert relabel == {
        "namespace": ["__meta_kubernetes_namespace"],
        "policy": [meta(children.LABEL_POLICY)],
        "revision": [meta(children.LABEL_REVISION)],
        "track": [meta(children.LABEL_TRACK)],
        "pod": ["__meta_kubernetes_pod_name"],
        "environment": [meta(children.LABEL_ENVIRONMENT)],
    }
    # the analysis selects on exactly these (plus lane and tenant, from the runtime; environment
    # when the policy has one, and then its pods carry the label the PodMonitor reads)
    from batchpilot_operator.analysis import selector

    sel = selector(namespace="n", policy="p", track="t", revision="r", lane="l", tenant="a", environment="prod")
    assert set(re.findall(r"(\w+)=", sel)) == {*relabel} - {"pod"} | {"lane", "tenant"}
    labelled = children.build_deployment("p", "ns", "u", spec, "canary", "r", 1, environment="prod")
    assert labelled["spec"]["template"]["metadata"]["labels"][children.LABEL_ENVIRONMENT] == "prod"
    assert children.LABEL_ENVIRONMENT not in pod_labels


def test_dashboard_configmap_is_picked_up_by_the_grafana_sidecar() -> None:
    (cm,) = [
        d
        for d in of_kind(render("overlays/monitoring"), "ConfigMap")
        if d["metadata"]["name"] == "batchpilot-dashboard"
    ]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert cm["metadata"]["namespace"] == "batchpilot-system"
    monitoring = [d for d in render("overlays/monitoring") if d["apiVersion"].startswith("monitoring.coreos.com/")]
    assert {d["metadata"].get("namespace") for d in monitoring} == {"batchpilot-system"}
    assert '"uid": "batchpilot-policy"' in cm["data"]["batchpilot.json"]


def test_dockerfiles_run_as_non_root_and_copy_what_exists() -> None:
    for path, entry in (
        (REPO / "operator" / "Dockerfile", '"batchpilot"'),
        (REPO / "runtime" / "Dockerfile", '"batchpilot-runtime", "--host", "0.0.0.0"'),
    ):
        text = path.read_text()
        lines = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]
        users = [ln.split()[1] for ln in lines if ln.startswith("USER ")]
        assert users and users[-1].split(":")[0] == "65532", path
        assert f"ENTRYPOINT [{entry}]" in lines, path
        missing = []
        for ln in lines:
            if ln.startswith("COPY ") and "--from=" not in ln:
                for src in ln.split()[1:-1]:
                    if not (REPO / src).exists():
                        missing.append(src)
        assert not missing, (path, missing)
    runtime = (REPO / "runtime" / "Dockerfile").read_text()
    # GPU nodes by default: PyPI's CUDA torch, as locked; `make images` builds TORCH=debian (CPU).
    assert "ARG TORCH=pypi" in runtime and "-r hack/requirements-torch.lock" in runtime
    assert all(
        ln.split()[1] == "${BASE}"
        for ln in (runtime + (REPO / "operator" / "Dockerfile").read_text()).splitlines()
        if ln.startswith("FROM ")
    )
    pyproject = (REPO / "pyproject.toml").read_text()
    assert 'batchpilot = "batchpilot_operator.cli:main"' in pyproject
    assert 'batchpilot-runtime = "batchpilot_runtime.server:main"' in pyproject


# --------------------------------------------------------------------------- against the API server


def apply_k(kube: Kube, path: str, *extra: str) -> subprocess.CompletedProcess[str]:
    mode = ["--dry-run=server"] if kube.external else []
    return kube.kubectl("apply", "-k", str(MANIFESTS / path), *mode, *extra)


@pytest.fixture(scope="module")
def installed(kube: Kube) -> Kube:
    """The base applied for real (server-side dry-run against an external cluster)."""
    result = apply_k(kube, "base")
    assert "Warning" not in result.stderr, result.stderr
    if not kube.external:
        kube.kubectl("apply", "-f", str(FIXTURES / "thirdparty-crds.yaml"))
        kube.wait_established("podmonitors.monitoring.coreos.com", "applications.argoproj.io")
    return kube


@pytest.mark.cluster
def test_base_applies_and_the_operator_pod_is_admitted_as_restricted(installed: Kube) -> None:
    kube = installed
    again = apply_k(kube, "base")
    assert "configured" not in again.stdout, f"re-applying the base changed something:\n{again.stdout}"
    if kube.external:
        return
    ns = kube.get("namespace", "batchpilot-system")
    assert ns is not None and ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"
    # The ReplicaSet's pod passed restricted Pod Security admission (kwok then runs it).
    kube.wait_for(
        lambda: (
            ((kube.get("deployment", "batchpilot-operator", "batchpilot-system") or {}).get("status") or {}).get(
                "readyReplicas"
            )
            == 2
        ),
        60,
        "the operator Deployment's pods (leader and standby) admitted and ready",
    )


@pytest.mark.cluster
def test_monitoring_overlay_and_argocd_apply(installed: Kube) -> None:
    kube = installed
    result = apply_k(kube, "overlays/monitoring")
    for kind in ("podmonitor", "servicemonitor", "prometheusrule", "configmap/batchpilot-dashboard"):
        assert kind in result.stdout.lower(), result.stdout
    kube.kubectl("create", "namespace", "argocd", check=False)
    result = apply_k(kube, "argocd")
    assert "configmap/argocd-cm" in result.stdout and "application.argoproj.io/batchpilot" in result.stdout


@pytest.mark.cluster
def test_examples_apply(kube: Kube, namespace: str) -> None:
    # the real CRD (schema and CEL rules) admits every example
    result = kube.kubectl("apply", "-k", str(MANIFESTS / "examples"), "-n", namespace)
    # the Gateway API example stays out of the kustomization (it needs a route); the CRD admits it too
    routed = kube.kubectl("apply", "-f", str(MANIFESTS / "examples" / "gateway-canary.yaml"), "-n", namespace)
    created = re.findall(r"batchingpolicy\.batchpilot\.dev/(\S+) created", result.stdout + routed.stdout)
    assert sorted(created) == ["chat-embedder", "chat-ranker", "nightly-scorer", "search-ranker"]


# --------------------------------------------------------------------------- least privilege, for real


def sa_kubeconfig(kube: Kube, path: Path) -> Path:
    token = kube.kubectl(
        "create", "token", "batchpilot-operator", "-n", "batchpilot-system", "--duration=1h"
    ).stdout.strip()
    admin = yaml.safe_load(kube.kubeconfig.read_text())
    current = next(c for c in admin["contexts"] if c["name"] == admin["current-context"])
    cluster = next(c for c in admin["clusters"] if c["name"] == current["context"]["cluster"])
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [cluster],
        "users": [{"name": "batchpilot-operator", "user": {"token": token}}],
        "contexts": [{"name": "sa", "context": {"cluster": cluster["name"], "user": "batchpilot-operator"}}],
        "current-context": "sa",
    }
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture
def restricted_namespace(kube: Kube, namespace: str) -> str:
    kube.kubectl("label", "namespace", namespace, "pod-security.kubernetes.io/enforce=restricted")
    return namespace


@pytest.fixture
def sa_operator(installed: Kube, tmp_path: Path) -> Iterator[tuple[subprocess.Popen[bytes], Path, int]]:
    """`batchpilot run` cluster-wide, as the Deployment runs it, with the ServiceAccount's token."""
    if installed.external:
        pytest.skip("runs a cluster-wide operator: local control plane only")
    config = sa_kubeconfig(installed, tmp_path / "sa.kubeconfig")
    health = free_port()
    log = tmp_path / "operator.log"
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "batchpilot_operator.cli", "run",
            f"--kubeconfig={config}", "--prometheus-url=http://127.0.0.1:9",
            f"--metrics-port={free_port()}", f"--health-port={health}", "--resync=1",
        ],
        stdout=log.open("wb"), stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    try:
        yield proc, log, health
    finally:
        stop_process(proc, 15)


@pytest.mark.cluster
def test_service_account_cannot_read_secrets(installed: Kube) -> None:
    if installed.external:
        pytest.skip("local control plane only")
    for verb, resource, expected in (
        ("get", "secrets", "no"),
        ("list", "secrets", "no"),
        ("update", "batchingpolicies.batchpilot.dev", "no"),
        ("patch", "batchingpolicies.batchpilot.dev/status", "yes"),
        ("create", "pods", "no"),
    ):
        result = installed.kubectl("auth", "can-i", verb, resource, "--as", SA, "-A", check=False)
        assert result.stdout.strip() == expected, (verb, resource, result.stdout, result.stderr)


@pytest.mark.cluster
@pytest.mark.slow
def test_operator_runs_with_only_its_role(
    installed: Kube, restricted_namespace: str, sa_operator: tuple[subprocess.Popen[bytes], Path, int]
) -> None:
    kube, ns = installed, restricted_namespace
    proc, log, health = sa_operator

    def healthz() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"operator exited {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{health}/healthz", timeout=2) as resp:
                return bool(resp.status == 200)
        except OSError:
            return False

    kube.wait_for(healthz, 60, "kopf's /healthz (the Deployment's probes)")

    def phase(want: str) -> dict[str, Any]:
        def check() -> dict[str, Any] | None:
            obj = kube.get("batchingpolicy", "scorer", ns)
            st = (obj or {}).get("status") or {}
            return st if st.get("phase") == want else None

        try:
            result: dict[str, Any] = kube.wait_for(check, 90, f"phase {want}")
        except AssertionError as exc:
            raise AssertionError(f"{exc}\noperator log:\n{log.read_text()[-4000:]}") from exc
        return result

    kube.apply(POLICY, "-n", ns)
    # Healthy: children created by server-side apply, runtime pods admitted under the
    # restricted Pod Security Standard and ready, status written, finalizer patched in.
    phase("Healthy")
    # kopf patches its finalizer in separately from the operator's status write, in either
    # order: wait for it (with only the Role's rights, the patch must succeed).
    kube.wait_for(
        lambda: (
            "batchpilot.dev/finalizer"
            in ((kube.get("batchingpolicy", "scorer", ns) or {}).get("metadata", {}).get("finalizers") or [])
        ),
        30,
        "kopf's finalizer",
    )
    # a canary, then an abort: the canary Deployment is deleted again
    changed = copy.deepcopy(POLICY)
    changed["spec"]["lanes"][0]["maxQueueDelay"] = "10ms"
    kube.apply(changed, "-n", ns)
    kube.wait_for(lambda: kube.get("deployment", "scorer-canary", ns), 60, "the canary Deployment")
    kube.kubectl("annotate", "-n", ns, "batchingpolicy", "scorer", "batchpilot.dev/abort=test@2026-11-30T00:00:00Z")
    phase("RolledBack")
    kube.wait_for(lambda: kube.get("deployment", "scorer-canary", ns) is None, 60, "the canary Deployment deleted")

    # Events were posted on the policy.
    def reasons() -> set[str]:
        out = kube.kubectl("get", "events", "-n", ns, "--field-selector", "involvedObject.name=scorer", "-o", "yaml")
        return {e["reason"] for e in yaml.safe_load(out.stdout)["items"]}

    kube.wait_for(lambda: {"Initialized", "Aborted"} <= reasons(), 10, "the Initialized and Aborted Events")
    # Deleting the policy: kopf removes its finalizer, children are garbage-collected.
    kube.kubectl("delete", "batchingpolicy", "scorer", "-n", ns, "--wait=false")
    kube.wait_for(lambda: kube.get("batchingpolicy", "scorer", ns) is None, 60, "the policy deleted")
    text = log.read_text()
    # No RBAC denial ("User ... cannot <verb> resource ..."). Other 403s may appear: the operator
    # is cluster-wide and earlier tests leave policies in terminating namespaces.
    denied = re.findall(r"cannot \w+ resource \S+ in API group \S+", text)
    assert not denied, (sorted(set(denied)), text[-4000:])


@pytest.mark.cluster
def test_operator_leads_with_only_its_role(installed: Kube, tmp_path: Path) -> None:
    """`--leader-elect` as the Deployment runs it, with the ServiceAccount's token: it takes
    the Lease in its namespace, and releases it on SIGTERM; no other Lease is writable."""
    if installed.external:
        pytest.skip("local control plane only")
    kube = installed
    for verb, where, expected in (
        ("update", "lease/batchpilot-operator", "yes"),
        ("update", "lease/other", "no"),
        ("delete", "lease/batchpilot-operator", "no"),
    ):
        result = kube.kubectl("auth", "can-i", verb, where, "-n", "batchpilot-system", "--as", SA, check=False)
        assert result.stdout.strip() == expected, (verb, where, result.stdout)
    assert (
        kube.kubectl("auth", "can-i", "create", "leases", "-n", "default", "--as", SA, check=False).stdout.strip()
        == "no"
    )
    config = sa_kubeconfig(kube, tmp_path / "sa.kubeconfig")
    log = tmp_path / "operator.log"
    kube.kubectl("delete", "lease", "batchpilot-operator", "-n", "batchpilot-system", "--ignore-not-found")
    proc = subprocess.Popen(
        [
            sys.executable, "-m", "batchpilot_operator.cli", "run",
            f"--kubeconfig={config}", "--prometheus-url=http://127.0.0.1:9", "--namespace=batchpilot-system",
            f"--metrics-port={free_port()}", "--health-port=0", "--leader-elect",
            "--leader-election-namespace=batchpilot-system",
        ],
        stdout=log.open("wb"), stderr=subprocess.STDOUT,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "BATCHPILOT_IDENTITY": "sa-test"},
    )  # fmt: skip
    try:

        def holder() -> str | None:
            if proc.poll() is not None:
                raise AssertionError(f"operator exited {proc.returncode}:\n{log.read_text()[-3000:]}")
            lease = kube.get("lease", "batchpilot-operator", "batchpilot-system")
            return ((lease or {}).get("spec") or {}).get("holderIdentity")

        kube.wait_for(lambda: holder() == "sa-test", 60, "the operator to take the Lease")
        kube.wait_for(lambda: "caches synced" in log.read_text(), 60, "the leader's caches")
    finally:
        proc.terminate()
        proc.wait(timeout=20)
    assert proc.returncode == 0, log.read_text()[-3000:]
    lease = kube.get("lease", "batchpilot-operator", "batchpilot-system")
    assert lease is not None and not lease["spec"].get("holderIdentity"), lease
    assert "cannot" not in log.read_text(), log.read_text()[-3000:]
