"""The operator (operator/strata_operator, docs/OPERATOR.md).

Unit tests call the pure parts directly: facts in, manifests out, every manifest validated against the Kubernetes
schemas (kubernetes-validate) and the status against the CRD's. The operator's life on a real API server is
tests/test_kube_operator.py; here kopf runs (KopfRunner) against kmock's emulated API server
(tests/kmock_emulator.py) only for what a real server does not do on demand: fail (injected API faults), or hand
the operator a resource its schema would have refused.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.filterwarnings("ignore:read_binary is deprecated:DeprecationWarning")  # kmock 0.8's

REPO = Path(__file__).parents[1]
DATA = REPO / "tests" / "data"
os.environ.setdefault("STRATA_OPERATOR_RESYNC_SECONDS", "0.5")  # the timer's interval, read when kopf imports it
try:
    import strata_operator  # noqa: F401
except ImportError:  # not installed: the package lives in operator/
    sys.path.insert(0, str(REPO / "operator"))

try:
    import jsonschema
    import kmock
    import kopf  # noqa: F401
    import kubernetes
    import kubernetes_validate  # noqa: F401 - tests.deploy_tools.validate_k8s uses it
except ImportError as e:  # never a skip: the operator tests need their packages
    raise ImportError(f"{e}: run .ci/install-operator-deps (and .ci/install-deploy-tools)") from e

from autoconfig.facts import Facts, MachineFacts, load_facts, read_model  # noqa: E402
from autoconfig.node import node_patch  # noqa: E402
from autoconfig.rules import Wishes, propose  # noqa: E402
from strata_operator import builders  # noqa: E402
from strata_operator.modelfacts import smollm2_135m  # noqa: E402
from strata_operator.plan import plan  # noqa: E402
from strata_operator.profiles import distribute, node_view, profiles, quantity  # noqa: E402
from strata_operator.spec import Spec, StrataDeployment  # noqa: E402
from strata_operator.status import build_status  # noqa: E402
from tests.deploy_tools import by_kind, helm_template, validate_k8s  # noqa: E402
from tests.kmock_emulator import ApiServer  # noqa: E402

CRD = REPO / "helm" / "strata" / "templates" / "crd-stratadeployment.yaml"
H200, V100 = "NVIDIA-H200", "Tesla-V100-PCIE-16GB"
QWEN3_NEXT = json.loads((DATA / "model-qwen3-next-80b-a3b.json").read_text())


def machine(name: str) -> MachineFacts:
    return load_facts(DATA / f"machine-{name}.json")


def node(name: str, facts: MachineFacts | None, product: str | None, *, memory: str = "256Gi", cpu: str = "32",
         **spec) -> dict:
    """A node as GPU Feature Discovery, the node-facts DaemonSet and the kubelet leave it."""
    labels = {"kubernetes.io/hostname": name}
    allocatable = {"cpu": cpu, "memory": memory}
    if product:
        gpus = len(facts.gpus) if facts else 1
        memory_mib = str(facts.gpus[0].vram_total_bytes // 2**20) if facts else "16384"
        labels.update({"nvidia.com/gpu.present": "true", "nvidia.com/gpu.product": product,
                       "nvidia.com/gpu.count": str(gpus), "nvidia.com/gpu.memory": memory_mib})
        allocatable["nvidia.com/gpu"] = str(gpus)
    meta = {"name": name, "labels": labels}
    if facts is not None:
        meta.update(node_patch(facts)["metadata"])
    return {"apiVersion": "v1", "kind": "Node", "metadata": meta, "spec": spec, "status": {"allocatable": allocatable}}


def cluster_nodes() -> list[dict]:
    """Two hardware profiles (one H200 per node; four V100s per node, one in a x8 slot), and a node without facts."""
    return [node("h200-a", machine("1xh200"), H200), node("h200-b", machine("1xh200"), H200),
            node("v100-a", machine("4x16gb-gen3-x8"), V100, memory="64Gi", cpu="16"),
            node("fresh", None, H200)]


def resource(name: str = "chat", namespace: str = "llm", **spec) -> dict:
    spec.setdefault("model", "default")
    return {"apiVersion": "strata.dev/v1alpha1", "kind": "StrataDeployment",
            "metadata": {"name": name, "namespace": namespace, "uid": f"uid-{name}", "generation": 1}, "spec": spec}


def sd(**spec) -> StrataDeployment:
    return StrataDeployment.from_body(resource(**spec))


def views(bodies: list[dict] | None = None):
    return [node_view(b) for b in (bodies or cluster_nodes())]


def crd_schema() -> dict:
    """The CRD's openAPIV3Schema, read from the chart's template (its few template lines dropped)."""
    text = "\n".join(line for line in CRD.read_text().splitlines() if "{{" not in line)
    return yaml.safe_load(text)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


def children(resource_: StrataDeployment, nodes=None) -> list[dict]:
    """What the operator would apply for `resource_` on `nodes`."""
    the_plan = plan(resource_, views(nodes))
    out = []
    for p in the_plan.serving:
        cm = builders.build_configmap(resource_, p.profile, p.proposal)
        out += [cm, builders.build_deployment(resource_, p.profile, p.proposal, cm, default_image="strata:0.1.0")]
    out.append(builders.build_service(resource_))
    if resource_.spec.ingress.enabled:
        out.append(builders.build_ingress(resource_))
    return out


def config_of(configmap: dict) -> dict:
    return json.loads(configmap["data"][builders.CONFIG_FILE])


# ---------------------------------------------------------------------------------------------- the resource


def test_built_in_facts_of_the_default_model_are_what_read_model_reads():
    assert smollm2_135m() == read_model("default")


def test_spec_defaults_are_the_crds():
    props = crd_schema()["properties"]["spec"]["properties"]
    spec = Spec.model_validate({"model": "default"})
    assert spec.replicas == props["replicas"]["default"] == 1
    assert spec.gpus_per_replica == props["gpusPerReplica"]["default"] == 1
    assert spec.autoconfig.enabled is props["autoconfig"]["properties"]["enabled"]["default"] is True
    assert spec.storage.mount_path == props["storage"]["properties"]["mountPath"]["default"] == "/models"
    assert spec.service.type == props["service"]["properties"]["type"]["default"]
    assert spec.service.port == props["service"]["properties"]["port"]["default"] == 8000
    service = props["service"]["properties"]
    assert spec.service.session_affinity == service["sessionAffinity"]["default"] == "None"
    assert spec.service.session_affinity_timeout_seconds == service["sessionAffinityTimeoutSeconds"]["default"] == 10800
    assert spec.monitoring.enabled is props["monitoring"]["properties"]["enabled"]["default"] is True
    ingress = props["ingress"]["properties"]
    assert spec.ingress.enabled is ingress["enabled"]["default"] is False
    assert spec.ingress.path == ingress["path"]["default"] == "/"
    assert spec.ingress.affinity == ingress["affinity"]["default"] == "none"
    assert spec.ingress.session_header == ingress["sessionHeader"]["default"] == "X-Session-Id"
    assert set(ingress) == {f.alias for f in type(spec.ingress).model_fields.values()}
    assert all(node.get("description") for node in ingress.values()), "every ingress field is described"
    # every field of the CRD's spec is read (and modelFacts, which the operator adds: docs/OPERATOR.md)
    assert set(props) <= {f.alias for f in Spec.model_fields.values()}


@pytest.mark.parametrize("model, path", [("default", "default"), ("Qwen3-30B-A3B", "/models/Qwen3-30B-A3B"),
                                         ("/srv/m.gguf", "/srv/m.gguf")])
def test_model_path(model, path):
    assert Spec(model=model).model_path == path


# ---------------------------------------------------------------------------------------------- profiles


def test_alike_nodes_make_one_profile_pinned_by_their_gfd_labels():
    found, skipped = profiles(views(), Spec(model="default"))
    assert [p.name for p in found] == ["nvidia-h200-x1", "tesla-v100-pcie-16gb-x4"]
    h200, v100 = found
    assert h200.nodes == ["h200-a", "h200-b"] and h200.slots == 2
    assert v100.nodes == ["v100-a"] and v100.slots == 4
    assert h200.node_term == {"matchExpressions": [
        {"key": "nvidia.com/gpu.product", "operator": "In", "values": [H200]},
        {"key": "nvidia.com/gpu.count", "operator": "In", "values": ["1"]},
        {"key": "nvidia.com/gpu.memory", "operator": "In", "values": ["143771"]}]}
    assert "no strata.dev/facts annotation" in skipped["fresh"]
    # a replica's share of a V100 node: one GPU (the one with the least free memory), a quarter of RAM and cores
    share = v100.machine
    assert [g.index for g in share.gpus] == [0] and share.gpus[0].vram_free_bytes == 16302211072
    assert share.host.ram_total_bytes == 16 * 2**30 and share.host.cpu_cores == 4


def test_nodes_whose_labels_do_not_tell_them_apart_are_pinned_by_name():
    slow = machine("1xh200")
    slow.gpus[0].pcie_width = 8  # the same GPU in a x8 slot: GFD's labels are the same, the facts are not
    nodes = [node("fast", machine("1xh200"), H200), node("slow", slow, H200)]
    found, _ = profiles(views(nodes), Spec(model="default"))
    assert len(found) == 2 and all(re.fullmatch(r"nvidia-h200-x1-[0-9a-f]{5}", p.name) for p in found)
    assert {p.node_term["matchFields"][0]["values"][0] for p in found} == {"fast", "slow"}


def test_nodes_that_cannot_run_a_replica_are_left_out_with_the_reason():
    taint = {"key": "dedicated", "value": "batch", "effect": "NoSchedule"}
    nodes = [node("cordoned", machine("1xh200"), H200, unschedulable=True),
             node("tainted", machine("1xh200"), H200, taints=[taint]),
             node("small", machine("1xh200"), H200), node("cpu", None, None)]
    spec = Spec(model="default", gpus_per_replica=2, node_selector={"nvidia.com/gpu.present": "true"})
    found, skipped = profiles(views(nodes), spec)
    assert found == []
    assert skipped == {"cordoned": "cordoned", "cpu": "nodeSelector: nvidia.com/gpu.present=true does not match",
                       "small": "1 GPU(s), fewer than gpusPerReplica 2",
                       "tainted": "taint dedicated=batch:NoSchedule is not tolerated"}
    tolerant = spec.model_copy(update={"gpus_per_replica": 1, "tolerations": [
        {"key": "dedicated", "operator": "Exists", "effect": "NoSchedule"}]})
    assert {n for p in profiles(views(nodes), tolerant)[0] for n in p.nodes} == {"tainted", "small"}


def test_a_replica_gets_its_share_of_a_node_or_its_memory_limit():
    nodes = [node("big", machine("4x16gb-gen3-x8"), V100, memory="128Gi", cpu="16")]
    (two,), _ = profiles(views(nodes), Spec(model="default", gpus_per_replica=2))
    assert two.slots == 2 and len(two.machine.gpus) == 2 and two.machine.host.ram_total_bytes == 64 * 2**30
    assert [g.index for g in two.machine.gpus] == [0, 1]  # numbered as the pod sees them
    limited = Spec(model="default", gpus_per_replica=1, resources={"limits": {"memory": "48Gi", "cpu": "2"}})
    (one,), _ = profiles(views(nodes), limited)
    assert one.slots == 2  # RAM: 128Gi holds two 48Gi replicas, though the GPUs would hold four
    assert one.machine.host.ram_total_bytes == 48 * 2**30 and one.machine.host.cpu_cores == 2


def test_replicas_are_spread_in_proportion_to_what_each_profile_holds():
    assert distribute(3, [2, 4]) == [1, 2]
    assert distribute(5, [2, 4]) == [2, 3]
    assert distribute(1, [2, 4]) == [0, 1]
    assert distribute(10, [1, 1]) == [5, 5]
    assert distribute(0, [3]) == [0] and distribute(2, []) == []


@pytest.mark.parametrize("text, value", [("128Gi", 128 * 2**30), ("1056561724Ki", 1056561724 * 1024), ("4", 4),
                                         ("15900m", 15.9), ("500M", 5e8), ("1e3", 1000.0), ("2", 2)])
def test_quantities(text, value):
    assert quantity(text) == pytest.approx(value)


# ---------------------------------------------------------------------------------------------- plans


def test_each_profile_gets_autoconfigs_settings_for_its_hardware():
    the_plan = plan(sd(replicas=3, autoconfig={"expectedConcurrency": 4}), views())
    assert the_plan.problem is None
    h200, v100 = the_plan.serving
    assert (h200.profile.replicas, v100.profile.replicas) == (1, 2)
    want = propose(Facts(machine=h200.profile.machine, model=smollm2_135m()), Wishes(concurrency=4))
    assert h200.proposal.settings == want.settings and h200.proposal.reasons == want.reasons
    assert h200.proposal.settings["device"] == "cuda:0" and h200.proposal.settings["batch"] == 4
    assert "NVIDIA H200" in h200.proposal.reasons["device"] and "Tesla V100" in v100.proposal.reasons["device"]


def test_the_specs_engine_settings_win_with_their_reason():
    the_plan = plan(sd(engine={"batch": 16, "context": 4096, "trimStageWeights": True}), views())
    for p in the_plan.serving:
        s, why = p.proposal.settings, p.proposal.reasons
        assert (s["batch"], s["max_cells"], s["trim_stage_weights"]) == (16, 4096, True)
        assert why["batch"] == "16: as spec.engine.batch says"
        assert why["trim_stage_weights"] == "true: as spec.engine.trimStageWeights says"


def test_a_moe_model_from_spec_model_facts_is_split_over_a_replicas_gpus():
    spec = dict(model="Qwen3-Next-80B-A3B", modelFacts=QWEN3_NEXT, gpusPerReplica=4,
                autoconfig={"expectedConcurrency": 8}, nodeSelector={"nvidia.com/gpu.product": V100})
    nodes = [node("v100-a", machine("4x16gb-gen3-x8"), V100, memory="128Gi", cpu="16")]
    (p,) = plan(sd(**spec), views(nodes)).serving
    s = p.proposal.settings
    assert s["device"] == "cuda" and s["batch_groups"] == 4 and len(s["layer_split"].split(",")) == 4
    assert s["trim_stage_weights"] is True and s["expert_budget_gb"] and s["cpu_threads"] == 12
    assert "PCIe Gen3 x8" in p.proposal.reasons["layer_split"]  # the slow slot gets fewer layers


def test_a_model_that_fits_no_node_is_degraded_with_autoconfigs_numbers():
    spec = dict(model="Qwen3-Next-80B-A3B", modelFacts=QWEN3_NEXT, nodeSelector={"nvidia.com/gpu.product": V100})
    the_plan = plan(sd(**spec), views())
    assert the_plan.serving == []
    reason, message = the_plan.problem
    assert reason == "DoesNotFit" and "does not fit this machine" in message and "GB" in message
    assert the_plan.profiles[0].error in message


def test_profiles_that_cannot_serve_are_listed_and_get_no_replicas():
    spec = dict(model="Qwen3-Next-80B-A3B", modelFacts=QWEN3_NEXT, replicas=2)
    the_plan = plan(sd(**spec), views())  # one H200 with 256Gi holds it (experts spill to RAM); 4 V100s do not
    assert the_plan.problem is None
    assert [p.profile.name for p in the_plan.serving] == ["nvidia-h200-x1"]
    assert the_plan.serving[0].profile.replicas == 2
    (failed,) = [p for p in the_plan.profiles if p.error]
    assert failed.profile.name == "tesla-v100-pcie-16gb-x4" and "does not fit" in failed.error


def test_without_model_facts_the_operator_chooses_nothing_that_needs_them_and_says_why():
    the_plan = plan(sd(model="Qwen3-30B-A3B", engine={"batch": 8}), views())
    for p in the_plan.serving:
        assert p.proposal.settings == {"device": "cuda", "batch": 8}
        assert "spec.modelFacts is not given" in p.proposal.reasons["device"]
    assert plan(sd(autoconfig={"enabled": False}), views()).serving[0].proposal.settings == {"device": "cuda"}


@pytest.mark.parametrize("spec, reason", [
    (dict(engine={"layerSplit": "12,12"}, gpusPerReplica=1), "InvalidSpec"),
    (dict(modelFacts={"num_layers": "many"}), "InvalidSpec"),
    (dict(nodeSelector={"pool": "none"}), "NoEligibleNodes"),
])
def test_specs_that_cannot_be_planned(spec, reason):
    the_plan = plan(sd(**spec), views())
    assert the_plan.problem[0] == reason and the_plan.serving == []


# ---------------------------------------------------------------------------------------------- builders


def test_every_manifest_validates_against_the_kubernetes_schemas():
    specs = [dict(), dict(replicas=4, gpusPerReplica=2, model="Qwen3-Next-80B-A3B", modelFacts=QWEN3_NEXT,
                          image="registry.example.com/strata:0.1.0", imagePullPolicy="Always",
                          resources={"requests": {"cpu": 8, "memory": "64Gi"}, "limits": {"memory": "96Gi"}},
                          tolerations=[{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}],
                          storage={"volume": {"persistentVolumeClaim": {"claimName": "models"}}, "shmSize": "16Gi"},
                          service={"type": "LoadBalancer", "port": 80, "annotations": {"a": "b"},
                                   "sessionAffinity": "ClientIP", "sessionAffinityTimeoutSeconds": 600},
                          engine={"extraArgs": ["--max-window-tokens", "1024"]}, monitoring={"enabled": False},
                          ingress={"enabled": True, "className": "nginx", "host": "*.example.com", "path": "/v1",
                                   "annotations": {"a": "b"}, "tls": [{"secretName": "t", "hosts": ["a.example.com"]},
                                                                      {"secretName": "u"}],
                                   "affinity": "header", "sessionHeader": "X-Chat-Id"}),
             dict(gpusPerReplica=0, nodeSelector={"kubernetes.io/hostname": "fresh"})]
    kinds = set()
    for spec in specs:
        objects = children(sd(**spec))
        for obj in objects:
            validate_k8s(obj)
            kinds.add(obj["kind"])
    assert kinds == {"ConfigMap", "Deployment", "Service", "Ingress"}


def test_the_configmap_is_a_config_file_that_strata_serve_reads(tmp_path):
    from serve.config import ServeSettings
    from strata.config import use_config_file

    resource_ = sd(servedModelName="chat", autoconfig={"expectedConcurrency": 4})
    configmap = children(resource_)[0]
    config = config_of(configmap)
    assert config["model"] == "default" and config["served_model_name"] == "chat"
    assert (config["device"], config["batch"], config["host"], config["port"]) == ("cuda:0", 4, "0.0.0.0", 8000)
    assert set(config) <= set(ServeSettings.model_fields)
    path = tmp_path / "config.json"
    path.write_text(configmap["data"]["config.json"])
    use_config_file(path)
    try:
        settings = ServeSettings(_cli_parse_args=False)
    finally:
        use_config_file(None)
    for key, value in config.items():
        if f"STRATA_{key.upper()}" not in os.environ:
            assert getattr(settings, key) == value, key


def test_the_deployment_runs_the_config_on_its_profiles_nodes():
    resource_ = sd(gpusPerReplica=1, engine={"extraArgs": ["--max-window-tokens", "1024"]})
    configmap, deployment = children(resource_)[:2]
    pod = deployment["spec"]["template"]["spec"]
    (c,) = pod["containers"]
    assert c["args"] == ["--config", "/etc/strata/config.json", "--max-window-tokens", "1024"]
    assert {"name": "STRATA_DEVICE", "value": "cuda:0"} in c["env"]  # the image's STRATA_DEVICE would beat the file
    assert {"name": "STRATA_SHUTDOWN_GRACE", "value": "110"} in c["env"]  # within the pod's grace
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "1" and c["image"] == "strata:0.1.0"
    assert pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"][0][
        "matchExpressions"][0] == {"key": "nvidia.com/gpu.product", "operator": "In", "values": [H200]}
    assert {"name": "config", "configMap": {"name": configmap["metadata"]["name"]}} in pod["volumes"]
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    assert deployment["spec"]["template"]["metadata"]["annotations"][builders.CONFIG_HASH] == \
        builders.config_hash(configmap)


def test_a_settings_change_changes_the_pod_template_and_a_replica_count_does_not():
    def template(**spec):
        return children(sd(**spec))[1]["spec"]["template"]

    base = template(replicas=1, autoconfig={"expectedConcurrency": 4})
    assert template(replicas=7, autoconfig={"expectedConcurrency": 4}) == base
    changed = template(replicas=1, autoconfig={"expectedConcurrency": 8})
    assert changed["metadata"]["annotations"] != base["metadata"]["annotations"]


def test_the_service_is_what_the_servicemonitor_selects():
    resource_ = sd()
    service = builders.build_service(resource_)
    assert service["metadata"]["labels"]["app.kubernetes.io/name"] == "strata"
    assert service["metadata"]["labels"]["app.kubernetes.io/component"] == "server"
    assert service["spec"]["ports"] == [{"name": "service-port", "port": 8000, "targetPort": "http",
                                         "protocol": "TCP"}]
    assert service["spec"]["selector"] == builders.selector_labels(resource_)
    assert builders.selector(resource_) == ",".join(f"{k}={v}" for k, v in sorted(service["spec"]["selector"].items()))
    quiet = builders.build_service(sd(monitoring={"enabled": False}))
    assert "app.kubernetes.io/component" not in quiet["metadata"]["labels"]


def test_client_ip_affinity_pins_a_client_to_the_replica_holding_its_conversations():
    plain = builders.build_service(sd())["spec"]
    assert plain["sessionAffinity"] == "None" and "sessionAffinityConfig" not in plain
    pinned = builders.build_service(sd(service={"sessionAffinity": "ClientIP", "sessionAffinityTimeoutSeconds": 600}))
    assert pinned["spec"]["sessionAffinity"] == "ClientIP"
    assert pinned["spec"]["sessionAffinityConfig"] == {"clientIP": {"timeoutSeconds": 600}}
    validate_k8s(pinned)
    default = builders.build_service(sd(service={"sessionAffinity": "ClientIP"}))["spec"]
    assert default["sessionAffinityConfig"]["clientIP"]["timeoutSeconds"] == 10800  # as Kubernetes' default


@pytest.mark.parametrize("service", [{"sessionAffinity": "Cookie"}, {"sessionAffinity": "clientip"},
                                     {"sessionAffinityTimeoutSeconds": 0}, {"sessionAffinityTimeoutSeconds": 86401}])
def test_the_crd_and_the_spec_refuse_a_bad_session_affinity(service):
    from pydantic import ValidationError

    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(resource(service=service), crd_schema())
    with pytest.raises(ValidationError):
        sd(service=service)


def test_the_ingress_leads_to_the_service_and_hashes_the_session_header_with_header_affinity():
    assert "Ingress" not in [o["kind"] for o in children(sd())], "off by default"
    plain = sd(ingress={"enabled": True})
    ingress, service = builders.build_ingress(plain), builders.build_service(plain)
    assert [o["kind"] for o in children(plain)][-2:] == ["Service", "Ingress"]
    assert (ingress["apiVersion"], ingress["metadata"]["name"], ingress["metadata"]["namespace"]) == (
        "networking.k8s.io/v1", "chat", "llm")
    assert builders.owned_labels(plain).items() <= ingress["metadata"]["labels"].items()
    (rule,) = ingress["spec"]["rules"]
    (path,) = rule["http"]["paths"]
    assert (path["path"], path["pathType"]) == ("/", "Prefix")
    (port,) = service["spec"]["ports"]
    assert path["backend"] == {"service": {"name": "chat", "port": {"name": "service-port"}}}
    assert (service["metadata"]["name"], port["name"]) == ("chat", "service-port")
    assert "annotations" not in ingress["metadata"], "affinity none: no hash annotation"
    assert "host" not in rule and "tls" not in ingress["spec"] and "ingressClassName" not in ingress["spec"]

    sticky = builders.build_ingress(sd(ingress={
        "enabled": True, "className": "nginx", "host": "llm.example.com", "path": "/v1", "affinity": "header",
        "tls": [{"secretName": "strata-tls", "hosts": ["llm.example.com"]}, {"secretName": "default-host"}]}))
    assert sticky["metadata"]["annotations"] == {"nginx.ingress.kubernetes.io/upstream-hash-by": "$http_x_session_id"}
    assert sticky["spec"]["ingressClassName"] == "nginx"
    assert sticky["spec"]["tls"] == [{"secretName": "strata-tls", "hosts": ["llm.example.com"]},
                                     {"secretName": "default-host"}]
    (rule,) = sticky["spec"]["rules"]
    assert rule["host"] == "llm.example.com" and rule["http"]["paths"][0]["path"] == "/v1"
    chat = builders.build_ingress(sd(ingress={"enabled": True, "affinity": "header", "sessionHeader": "X-Chat-Id"}))
    assert chat["metadata"]["annotations"] == {builders.HASH_BY: "$http_x_chat_id"}
    mine = builders.build_ingress(sd(ingress={"enabled": True, "affinity": "header", "annotations": {
        builders.HASH_BY: "$http_x_tenant", "nginx.ingress.kubernetes.io/proxy-body-size": "8m"}}))
    assert mine["metadata"]["annotations"] == {builders.HASH_BY: "$http_x_tenant",
                                               "nginx.ingress.kubernetes.io/proxy-body-size": "8m"}, "the spec's win"
    for obj in (ingress, sticky, chat, mine):
        validate_k8s(obj)


@pytest.mark.parametrize("affinity, header", [("header", "X-Session-Id"), ("header", "X-Chat-Id"),
                                              ("header", "x-TENANT-id2"), ("none", "X-Session-Id")])
def test_the_operators_ingress_is_the_charts_for_the_same_values(affinity, header):
    """`helm template` with server.ingress set, and the operator's Ingress for a resource named as the chart's server
    Service, whose spec.ingress holds the same keys: the same annotations, the same spec."""
    values = {"className": "nginx", "host": "llm.example.com", "affinity": affinity, "sessionHeader": header,
              "tls": [{"secretName": "strata-tls", "hosts": ["llm.example.com"]}]}
    sets = ["server.enabled=true", "server.ingress.enabled=true", "server.ingress.className=nginx",
            "server.ingress.host=llm.example.com", f"server.ingress.affinity={affinity}",
            f"server.ingress.sessionHeader={header}", "server.ingress.tls[0].secretName=strata-tls",
            "server.ingress.tls[0].hosts[0]=llm.example.com"]
    (chart,) = by_kind(helm_template(*sets), "Ingress")
    ours = builders.build_ingress(sd(name="strata-server", namespace="strata", ingress={"enabled": True, **values}))
    assert ours["metadata"].get("annotations") == chart["metadata"].get("annotations")
    assert ours["spec"] == chart["spec"]
    if affinity == "header":
        assert ours["metadata"]["annotations"][builders.HASH_BY] == "$http_" + header.lower().replace("-", "_")


@pytest.mark.parametrize("ingress, field", [
    ({"sessionHeader": "X_Session_Id"}, "sessionHeader"), ({"sessionHeader": "X Session"}, "sessionHeader"),
    ({"sessionHeader": ""}, "sessionHeader"), ({"sessionHeader": "X--Id"}, "sessionHeader"),
    ({"sessionHeader": "Sessi\u00f3n"}, "sessionHeader"), ({"affinity": "cookie"}, "affinity"),
    ({"host": "LLM.example.com"}, "host"), ({"path": "v1"}, "path")])
def test_the_crd_and_the_spec_refuse_a_bad_ingress_naming_the_field(ingress, field):
    from pydantic import ValidationError

    with pytest.raises(jsonschema.ValidationError) as refused:
        jsonschema.validate(resource(ingress={"enabled": True, **ingress}), crd_schema())
    assert list(refused.value.absolute_path) == ["spec", "ingress", field]
    with pytest.raises(ValidationError) as invalid:
        sd(ingress={"enabled": True, **ingress})
    (error,) = invalid.value.errors()
    assert error["loc"] == ("ingress", field)
    if field == "sessionHeader":
        assert "is not an HTTP header name" in error["msg"] and repr(ingress[field]) in error["msg"]


def test_the_documented_operator_ingress_is_what_the_operator_makes():
    text = (REPO / "docs" / "DEPLOY.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, re.S)]
    (example,) = [b for b in blocks if b.get("kind") == "StrataDeployment" and "ingress" in b["spec"]]
    (documented,) = [b for b in blocks if b.get("kind") == "Ingress"]
    jsonschema.validate(example, crd_schema())
    made = builders.build_ingress(StrataDeployment.from_body(example))
    assert {k: made["metadata"][k] for k in ("name", "namespace", "annotations")} == documented["metadata"]
    assert made["spec"] == documented["spec"]
    assert made["metadata"]["name"] == builders.build_service(StrataDeployment.from_body(example))["metadata"]["name"]


# ---------------------------------------------------------------------------------------------- status


def test_status_conditions_follow_the_deployments_and_validate_against_the_crd():
    schema = crd_schema()["properties"]["status"]
    resource_ = sd(replicas=3, autoconfig={"expectedConcurrency": 4})
    the_plan = plan(resource_, views())
    deployments = [o for o in children(resource_) if o["kind"] == "Deployment"]
    for d in deployments:
        d["metadata"]["generation"] = 1
    fresh = build_status(resource_, the_plan, deployments, None, "2026-01-01T00:00:00Z")
    jsonschema.validate(fresh, schema)
    state = {c["type"]: c["status"] for c in fresh["conditions"]}
    assert state == {"Ready": "False", "Progressing": "True", "Degraded": "False"}
    assert fresh["observedGeneration"] == 1 and fresh["replicas"] == 0
    assert fresh["profiles"][0]["reasons"][0].startswith("device cuda:0 (NVIDIA H200)")
    for d in deployments:
        n = d["spec"]["replicas"]
        d["status"] = dict(observedGeneration=1, replicas=n, updatedReplicas=n, readyReplicas=n)
    ready = build_status(resource_, the_plan, deployments, fresh, "2026-01-01T00:01:00Z")
    jsonschema.validate(ready, schema)
    assert {c["type"]: (c["status"], c["lastTransitionTime"]) for c in ready["conditions"]} == {
        "Ready": ("True", "2026-01-01T00:01:00Z"), "Progressing": ("False", "2026-01-01T00:01:00Z"),
        "Degraded": ("False", "2026-01-01T00:00:00Z")}
    assert (ready["replicas"], ready["readyReplicas"]) == (3, 3)


def test_an_impossible_status_is_degraded():
    resource_ = sd(model="Qwen3-Next-80B-A3B", modelFacts=QWEN3_NEXT, nodeSelector={"nvidia.com/gpu.product": V100})
    status = build_status(resource_, plan(resource_, views()), [], None, "2026-01-01T00:00:00Z")
    jsonschema.validate(status, crd_schema()["properties"]["status"])
    degraded = {c["type"]: c for c in status["conditions"]}["Degraded"]
    assert degraded["status"] == "True" and degraded["reason"] == "DoesNotFit"
    assert degraded["message"].endswith("nothing was created")


def test_the_documented_example_is_a_valid_resource_that_makes_the_documented_children():
    text = (REPO / "docs" / "OPERATOR.md").read_text()
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", text, re.S)]
    (example,) = [b for b in blocks if b.get("kind") == "StrataDeployment"]
    (status,) = [b["status"] for b in blocks if "status" in b]
    jsonschema.validate(example, crd_schema())
    jsonschema.validate(status, crd_schema()["properties"]["status"])
    resource_ = StrataDeployment.from_body(example)
    nodes = [node(f"gpu-{i}", machine("2xh200"), H200, memory="1000Gi", cpu="96") for i in "ab"]
    nodes.append(node("v100-a", machine("4x16gb-gen3-x8"), V100, memory="250Gi", cpu="32"))
    objects = children(resource_, nodes)
    assert [(o["kind"], o["metadata"]["name"]) for o in objects] == [
        ("ConfigMap", "qwen3-nvidia-h200-x2"), ("Deployment", "qwen3-nvidia-h200-x2"),
        ("ConfigMap", "qwen3-tesla-v100-pcie-16gb-x4"), ("Deployment", "qwen3-tesla-v100-pcie-16gb-x4"),
        ("Service", "qwen3")]
    assert [d["spec"]["replicas"] for d in objects if d["kind"] == "Deployment"] == [2, 1]
    assert [p["name"] for p in status["profiles"]] == ["nvidia-h200-x2", "tesla-v100-pcie-16gb-x4"]
    for obj in objects:
        validate_k8s(obj)


# ---------------------------------------------------------------------------------------------- end to end


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(what: str, check, timeout: float = 15.0):
    """Poll `check` until it returns something true; fail with the last value after `timeout` seconds."""
    deadline, value = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"timed out after {timeout} s waiting for {what}; last: {value!r}")


class Cluster:
    """The emulated API, through the kubernetes client (as a user or a controller would write to it)."""

    def __init__(self, url: str):
        from kubernetes import client

        self.client = client.ApiClient(client.Configuration(host=url))
        self.core, self.apps = client.CoreV1Api(self.client), client.AppsV1Api(self.client)
        self.networking = client.NetworkingV1Api(self.client)
        self.custom = client.CustomObjectsApi(self.client)

    def get(self, kind: str, namespace: str | None, name: str) -> dict | None:
        from kubernetes.client.exceptions import ApiException

        call = {"Node": lambda: self.core.read_node(name, _preload_content=False),
                "ConfigMap": lambda: self.core.read_namespaced_config_map(name, namespace, _preload_content=False),
                "Service": lambda: self.core.read_namespaced_service(name, namespace, _preload_content=False),
                "Deployment": lambda: self.apps.read_namespaced_deployment(name, namespace, _preload_content=False),
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
        if body["kind"] == "Node":
            return json.loads(self.core.create_node(body, _preload_content=False).data)
        meta = body["metadata"]
        return json.loads(self.custom.create_namespaced_custom_object(
            "strata.dev", "v1alpha1", meta["namespace"], "stratadeployments", body, _preload_content=False).data)

    def patch_spec(self, namespace: str, name: str, spec: dict) -> None:
        self.custom.patch_namespaced_custom_object("strata.dev", "v1alpha1", namespace, "stratadeployments", name,
                                                   {"spec": spec}, _content_type="application/merge-patch+json")

    def status(self, namespace: str, name: str) -> dict:
        return (self.get("StrataDeployment", namespace, name) or {}).get("status") or {}

    def condition(self, namespace: str, name: str, kind: str) -> dict:
        return {c["type"]: c for c in self.status(namespace, name).get("conditions") or []}.get(kind) or {}

    def roll_out(self, namespace: str, name: str) -> None:
        """Do what the Deployment controller and the kubelets would: every replica updated and ready."""
        for d in self.owned("Deployment", namespace, name):
            n = d["spec"]["replicas"]
            status = dict(observedGeneration=d["metadata"]["generation"], replicas=n, updatedReplicas=n,
                          readyReplicas=n, availableReplicas=n)
            self.apps.patch_namespaced_deployment_status(d["metadata"]["name"], namespace, {"status": status},
                                                         _content_type="application/merge-patch+json")

    def configs(self, namespace: str, name: str) -> dict[str, str]:
        """Deployment name -> the config hash in its pod template."""
        return {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["annotations"][builders.CONFIG_HASH]
                for d in self.owned("Deployment", namespace, name)}


@pytest.fixture(scope="module")
def api():
    server = ApiServer({"strata.dev/v1alpha1/stratadeployments": kmock.ResourceInfo(
        kind="StrataDeployment", singular="stratadeployment", namespaced=True, shortnames={"sdeploy"},
        verbs={"create", "delete", "get", "list", "patch", "update", "watch"}, subresources={"status", "scale"})})
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def operator(api, tmp_path_factory):
    """kopf running strata_operator against the emulator, with two hardware profiles of nodes in the cluster."""
    from kopf.testing import KopfRunner

    cluster = Cluster(api.url)
    for body in cluster_nodes():
        cluster.create(body)
    kubeconfig = tmp_path_factory.mktemp("kube") / "config"
    kubeconfig.write_text(yaml.safe_dump({
        "apiVersion": "v1", "kind": "Config", "current-context": "kmock",
        "clusters": [{"name": "kmock", "cluster": {"server": api.url}}],
        "users": [{"name": "kmock", "user": {"token": "test"}}],
        "contexts": [{"name": "kmock", "context": {"cluster": "kmock", "user": "kmock"}}]}))
    port = free_port()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KUBECONFIG", str(kubeconfig))
        mp.setattr(kubernetes.config.kube_config, "KUBE_CONFIG_DEFAULT_LOCATION", str(kubeconfig))
        mp.delenv("KUBERNETES_SERVICE_HOST", raising=False)
        mp.setenv("STRATA_OPERATOR_IMAGE", "registry.example.com/strata:0.1.0")
        args = ["run", "-m", "strata_operator", "--standalone", "--all-namespaces",
                f"--liveness=http://127.0.0.1:{port}/healthz"]
        with KopfRunner(args, timeout=30) as runner:
            cluster.liveness = f"http://127.0.0.1:{port}/healthz"
            yield cluster
    assert runner.exception is None, runner.output
    assert runner.exit_code == 0, runner.output


@pytest.fixture()
def deployed(operator):
    """Create StrataDeployments in the cluster; they are deleted after the test (fewer timers for the next)."""
    made = []

    def create(body: dict) -> dict:
        made.append((body["metadata"]["namespace"], body["metadata"]["name"]))
        return operator.create(body)

    yield create
    for ns, name in made:
        if operator.get("StrataDeployment", ns, name) is not None:
            operator.custom.delete_namespaced_custom_object("strata.dev", "v1alpha1", ns, "stratadeployments", name)
    for ns, name in made:
        wait_for(f"{ns}/{name} to go", lambda: operator.get("StrataDeployment", ns, name) is None)


def _get(url: str) -> dict | None:
    try:
        with urllib.request.urlopen(url, timeout=1) as response:
            return json.loads(response.read() or b"{}") if response.status == 200 else None
    except OSError:
        return None


def test_injected_api_faults_are_retried_until_the_children_and_status_are_right(api, operator, deployed):
    """What a real API server does not do on demand: fail. A 503 on creating the first Deployment, a 409 on creating
    the Service, a 500 on listing ConfigMaps and a 429 on writing the status: the operator retries each and ends
    with every child made once."""
    ns, name = "faults", "flaky"
    faults = [api.inject("POST", f"/namespaces/{ns}/deployments", 503),
              api.inject("POST", f"/namespaces/{ns}/services", 409),
              api.inject("GET", f"/namespaces/{ns}/configmaps?", 500),
              api.inject("PATCH", f"/namespaces/{ns}/stratadeployments/{name}/status", 429)]
    deployed(resource(name, ns, replicas=2))
    wait_for("two Deployments", lambda: len(operator.owned("Deployment", ns, name)) == 2, timeout=30)
    wait_for("the status", lambda: operator.status(ns, name).get("profiles"), timeout=30)
    wait_for("the Service", lambda: operator.get("Service", ns, name), timeout=30)
    assert [f.hits for f in faults] == [1, 1, 1, 1]
    operator.roll_out(ns, name)
    wait_for("Ready", lambda: operator.condition(ns, name, "Ready").get("status") == "True", timeout=30)
    for kind, count in (("Deployment", 2), ("ConfigMap", 2), ("Service", 1)):
        assert len(operator.owned(kind, ns, name)) == count, kind


def test_a_bad_session_header_past_the_schema_is_an_invalid_spec_naming_the_field(operator, deployed):
    """A resource the CRD's schema would refuse (an older CRD, a server that skipped it): nothing is made, and the
    Degraded condition names the field and the value."""
    ns, name = "ingress", "bad-header"
    deployed(resource(name, ns, ingress={"enabled": True, "affinity": "header", "sessionHeader": "X_Session_Id"}))
    degraded = wait_for("Degraded", lambda: (c := operator.condition(ns, name, "Degraded")).get("status") == "True"
                        and c)
    assert degraded["reason"] == "InvalidSpec"
    assert "at ingress.sessionHeader" in degraded["message"] and "'X_Session_Id'" in degraded["message"]
    for kind in ("Deployment", "Service", "Ingress"):
        assert operator.owned(kind, ns, name) == [], kind


def test_the_emulator_keeps_what_kopf_relies_on(api):
    """Server-side metadata, 422 for a failed JSON-patch test, LIST's resourceVersion, WATCH from a version."""
    from kubernetes.client.exceptions import ApiException

    cluster = Cluster(api.url)
    core, ns = cluster.core, "emulator"
    a = json.loads(core.create_namespaced_config_map(ns, {"metadata": {"generateName": "a-"}, "data": {"k": "1"}},
                                                     _preload_content=False).data)
    meta = a["metadata"]
    assert meta["name"].startswith("a-") and meta["namespace"] == ns and meta["uid"] and meta["creationTimestamp"]
    since = meta["resourceVersion"]
    b = json.loads(core.patch_namespaced_config_map(meta["name"], ns, {"data": {"k": "2"}},
                                                    _preload_content=False).data)
    assert int(b["metadata"]["resourceVersion"]) > int(since) and b["metadata"]["uid"] == meta["uid"]
    with pytest.raises(ApiException) as failed:
        core.patch_namespaced_config_map(meta["name"], ns, [
            {"op": "test", "path": "/metadata/resourceVersion", "value": since},
            {"op": "replace", "path": "/data/k", "value": "3"}])
    assert failed.value.status == 422
    core.create_namespaced_config_map(ns, {"metadata": {"name": "c"}})
    listed = json.loads(core.list_namespaced_config_map(ns, _preload_content=False).data)
    latest = listed["metadata"]["resourceVersion"]
    assert int(latest) == max(int(o["metadata"]["resourceVersion"]) for o in listed["items"])
    url = f"{api.url}/api/v1/namespaces/{ns}/configmaps?watch=true&resourceVersion={since}"
    with urllib.request.urlopen(url, timeout=5) as stream:
        events = [json.loads(stream.readline()) for _ in range(2)]
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [("MODIFIED", meta["name"]),
                                                                             ("ADDED", "c")]
