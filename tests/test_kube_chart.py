"""`helm install` of the chart into a real API server (tests/kube_cluster.py: kube-apiserver v1.20.2 with etcd and
the garbage collector), for every value combination docs/DEPLOY.md documents.

What a real server checks that `helm template` and the schemas cannot: the CRD is accepted (a structural schema) and
becomes Established; every object is admitted, defaulted and stored; nothing the chart writes is dropped on the way
(an unknown field is pruned silently by v1.20, so each live object must still hold every field rendered);
`helm upgrade` adds and removes objects; `helm uninstall` removes all but the CRD, which is kept on purpose.
Prometheus Operator's ServiceMonitor and PrometheusRule CRDs are installed first (tests/data carries them).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.deploy_tools import CHART, COMBINATIONS, run, tool
from tests.kube_cluster import ControlPlane, wait_for

RELEASE = NAMESPACE = "strata"
DATA = Path(__file__).parent / "data"
CRD_NAME = "stratadeployments.strata.dev"


def helm(kube: ControlPlane, *args: str, check: bool = True):
    return run([tool("helm"), f"--kubeconfig={kube.admin_kubeconfig}", *args], timeout=120, check=check)


def sets(combination: str) -> list[str]:
    return [arg for s in COMBINATIONS[combination] for arg in ("--set", s)]


def manifest(kube: ControlPlane) -> list[dict]:
    out = helm(kube, "get", "manifest", RELEASE, "-n", NAMESPACE).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def live(kube: ControlPlane, obj: dict) -> dict | None:
    kind, meta = obj["kind"], obj["metadata"]
    where = ["-n", meta["namespace"]] if meta.get("namespace") else []
    group = obj["apiVersion"].split("/")[0] if "/" in obj["apiVersion"] else ""
    resource = f"{kind.lower()}.{group}" if group else kind.lower()
    proc = kube.kubectl("get", resource, meta["name"], *where, "-o", "json", check=False)
    if proc.returncode != 0:
        assert "NotFound" in proc.stderr, proc.stderr
        return None
    return json.loads(proc.stdout)


def meaningful(value):
    """What a rendered object says: empty maps, lists and nulls mean "nothing" and the server stores nothing."""
    if isinstance(value, dict):
        kept = {k: meaningful(v) for k, v in value.items()}
        return {k: v for k, v in kept.items() if v not in ({}, [], None)}
    if isinstance(value, list):
        return [meaningful(v) for v in value]
    return value


def missing(live_value, wanted, path: str = "") -> list[str]:
    """Where `live_value` does not hold `wanted` (the server may add defaults, never drop or change a field)."""
    if isinstance(wanted, dict):
        if not isinstance(live_value, dict):
            return [f"{path or '.'}: {live_value!r}"]
        return [m for k, v in wanted.items() for m in (missing(live_value[k], v, f"{path}.{k}") if k in live_value
                                                       else [f"{path}.{k}: dropped"])]
    if isinstance(wanted, list):
        if not isinstance(live_value, list) or len(live_value) != len(wanted):
            return [f"{path}: {live_value!r} != {wanted!r}"]
        return [m for i, (a, b) in enumerate(zip(live_value, wanted, strict=True)) for m in missing(a, b, f"{path}[{i}]")]
    return [] if live_value == wanted else [f"{path}: {live_value!r} != {wanted!r}"]


def assert_installed_as_rendered(kube: ControlPlane, objects: list[dict]) -> None:
    problems = []
    for obj in objects:
        got = live(kube, obj)
        name = f"{obj['kind']}/{obj['metadata']['name']}"
        if got is None:
            problems.append(f"{name}: not on the server")
            continue
        problems += [f"{name} {m}" for m in missing(got, meaningful(obj))]
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="module")
def cluster(kube: ControlPlane) -> ControlPlane:
    crds = list(yaml.safe_load_all((DATA / "prometheus-operator-crds.yaml").read_text()))
    kube.apply_objects(crds)
    for crd in crds:
        kube.kubectl("wait", "--for=condition=Established", "--timeout=30s", f"crd/{crd['metadata']['name']}")
    return kube


@pytest.mark.parametrize("combination", COMBINATIONS)
def test_each_documented_combination_installs_as_rendered_and_uninstalls(cluster, combination):
    for s in COMBINATIONS[combination]:  # watched namespaces must exist before the install (docs/DEPLOY.md)
        if s.startswith("operator.watchNamespaces="):
            for namespace in s.split("=", 1)[1].strip("{}").split(","):
                cluster.ensure_namespace(namespace)
    helm(cluster, "install", RELEASE, str(CHART), "-n", NAMESPACE, "--create-namespace", *sets(combination))
    try:
        objects = manifest(cluster)
        assert objects
        assert_installed_as_rendered(cluster, objects)
        if any(o["kind"] == "CustomResourceDefinition" for o in objects):
            crd = json.loads(cluster.kubectl("get", "crd", CRD_NAME, "-o", "json").stdout)
            conditions = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
            assert conditions["Established"] == "True" and conditions["NamesAccepted"] == "True", conditions
            # the CRD's structural schema is what the server itself checks a resource against
            bad = {"apiVersion": "strata.dev/v1alpha1", "kind": "StrataDeployment",
                   "metadata": {"name": "bad", "namespace": NAMESPACE}, "spec": {"model": "default", "replicas": -1}}
            refused = cluster.kubectl("create", "--validate=false", "-f", "-", stdin=yaml.safe_dump(bad), check=False)
            assert refused.returncode != 0 and "spec.replicas" in refused.stderr, refused.stderr
    finally:
        helm(cluster, "uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout=60s")
    for obj in objects:
        if (obj["metadata"].get("annotations") or {}).get("helm.sh/resource-policy") == "keep":
            # kept on purpose: the CRD (uninstalling must not delete users' resources), the model cache's claim
            assert live(cluster, obj) is not None, obj["kind"]
            if obj["kind"] != "CustomResourceDefinition":
                cluster.kubectl("delete", obj["kind"].lower(), obj["metadata"]["name"], "-n", NAMESPACE)
        else:
            assert wait_for(f"{obj['kind']}/{obj['metadata']['name']} to go", lambda o=obj: live(cluster, o) is None)


def test_upgrade_adds_changes_and_removes_objects_and_keeps_the_crd(cluster):
    helm(cluster, "install", RELEASE, str(CHART), "-n", NAMESPACE, "--create-namespace", *sets("default"))
    try:
        first = manifest(cluster)
        helm(cluster, "upgrade", RELEASE, str(CHART), "-n", NAMESPACE, *sets("everything"),
             "--set", "server.batch=8")
        second = manifest(cluster)
        assert_installed_as_rendered(cluster, second)
        kinds = {o["kind"] for o in second} - {o["kind"] for o in first}
        assert {"ServiceMonitor", "PrometheusRule", "PersistentVolumeClaim", "Service"} <= kinds
        server = live(cluster, next(o for o in second if o["kind"] == "Deployment" and
                                    o["metadata"]["labels"]["app.kubernetes.io/component"] == "server"))
        args = server["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--batch=8" in args, args

        helm(cluster, "upgrade", RELEASE, str(CHART), "-n", NAMESPACE, *sets("operator-only"))
        third = manifest(cluster)
        assert_installed_as_rendered(cluster, third)
        names = {(o["kind"], o["metadata"]["name"]) for o in third}
        gone = [o for o in second if (o["kind"], o["metadata"]["name"]) not in names]
        assert {o["kind"] for o in gone} >= {"ServiceMonitor", "PrometheusRule", "ConfigMap"}
        for obj in gone:
            if (obj["metadata"].get("annotations") or {}).get("helm.sh/resource-policy") == "keep":
                assert live(cluster, obj) is not None, obj["kind"]  # the model cache's claim stays
                cluster.kubectl("delete", obj["kind"].lower(), obj["metadata"]["name"], "-n", NAMESPACE)
            else:
                assert wait_for(f"{obj['kind']}/{obj['metadata']['name']} to go",
                                lambda o=obj: live(cluster, o) is None)
        history = json.loads(helm(cluster, "history", RELEASE, "-n", NAMESPACE, "-o", "json").stdout)
        assert [h["status"] for h in history] == ["superseded", "superseded", "deployed"]
    finally:
        helm(cluster, "uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout=60s")
    assert live(cluster, {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
                          "metadata": {"name": CRD_NAME}}) is not None


def test_the_chart_says_which_kubernetes_it_needs_and_this_server_meets_it(cluster):
    floor = yaml.safe_load((CHART / "Chart.yaml").read_text())["kubeVersion"]
    version = json.loads(cluster.get("/version"))
    assert version["gitVersion"] == "v1.20.2"
    assert floor == ">=1.20.0-0"  # the oldest API server these tests install the chart into
    refused = run([tool("helm"), "template", RELEASE, str(CHART), "--kube-version", "1.19.16"], check=False)
    assert refused.returncode != 0 and "kubeVersion" in refused.stderr, refused.stderr
