"""The operator on a real API server (tests/kube_cluster.py), with the chart's own credentials.

The chart is installed (its CRD, ServiceAccount and RBAC); `kopf run -m strata_operator` runs as a process with the
command, arguments and environment of the chart's operator Deployment, authenticated with a token of the chart's
ServiceAccount: a missing permission answers 403 and a test fails; the API server's audit log shows which
permissions were used, and a granted one that no test used fails the last test (surplus). Nodes are API objects
with the labels GPU Feature Discovery writes and the facts annotation of the chart's node-facts DaemonSet (no
kubelet here). No Pod ever runs: a test writes a Deployment's status as the Deployment controller would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import jsonschema
import pytest
import yaml

from autoconfig.node import node_patch
from tests.deploy_tools import CHART, run, tool
from tests.kube_cluster import ControlPlane, free_port
from tests.kube_cluster import wait_for as _wait_for
from tests.test_operator import (
    QWEN3_NEXT,
    V100,
    cluster_nodes,
    config_of,
    crd_schema,
    machine,
    resource,
)

REPO = Path(__file__).parents[1]
RELEASE = NAMESPACE = "strata"
ACCOUNT = f"system:serviceaccount:{NAMESPACE}:strata-operator"
TEAMS = [f"team-{c}" for c in "abcdefghij"]
CHART_VALUES = ["--set", "operator.env[0].name=STRATA_OPERATOR_RESYNC_SECONDS",
                "--set-string", "operator.env[0].value=0.5"]  # the timer's interval: seconds, not minutes


class Cluster:
    """The API server through the kubernetes client, as a user (the admin) or a controller would write to it."""

    def __init__(self, plane: ControlPlane):
        from kubernetes import client

        self.plane = plane
        self.client = plane.api_client()
        self.core, self.apps = client.CoreV1Api(self.client), client.AppsV1Api(self.client)
        self.networking = client.NetworkingV1Api(self.client)
        self.custom = client.CustomObjectsApi(self.client)

    def get(self, kind: str, namespace: str | None, name: str) -> dict | None:
        from kubernetes.client.exceptions import ApiException

        call = {"ConfigMap": lambda: self.core.read_namespaced_config_map(name, namespace, _preload_content=False),
                "Service": lambda: self.core.read_namespaced_service(name, namespace, _preload_content=False),
                "Deployment": lambda: self.apps.read_namespaced_deployment(name, namespace, _preload_content=False),
                "Ingress": lambda: self.networking.read_namespaced_ingress(name, namespace, _preload_content=False),
                "StrataDeployment": lambda: self.custom.get_namespaced_custom_object(
                    "strata.dev", "v1alpha1", namespace, "stratadeployments", name, _preload_content=False)}[kind]
        try:
            return json.loads(call().data)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def owned(self, kind: str, namespace: str, name: str) -> list[dict]:
        selector = f"app.kubernetes.io/instance={name},app.kubernetes.io/managed-by=strata-operator"
        call = {"ConfigMap": self.core.list_namespaced_config_map, "Service": self.core.list_namespaced_service,
                "Deployment": self.apps.list_namespaced_deployment,
                "Ingress": self.networking.list_namespaced_ingress}[kind]
        return json.loads(call(namespace, label_selector=selector, _preload_content=False).data)["items"]

    def create(self, body: dict) -> dict:
        body = json.loads(json.dumps(body))
        for server_side in ("uid", "generation"):  # the server stamps them
            body["metadata"].pop(server_side, None)
        return json.loads(self.custom.create_namespaced_custom_object(
            "strata.dev", "v1alpha1", body["metadata"]["namespace"], "stratadeployments", body,
            _preload_content=False).data)

    def delete(self, namespace: str, name: str, propagation: str | None = None) -> None:
        body = {"propagationPolicy": propagation} if propagation else None
        self.custom.delete_namespaced_custom_object("strata.dev", "v1alpha1", namespace, "stratadeployments", name,
                                                    body=body)

    def patch_spec(self, namespace: str, name: str, spec: dict) -> None:
        self.custom.patch_namespaced_custom_object("strata.dev", "v1alpha1", namespace, "stratadeployments", name,
                                                   {"spec": spec}, _content_type="application/merge-patch+json")

    def status(self, namespace: str, name: str) -> dict:
        return (self.get("StrataDeployment", namespace, name) or {}).get("status") or {}

    def condition(self, namespace: str, name: str, kind: str) -> dict:
        return {c["type"]: c for c in self.status(namespace, name).get("conditions") or []}.get(kind) or {}

    def roll_out(self, namespace: str, name: str) -> None:
        """Do what the Deployment controller would once the kubelets ran the pods: every replica updated, ready."""
        for d in self.owned("Deployment", namespace, name):
            n = d["spec"]["replicas"]
            status = dict(observedGeneration=d["metadata"]["generation"], replicas=n, updatedReplicas=n,
                          readyReplicas=n, availableReplicas=n)
            self.apps.patch_namespaced_deployment_status(d["metadata"]["name"], namespace, {"status": status},
                                                         _content_type="application/merge-patch+json")

    def configs(self, namespace: str, name: str) -> dict[str, str]:
        """Deployment name -> the config hash in its pod template."""
        from strata_operator import builders

        return {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["annotations"][builders.CONFIG_HASH]
                for d in self.owned("Deployment", namespace, name)}

    def events(self, namespace: str, reason: str) -> list[dict]:
        items = json.loads(self.core.list_namespaced_event(namespace, _preload_content=False).data)["items"]
        return [e for e in items if e.get("reason") == reason]


class Operator:
    """`kopf run -m strata_operator` as the chart runs it, as its own process: started, stopped, restarted."""

    def __init__(self, plane: ControlPlane, kubeconfig: Path, deployment: dict, log: Path):
        container = deployment["spec"]["template"]["spec"]["containers"][0]
        self.port = free_port()
        command = [a for a in container["command"] if not a.startswith("--liveness=")]
        assert command[:2] == ["kopf", "run"], command
        self.args = [sys.executable, "-m", "kopf", *command[1:], f"--liveness=http://127.0.0.1:{self.port}/healthz"]
        env = {k: v for k, v in os.environ.items() if k not in ("KUBERNETES_SERVICE_HOST", "KUBERNETES_SERVICE_PORT")}
        for var in container["env"]:
            if "value" in var:
                env[var["name"]] = var["value"]
            elif var["valueFrom"].get("fieldRef", {}).get("fieldPath") == "metadata.namespace":
                env[var["name"]] = deployment["metadata"]["namespace"]
        env["KUBECONFIG"] = str(kubeconfig)
        env["PYTHONPATH"] = os.pathsep.join([str(REPO / "operator"), str(REPO), env.get("PYTHONPATH", "")])
        self.env, self.log, self.process = env, log, None
        self.liveness = f"http://127.0.0.1:{self.port}/healthz"

    def start(self) -> None:
        _running[:] = [self]
        out = open(self.log, "ab")  # noqa: SIM115 - the process holds it
        self.process = subprocess.Popen(self.args, env=self.env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
        wait_for("the operator's liveness endpoint", lambda: self._alive() or self._exited(), timeout=60)

    def stop(self) -> None:
        if self.process and self.process.poll() is None:
            self.process.terminate()  # kopf stops its handlers and exits
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()

    def _alive(self) -> bool:
        return _get(self.liveness) is not None

    def _exited(self) -> bool:
        if self.process.poll() is not None:
            pytest.fail(f"the operator exited {self.process.returncode}:\n{self.log_tail()}", pytrace=False)
        return False

    def log_tail(self, lines: int = 60) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])


_running: list[Operator] = []  # the operator process now running, whose log a failed wait shows


def wait_for(what: str, check, timeout: float = 20.0, every: float = 0.1):
    """`kube_cluster.wait_for`, and on a timeout the running operator's last log lines."""
    try:
        return _wait_for(what, check, timeout, every)
    except pytest.fail.Exception as e:
        tail = _running[-1].log_tail(40) if _running else "(no operator running)"
        pytest.fail(f"{e}\n--- the operator's log ---\n{tail}", pytrace=False)


def _get(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return json.loads(response.read() or b"{}") if response.status == 200 else None
    except OSError:
        return None


@pytest.fixture(scope="module")
def installed(kube: ControlPlane, tmp_path_factory):
    """The chart with its defaults (CRD, operator ServiceAccount and RBAC), nodes of two hardware profiles and a node
    without facts, the teams' namespaces; the operator not yet started."""
    helm = [tool("helm"), f"--kubeconfig={kube.admin_kubeconfig}"]
    run([*helm, "install", RELEASE, str(CHART), "-n", NAMESPACE, "--create-namespace", *CHART_VALUES], timeout=120)
    cluster = Cluster(kube)
    for body in cluster_nodes():
        name = body["metadata"]["name"]
        cluster.core.create_node(body)
        # what the kubelet and the node lifecycle controller do once a node is up: Ready, and the not-ready taint
        # that the API server's admission put on the new node removed
        cluster.core.patch_node_status(name, {"status": {"conditions": [
            {"type": "Ready", "status": "True", "reason": "KubeletReady", "message": "kubelet is posting ready status"}]}})
        cluster.core.patch_node(name, {"spec": {"taints": None}})
    for team in TEAMS:
        kube.ensure_namespace(team)
    kube.kubectl("wait", "--for=condition=Established", "--timeout=30s", "crd/stratadeployments.strata.dev")
    try:
        yield cluster
    finally:
        run([*helm, "uninstall", RELEASE, "-n", NAMESPACE, "--wait", "--timeout=60s"], timeout=120)
        for team in TEAMS:
            kube.kubectl("delete", "namespace", team, "--wait=false", check=False)
        for body in cluster_nodes():
            kube.kubectl("delete", "node", body["metadata"]["name"], check=False)


@pytest.fixture(scope="module")
def operator(kube: ControlPlane, installed: Cluster, tmp_path_factory):
    folder = tmp_path_factory.mktemp("operator")
    token = kube.service_account_token(NAMESPACE, "strata-operator")
    kubeconfig = kube.kubeconfig_for(token, folder / "kubeconfig", "strata-operator")
    deployment = json.loads(installed.apps.read_namespaced_deployment("strata-operator", NAMESPACE,
                                                                     _preload_content=False).data)
    op = Operator(kube, kubeconfig, deployment, folder / "kopf.log")
    op.start()
    installed.operator = op
    try:
        yield installed
    finally:
        op.stop()


@pytest.fixture()
def deployed(operator: Cluster):
    """Create StrataDeployments; they are deleted after the test (fewer timers for the next)."""
    made = []

    def create(body: dict) -> dict:
        made.append((body["metadata"]["namespace"], body["metadata"]["name"]))
        return operator.create(body)

    yield create
    for ns, name in made:
        if operator.get("StrataDeployment", ns, name) is not None:
            operator.delete(ns, name)
    for ns, name in made:
        wait_for(f"{ns}/{name} to go", lambda ns=ns, name=name: operator.get("StrataDeployment", ns, name) is None)


def test_a_resource_gets_adopted_children_per_profile_and_becomes_ready(operator, deployed):
    ns, name = "team-a", "chat"
    created = deployed(resource(name, ns, replicas=3, servedModelName="chat",
                                autoconfig={"expectedConcurrency": 4}))
    uid = created["metadata"]["uid"]
    wait_for("two Deployments", lambda: len(operator.owned("Deployment", ns, name)) == 2)
    deployments = {d["metadata"]["name"]: d for d in operator.owned("Deployment", ns, name)}
    assert {n: d["spec"]["replicas"] for n, d in deployments.items()} == {
        "chat-nvidia-h200-x1": 1, "chat-tesla-v100-pcie-16gb-x4": 2}
    configmaps = wait_for("two ConfigMaps", lambda: (cms := operator.owned("ConfigMap", ns, name)) and
                          len(cms) == 2 and cms)
    service = wait_for("the Service", lambda: operator.get("Service", ns, name))
    for child in [*deployments.values(), *configmaps, service]:
        (ref,) = child["metadata"]["ownerReferences"]
        assert (ref["apiVersion"], ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "strata.dev/v1alpha1", "StrataDeployment", name, uid, True)
    config = config_of(operator.get("ConfigMap", ns, "chat-nvidia-h200-x1"))
    assert (config["device"], config["batch"], config["served_model_name"]) == ("cuda:0", 4, "chat")
    c = deployments["chat-nvidia-h200-x1"]["spec"]["template"]["spec"]["containers"][0]
    assert c["image"] == "strata:0.1.0"  # the chart's image, passed down as STRATA_OPERATOR_IMAGE

    status = wait_for("the status", lambda: operator.status(ns, name).get("profiles") and operator.status(ns, name))
    assert status["selector"] == ("app.kubernetes.io/component=server,app.kubernetes.io/instance=chat,"
                                  "app.kubernetes.io/managed-by=strata-operator,app.kubernetes.io/name=strata")
    assert status["observedGeneration"] == 1
    h200 = status["profiles"][0]
    assert h200["name"] == "nvidia-h200-x1" and h200["nodes"] == ["h200-a", "h200-b"]
    assert h200["settings"]["batch"] == 4 and any(r.startswith("batch 4: one slot per") for r in h200["reasons"])
    assert operator.condition(ns, name, "Progressing")["status"] == "True"
    assert operator.condition(ns, name, "Ready")["status"] == "False"
    jsonschema.validate(status, crd_schema()["properties"]["status"])

    operator.roll_out(ns, name)
    wait_for("Ready", lambda: operator.condition(ns, name, "Ready").get("status") == "True")
    status = operator.status(ns, name)
    assert (status["replicas"], status["readyReplicas"]) == (3, 3)
    assert operator.condition(ns, name, "Progressing")["reason"] == "Complete"
    printed = operator.plane.kubectl("get", "stratadeployment", name, "-n", ns).stdout  # the CRD's columns
    assert printed.split("\n")[1].split()[:4] == [name, "default", "3", "3"], printed


def test_scaling_through_the_scale_subresource_changes_replicas_and_rolls_nothing(operator, deployed):
    ns, name = "team-b", "scaled"
    deployed(resource(name, ns, replicas=1))
    wait_for("the Deployments", lambda: len(operator.owned("Deployment", ns, name)) == 2)
    hashes = operator.configs(ns, name)
    operator.plane.kubectl("scale", "stratadeployment", name, "-n", ns, "--replicas=6")
    wait_for("6 replicas over the Deployments",
             lambda: sum(d["spec"]["replicas"] for d in operator.owned("Deployment", ns, name)) == 6)
    assert operator.configs(ns, name) == hashes
    operator.roll_out(ns, name)
    scale = wait_for("the scale status", lambda: (s := json.loads(operator.custom.get_namespaced_custom_object_scale(
        "strata.dev", "v1alpha1", ns, "stratadeployments", name, _preload_content=False).data))["status"].get(
        "replicas") == 6 and s)
    assert scale["spec"]["replicas"] == 6 and "app.kubernetes.io/instance=scaled" in scale["status"]["selector"]


def test_a_spec_change_rolls_the_workloads(operator, deployed):
    ns, name = "team-c", "rolled"
    deployed(resource(name, ns, autoconfig={"expectedConcurrency": 4}))
    before = wait_for("the Deployments", lambda: len(h := operator.configs(ns, name)) == 2 and h)
    operator.patch_spec(ns, name, {"autoconfig": {"expectedConcurrency": 8}})
    after = wait_for("new pod templates", lambda: (h := operator.configs(ns, name)) and
                     all(h[k] != before[k] for k in before) and h)
    assert set(after) == set(before)
    assert config_of(operator.get("ConfigMap", ns, f"{name}-nvidia-h200-x1"))["batch"] == 8
    wait_for("observedGeneration 2", lambda: operator.status(ns, name).get("observedGeneration") == 2)


def test_a_change_of_node_facts_rolls_the_profile_it_changes(operator, deployed):
    ns, name = "team-d", "facts"
    # many conversations: on a 16 GB V100 the batch is capped by the memory left, on an H200 it is not
    deployed(resource(name, ns, autoconfig={"expectedConcurrency": 200}))
    before = wait_for("the Deployments", lambda: len(h := operator.configs(ns, name)) == 2 and h)
    busy = machine("4x16gb-gen3-x8")
    for g in busy.gpus:
        g.vram_free_bytes //= 2  # another process took half of every card
    operator.core.patch_node("v100-a", node_patch(busy))
    v100, h200 = f"{name}-tesla-v100-pcie-16gb-x4", f"{name}-nvidia-h200-x1"
    try:
        after = wait_for("the V100 profile's new pod template", lambda: (h := operator.configs(ns, name)) and
                         h.get(v100) != before[v100] and h)
        assert after[h200] == before[h200]
        assert config_of(operator.get("ConfigMap", ns, v100))["batch"] < 200
    finally:
        operator.core.patch_node("v100-a", node_patch(machine("4x16gb-gen3-x8")))


def test_an_impossible_spec_is_degraded_and_creates_nothing(operator, deployed):
    ns, name = "team-e", "huge"
    deployed(resource(name, ns, model="Qwen3-Next-80B-A3B", modelFacts=QWEN3_NEXT,
                      nodeSelector={"nvidia.com/gpu.product": V100}))
    degraded = wait_for("Degraded", lambda: (c := operator.condition(ns, name, "Degraded")).get("status") == "True"
                        and c)
    assert degraded["reason"] == "DoesNotFit" and "does not fit this machine" in degraded["message"]
    assert operator.condition(ns, name, "Ready")["status"] == "False"
    for kind in ("Deployment", "ConfigMap", "Service"):
        assert operator.owned(kind, ns, name) == []
    events = wait_for("a Warning event", lambda: operator.events(ns, "DoesNotFit"))
    assert events[0]["type"] == "Warning" and events[0]["involvedObject"]["name"] == name


def test_session_affinity_is_applied_to_the_service_and_removed_again(operator, deployed):
    ns, name = "team-g", "sticky"
    deployed(resource(name, ns, service={"sessionAffinity": "ClientIP", "sessionAffinityTimeoutSeconds": 900}))
    pinned = wait_for("a ClientIP Service", lambda: (s := operator.get("Service", ns, name)) and
                      s["spec"].get("sessionAffinity") == "ClientIP" and s)
    assert pinned["spec"]["sessionAffinityConfig"] == {"clientIP": {"timeoutSeconds": 900}}
    operator.patch_spec(ns, name, {"service": {"sessionAffinity": "None"}})
    # the API server refuses sessionAffinityConfig beside None: the operator removes it, not only changes the kind
    plain = wait_for("the affinity off", lambda: (s := operator.get("Service", ns, name)) and
                     s["spec"]["sessionAffinity"] == "None" and s)
    assert "sessionAffinityConfig" not in plain["spec"]


def test_the_ingress_is_made_patched_and_deleted_with_the_spec(operator, deployed):
    """spec.ingress on: an owned Ingress to the Service, hashing the session header; the affinity back to none and
    the TLS dropped: both gone from the live Ingress; ingress off: the Ingress deleted, the Service kept."""
    ns, name = "team-g", "routed"
    created = deployed(resource(name, ns, ingress={
        "enabled": True, "className": "nginx", "host": "llm.example.com", "affinity": "header",
        "tls": [{"secretName": "routed-tls", "hosts": ["llm.example.com"]}]}))
    ingress = wait_for("the Ingress", lambda: operator.get("Ingress", ns, name))
    (ref,) = ingress["metadata"]["ownerReferences"]
    assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
        "StrataDeployment", name, created["metadata"]["uid"], True)
    assert ingress["metadata"]["annotations"] == {"nginx.ingress.kubernetes.io/upstream-hash-by": "$http_x_session_id"}
    assert ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["spec"]["tls"] == [{"secretName": "routed-tls", "hosts": ["llm.example.com"]}]
    (rule,) = ingress["spec"]["rules"]
    service = wait_for("the Service", lambda: operator.get("Service", ns, name))
    (port,) = service["spec"]["ports"]
    assert rule["host"] == "llm.example.com"
    assert rule["http"]["paths"] == [{"path": "/", "pathType": "Prefix", "backend": {"service": {
        "name": service["metadata"]["name"], "port": {"name": port["name"]}}}}]

    operator.patch_spec(ns, name, {"ingress": {"sessionHeader": "X-Chat-Id"}})
    wait_for("the new hash", lambda: (i := operator.get("Ingress", ns, name)) and i["metadata"].get(
        "annotations", {}).get("nginx.ingress.kubernetes.io/upstream-hash-by") == "$http_x_chat_id")
    operator.patch_spec(ns, name, {"ingress": {"affinity": "none", "tls": None}})
    plain = wait_for("the hash and the TLS gone", lambda: (i := operator.get("Ingress", ns, name)) and
                     "nginx.ingress.kubernetes.io/upstream-hash-by" not in (i["metadata"].get("annotations") or {})
                     and "tls" not in i["spec"] and i)
    assert plain["spec"]["ingressClassName"] == "nginx"

    operator.patch_spec(ns, name, {"ingress": {"enabled": False}})
    wait_for("the Ingress deleted", lambda: operator.get("Ingress", ns, name) is None)
    assert operator.owned("Ingress", ns, name) == [] and operator.get("Service", ns, name) is not None


@pytest.mark.parametrize("spec, field", [
    ({"model": "default", "replicas": -1}, "spec.replicas"),
    ({"model": "default", "service": {"sessionAffinity": "Cookie"}}, "spec.service.sessionAffinity"),
    ({"replicas": 1}, "spec.model"),
    ({"model": "default", "autoconfig": {"expectedConcurrency": "many"}}, "spec.autoconfig.expectedConcurrency"),
    ({"model": "default", "ingress": {"sessionHeader": "X_Session_Id"}}, "spec.ingress.sessionHeader"),
])
def test_an_invalid_resource_is_refused_by_the_servers_schema_naming_the_field(operator, spec, field):
    body = {"apiVersion": "strata.dev/v1alpha1", "kind": "StrataDeployment",
            "metadata": {"name": "invalid", "namespace": "team-h"}, "spec": spec}
    # --validate=false: no check in kubectl, so the answer is the API server's own
    refused = operator.plane.kubectl("create", "--validate=false", "-f", "-", stdin=yaml.safe_dump(body), check=False)
    assert refused.returncode != 0
    assert "is invalid" in refused.stderr and field in refused.stderr, refused.stderr
    assert operator.get("StrataDeployment", "team-h", "invalid") is None


def test_deleting_a_resource_removes_its_children_and_its_finalizer(operator):
    ns, name = "team-f", "gone"
    operator.create(resource(name, ns, ingress={"enabled": True}))
    wait_for("the children", lambda: len(operator.owned("Deployment", ns, name)) == 2 and
             operator.get("Service", ns, name) and operator.get("Ingress", ns, name))
    finalizers = wait_for("the finalizer", lambda: operator.get("StrataDeployment", ns, name)["metadata"].get(
        "finalizers"))
    assert "strata.dev/operator" in finalizers
    operator.delete(ns, name)
    wait_for("the resource to go", lambda: operator.get("StrataDeployment", ns, name) is None)
    for kind in ("Deployment", "ConfigMap", "Service", "Ingress"):
        assert operator.owned(kind, ns, name) == []


def test_deleting_with_orphan_propagation_leaves_the_children_unowned(operator):
    ns, name = "team-f", "orphans"
    operator.create(resource(name, ns))
    wait_for("the children", lambda: len(operator.owned("Deployment", ns, name)) == 2 and
             operator.get("Service", ns, name))
    operator.delete(ns, name, propagation="Orphan")  # kubectl delete --cascade=orphan
    wait_for("the resource to go", lambda: operator.get("StrataDeployment", ns, name) is None)
    # the garbage collector removed the owner references; the operator deleted nothing
    left = wait_for("unowned children", lambda: (ds := operator.owned("Deployment", ns, name)) and all(
        not d["metadata"].get("ownerReferences") for d in ds) and ds)
    assert len(left) == 2 and operator.get("Service", ns, name) is not None
    for d in left:
        operator.apps.delete_namespaced_deployment(d["metadata"]["name"], ns)
    for cm in operator.owned("ConfigMap", ns, name):
        operator.core.delete_namespaced_config_map(cm["metadata"]["name"], ns)
    operator.core.delete_namespaced_service(name, ns)


def test_an_operator_restarted_mid_way_resumes_without_duplicates(operator, deployed):
    ns, name, late = "team-i", "resumed", "while-down"
    deployed(resource(name, ns, autoconfig={"expectedConcurrency": 4}))
    before = wait_for("the Deployments", lambda: len(h := operator.configs(ns, name)) == 2 and h)
    operator.operator.stop()
    try:
        operator.patch_spec(ns, name, {"autoconfig": {"expectedConcurrency": 8}})
        deployed(resource(late, ns))
        time.sleep(1)
        assert operator.configs(ns, name) == before and operator.owned("Deployment", ns, late) == []
    finally:
        operator.operator.start()
    after = wait_for("the change made while it was down", lambda: (h := operator.configs(ns, name)) and
                     all(h[k] != before[k] for k in before) and h)
    assert set(after) == set(before)
    wait_for("the resource created while it was down", lambda: len(operator.owned("Deployment", ns, late)) == 2)
    wait_for("observedGeneration 2", lambda: operator.status(ns, name).get("observedGeneration") == 2)
    time.sleep(2)  # a few timer rounds: nothing made twice
    for n in (name, late):
        for kind, count in (("Deployment", 2), ("ConfigMap", 2), ("Service", 1)):
            assert len(operator.owned(kind, ns, n)) == count, (n, kind)


def test_without_the_operator_the_garbage_collector_deletes_the_children(operator):
    """An operator uninstalled while resources remain: their finalizer removed by hand, deleting one leaves the
    children to the garbage collector, which follows the owner references the operator wrote."""
    ns, name = "team-j", "collected"
    operator.create(resource(name, ns, ingress={"enabled": True}))
    wait_for("the children", lambda: len(operator.owned("Deployment", ns, name)) == 2 and
             operator.get("Service", ns, name) and operator.get("Ingress", ns, name) and
             "strata.dev/operator" in (operator.get("StrataDeployment", ns, name)["metadata"].get("finalizers") or []))
    operator.operator.stop()
    try:
        operator.custom.patch_namespaced_custom_object(
            "strata.dev", "v1alpha1", ns, "stratadeployments", name, {"metadata": {"finalizers": None}},
            _content_type="application/merge-patch+json")
        operator.delete(ns, name)
        wait_for("the resource to go", lambda: operator.get("StrataDeployment", ns, name) is None)
        for kind in ("Deployment", "ConfigMap", "Service", "Ingress"):
            wait_for(f"the garbage collector to delete the {kind}s", lambda k=kind: operator.owned(k, ns, name) == [],
                     timeout=60, every=0.5)
    finally:
        operator.operator.start()


def test_a_conflict_on_create_is_resolved_by_patching_what_is_there(operator):
    """Another writer makes the child between the operator's read and its create: the server answers 409
    AlreadyExists and `Kube.apply` patches the object that is there."""
    from strata_operator.kube import Kube

    ns = "team-h"
    wanted = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "raced", "namespace": ns},
              "data": {"config.json": "{}"}}
    operator.core.create_namespaced_config_map(ns, {"metadata": {"name": "raced"}, "data": {"other": "1"}})

    class Racing(Kube):
        misses = 1

        def read(self, kind, namespace, name):
            if self.misses:
                self.misses -= 1
                return None  # read before the other writer's create landed
            return super().read(kind, namespace, name)

    live, action = Racing(operator.plane.api_client()).apply(wanted)
    assert action == "patched" and live["data"] == {"other": "1", "config.json": "{}"}
    operator.core.delete_namespaced_config_map("raced", ns)


def test_liveness_endpoint_reports_the_indexed_nodes(operator):
    # kopf caches the probes' results for 10 s
    assert wait_for("the node probe", lambda: (_get(operator.operator.liveness) or {}).get("nodes") == 4 and 4,
                    timeout=15) == 4


def test_the_operator_used_exactly_the_permissions_the_chart_grants(operator, kube):
    """Runs last: every request the operator made in this module was allowed (no 403), and every permission the
    chart grants it was used by some request (no surplus), per API group, resource and verb."""
    requests = kube.requests_of(ACCOUNT)
    assert requests, "no audited request of the operator's account"
    denied = sorted({_permission(e) for e in requests if e["responseStatus"]["code"] == 403})
    assert not denied, f"the chart's RBAC denies the operator: {denied}\n{operator.operator.log_tail()}"
    used = {_permission(e) for e in requests if "objectRef" in e}
    granted = _granted(operator)
    assert granted - used == set(), f"granted, never used: {sorted(granted - used)}"


def test_an_operator_watching_some_namespaces_works_there_with_what_the_chart_grants_for_it(operator, kube):
    """`operator.watchNamespaces`: the chart binds the workloads role in those namespaces only and runs kopf with
    `--namespace` for each. Upgraded to that, the operator serves a resource there, ignores one elsewhere, is never
    denied, and uses the namespaces rule that configuration adds."""
    helm = [tool("helm"), f"--kubeconfig={kube.admin_kubeconfig}"]
    run([*helm, "upgrade", RELEASE, str(CHART), "-n", NAMESPACE, *CHART_VALUES,
         "--set", "operator.watchNamespaces={team-a,team-b}"], timeout=120)
    old = operator.operator
    old.stop()
    deployment = json.loads(operator.apps.read_namespaced_deployment("strata-operator", NAMESPACE,
                                                                     _preload_content=False).data)
    assert "--namespace=team-a" in deployment["spec"]["template"]["spec"]["containers"][0]["command"]
    token = kube.service_account_token(NAMESPACE, "strata-operator")
    kubeconfig = kube.kubeconfig_for(token, old.log.parent / "kubeconfig-namespaced", "strata-operator")
    operator.operator = Operator(kube, kubeconfig, deployment, old.log.parent / "kopf-namespaced.log")
    since = len(kube.requests_of(ACCOUNT))
    operator.operator.start()
    try:
        operator.create(resource("watched", "team-a"))
        operator.create(resource("elsewhere", "team-c"))
        wait_for("the children in a watched namespace", lambda: len(operator.owned("Deployment", "team-a",
                                                                                   "watched")) == 2)
        operator.delete("team-a", "watched")
        wait_for("the resource to go", lambda: operator.get("StrataDeployment", "team-a", "watched") is None)
        assert operator.owned("Deployment", "team-c", "elsewhere") == []
        assert not (operator.get("StrataDeployment", "team-c", "elsewhere")["metadata"].get("finalizers"))
        operator.delete("team-c", "elsewhere")
    finally:
        operator.operator.stop()
    requests = kube.requests_of(ACCOUNT)[since:]
    denied = sorted({_permission(e) for e in requests if e["responseStatus"]["code"] == 403})
    assert not denied, f"the chart's RBAC denies the operator: {denied}\n{operator.operator.log_tail()}"
    # the rule this configuration adds (the workloads' rules were all used above, in every namespace)
    used = {_permission(e) for e in requests if "objectRef" in e}
    assert {("", "namespaces", "list"), ("", "namespaces", "watch")} <= used & _granted(operator)


def _permission(event: dict) -> tuple[str, str, str]:
    ref = event.get("objectRef") or {}
    resource = ref.get("resource", event.get("requestURI", ""))
    if ref.get("subresource"):
        resource += "/" + ref["subresource"]
    return ref.get("apiGroup", ""), resource, event["verb"]


def _granted(cluster: Cluster) -> set[tuple[str, str, str]]:
    """What the chart's ClusterRoles bound to the operator's account allow, as (group, resource, verb)."""
    from kubernetes import client

    rbac = client.RbacAuthorizationV1Api(cluster.client)
    roles = set()
    bindings = rbac.list_cluster_role_binding().items + rbac.list_role_binding_for_all_namespaces().items
    for binding in bindings:
        if any(s.kind == "ServiceAccount" and s.name == "strata-operator" and s.namespace == NAMESPACE
               for s in binding.subjects or []):
            assert binding.role_ref.kind == "ClusterRole"
            roles.add(binding.role_ref.name)
    out = set()
    for role in roles:
        for rule in rbac.read_cluster_role(role).rules or []:
            for group in rule.api_groups or [""]:
                for name in rule.resources or []:
                    for verb in rule.verbs:
                        out.add((group, name, verb))
    return out
