"""The image and the chart, checked with the real tools: hadolint on the Dockerfile; helm lint and helm template
of every documented combination of values; every rendered object validated against the Kubernetes schemas
(kubernetes-validate); the CRD as a structural CRD that accepts the documented StrataDeployment."""

from __future__ import annotations

import json
import re

import pytest
import yaml

try:
    import jsonschema
    import kubernetes_validate  # noqa: F401 - tests.deploy_tools.validate_k8s uses it
except ImportError as e:  # never a skip: the deploy tests need their tools
    raise ImportError(f"{e}: run .ci/install-deploy-tools") from e

from tests.deploy_tools import (
    CHART,
    COMBINATIONS,
    K8S_VERSIONS,
    REPO,
    SERVER_ON,
    by_kind,
    helm_template,
    run,
    tool,
    validate_k8s,
)
PROMETHEUS_OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule"}
# Fields of the Prometheus Operator's ServiceMonitor (monitoring.coreos.com/v1) that the chart may set.
SERVICE_MONITOR_FIELDS = {"jobLabel", "targetLabels", "podTargetLabels", "endpoints", "selector", "namespaceSelector",
                          "sampleLimit", "targetLimit", "attachMetadata"}
ENDPOINT_FIELDS = {"port", "targetPort", "path", "scheme", "params", "interval", "scrapeTimeout", "honorLabels",
                   "honorTimestamps", "relabelings", "metricRelabelings", "tlsConfig", "authorization",
                   "followRedirects", "enableHttp2", "filterRunning"}


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {name: helm_template(*sets) for name, sets in COMBINATIONS.items()}


def only(objects: list[dict], kind: str, component: str | None = None) -> dict:
    found = [o for o in by_kind(objects, kind)
             if component is None or o["metadata"]["labels"].get("app.kubernetes.io/component") == component]
    assert len(found) == 1, (kind, component, [o["metadata"]["name"] for o in found])
    return found[0]


def container(deployment: dict) -> dict:
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    return c


# the image

def test_dockerfile_has_nothing_above_info_in_hadolint():
    proc = run([tool("hadolint"), "--config", str(REPO / ".hadolint.yaml"), "--failure-threshold", "warning",
                "--format", "json", str(REPO / "Dockerfile")], check=False)
    findings = json.loads(proc.stdout or "[]")
    assert [f for f in findings if f["level"] not in ("info", "style")] == [], proc.stdout
    assert proc.returncode == 0, proc.stderr


def test_dockerfile_is_multi_stage_cuda_non_root_strata_serve():
    text = (REPO / "Dockerfile").read_text()
    stages = re.findall(r"^FROM\s+(\S+)(?:\s+AS\s+(\S+))?", text, flags=re.MULTILINE | re.IGNORECASE)
    assert len(stages) >= 2, "multi-stage: a builder and the final image"
    for image, _ in stages:
        name, _, tag = image.partition(":")
        assert tag and tag != "latest" and "$" not in image, f"{image}: a base image is pinned by a real tag"
    final_image = stages[-1][0]
    assert re.fullmatch(r"nvidia/cuda:[0-9.]+-(runtime|base)-ubuntu[0-9.]+", final_image), final_image
    final = text[text.rindex("\nFROM "):]
    installs = " ".join(re.findall(r"apt-get install[^\n]*", final))
    for build_tool in ("gcc", "g++", "clang", "build-essential", "-dev", "make"):
        assert build_tool not in installs, f"the final stage installs {build_tool}: {installs}"
    assert re.search(r"^COPY --from=builder /opt/venv /opt/venv$", final, flags=re.MULTILINE)
    user = re.findall(r"^USER\s+(\S+)", final, flags=re.MULTILINE)
    assert user and user[-1].split(":")[0].isdigit() and user[-1].split(":")[0] != "0", "a numeric non-root USER"
    assert 'ENTRYPOINT ["strata", "serve"]' in final
    assert re.search(r"^EXPOSE 8000$", final, flags=re.MULTILINE)
    assert "STRATA_MODEL_DIR=/models" in final and 'VOLUME ["/models"]' in final
    assert re.search(r"pip install torch==[0-9.]+ triton==[0-9.]+", text)


def test_dockerignore_keeps_the_context_to_the_packages():
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {".git", "tests", "helm", "bench", "**/__pycache__"} <= ignored
    assert not ignored & {"strata", "serve", "operator", "pyproject.toml", "README.md"}


# helm lint and template

@pytest.mark.parametrize("name", COMBINATIONS)
def test_helm_lint_strict(name):
    args = [tool("helm"), "lint", "--strict", str(CHART)]
    for s in COMBINATIONS[name]:
        args += ["--set", s]
    out = run(args).stdout
    assert "0 chart(s) failed" in out
    assert not re.search(r"\[(WARNING|ERROR)\]", out), out


def test_every_rendered_object_validates_against_the_kubernetes_schemas(rendered):
    checked = set()
    for name, objects in rendered.items():
        assert objects, name
        for obj in objects:
            if obj["kind"] in PROMETHEUS_OPERATOR_KINDS:
                continue  # no schema in kubernetes-validate: checked field by field below
            validate_k8s(obj, f"{name}: ")
            checked.add(obj["kind"])
    assert {"CustomResourceDefinition", "Deployment", "DaemonSet", "Service", "ServiceAccount", "ClusterRole",
            "ClusterRoleBinding", "RoleBinding", "ConfigMap", "PersistentVolumeClaim", "Ingress"} <= checked


def test_default_values_install_the_operator_crd_and_dashboards(rendered):
    kinds = {o["kind"] for o in rendered["default"]}
    assert {"CustomResourceDefinition", "Deployment", "ConfigMap"} <= kinds
    assert not kinds & PROMETHEUS_OPERATOR_KINDS, "monitoring CRDs are not assumed by default"
    assert only(rendered["default"], "Deployment")["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"


def test_switches_turn_each_part_on_and_off(rendered):
    def kinds(name):
        return {(o["kind"], o["metadata"]["labels"].get("app.kubernetes.io/component")) for o in rendered[name]}

    server_only = kinds("server-only")
    assert ("Deployment", "server") in server_only and ("Service", "server") in server_only
    assert not any(c in ("operator", "node-facts") for _, c in server_only)
    assert "CustomResourceDefinition" not in {k for k, _ in server_only}
    assert ("Deployment", "server") not in kinds("operator-only")
    assert {k for k, _ in kinds("server-monitoring")} >= PROMETHEUS_OPERATOR_KINDS | {"ConfigMap"}
    assert not {k for k, _ in kinds("monitoring-off")} & (PROMETHEUS_OPERATOR_KINDS | {"ConfigMap"})


# the CRD

def walk_schema(node: dict, path: str = "$"):
    yield path, node
    for key, child in (node.get("properties") or {}).items():
        yield from walk_schema(child, f"{path}.{key}")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk_schema(node["additionalProperties"], f"{path}.*")
    if isinstance(node.get("items"), dict):
        yield from walk_schema(node["items"], f"{path}[]")


def crd_schema(rendered) -> dict:
    crd = only(rendered["default"], "CustomResourceDefinition")
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def documented_resource() -> dict:
    text = (REPO / "docs" / "DEPLOY.md").read_text()
    for block in re.findall(r"```yaml\n(.*?)```", text, flags=re.DOTALL):
        doc = yaml.safe_load(block)
        if isinstance(doc, dict) and doc.get("kind") == "StrataDeployment":
            return doc
    pytest.fail("docs/DEPLOY.md has no StrataDeployment example")


def test_crd_is_strata_dev_v1alpha1_kept_with_scale_status_and_columns(rendered):
    crd = only(rendered["default"], "CustomResourceDefinition")
    assert crd["metadata"]["name"] == "stratadeployments.strata.dev"
    assert crd["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    spec = crd["spec"]
    assert spec["group"] == "strata.dev" and spec["names"]["kind"] == "StrataDeployment"
    (version,) = spec["versions"]
    assert version["name"] == "v1alpha1" and version["served"] and version["storage"]
    assert version["subresources"]["status"] == {}
    assert version["subresources"]["scale"] == {"specReplicasPath": ".spec.replicas",
                                                "statusReplicasPath": ".status.replicas",
                                                "labelSelectorPath": ".status.selector"}
    columns = {c["name"]: c["jsonPath"] for c in version["additionalPrinterColumns"]}
    assert columns == {"Model": ".spec.model", "Replicas": ".spec.replicas", "Ready": ".status.readyReplicas",
                       "Age": ".metadata.creationTimestamp"}


def test_crd_has_the_operator_issue_fields(rendered):
    schema = crd_schema(rendered)
    spec = schema["properties"]["spec"]["properties"]
    assert {"model", "servedModelName", "replicas", "gpusPerReplica", "engine", "autoconfig", "image", "resources",
            "nodeSelector", "tolerations", "storage", "service", "ingress", "monitoring"} <= set(spec)
    assert {"batch", "batchGroups", "layerSplit", "trimStageWeights", "context", "extraArgs"} <= set(spec["engine"]["properties"])
    assert {"enabled", "expectedConcurrency", "context"} <= set(spec["autoconfig"]["properties"])
    service = spec["service"]["properties"]
    assert service["sessionAffinity"]["enum"] == ["None", "ClientIP"] and service["sessionAffinity"]["default"] == "None"
    assert (service["sessionAffinityTimeoutSeconds"]["minimum"], service["sessionAffinityTimeoutSeconds"]["maximum"]) == (
        1, 86400)
    ingress = spec["ingress"]["properties"]
    chart_ingress = yaml.safe_load((CHART / "values.yaml").read_text())["server"]["ingress"]
    assert set(chart_ingress) | {"path"} == set(ingress), "the chart's server.ingress keys, and path"
    assert ingress["affinity"]["enum"] == ["none", "header"] and ingress["affinity"]["default"] == "none"
    schema_json = json.loads((CHART / "values.schema.json").read_text())
    chart_schema = schema_json["properties"]["server"]["properties"]["ingress"]["properties"]
    for key in ("host", "sessionHeader"):
        assert ingress[key]["pattern"] == chart_schema[key]["pattern"], key
    status = schema["properties"]["status"]["properties"]
    assert {"conditions", "observedGeneration", "replicas", "readyReplicas", "selector", "profiles"} <= set(status)
    condition = status["conditions"]["items"]
    assert condition["properties"]["status"]["enum"] == ["True", "False", "Unknown"]
    assert status["conditions"]["x-kubernetes-list-map-keys"] == ["type"]


def test_crd_schema_is_structural(rendered):
    """Kubernetes' rules for a structural schema: a type on every node (unless int-or-string or preserving
    unknown fields), never properties beside additionalProperties, and metadata left to the API server."""
    schema = crd_schema(rendered)
    for path, node in walk_schema(schema):
        if not (node.get("x-kubernetes-int-or-string") or node.get("x-kubernetes-preserve-unknown-fields")):
            assert node.get("type"), f"{path} has no type"
        assert not ("properties" in node and "additionalProperties" in node), path
        for forbidden in ("$ref", "anyOf", "oneOf", "allOf", "not"):
            assert forbidden not in node, f"{path}: {forbidden}"
    assert schema["properties"]["metadata"] == {"type": "object"}


def test_documented_resource_validates_and_bad_ones_do_not(rendered):
    schema = crd_schema(rendered)
    resource = documented_resource()
    assert resource["apiVersion"] == "strata.dev/v1alpha1"
    jsonschema.validate(resource, schema)
    status = {"conditions": [{"type": "Ready", "status": "True", "reason": "Serving", "message": "2/2 ready",
                              "lastTransitionTime": "2026-11-30T10:00:00Z"}],
              "observedGeneration": 3, "replicas": 2, "readyReplicas": 2,
              "selector": "app.kubernetes.io/instance=qwen3", "profiles": [{"name": "h200x8", "replicas": 2,
                                                                            "settings": {"batch": 16}, "reasons": ["fits"]}]}
    jsonschema.validate({**resource, "status": status}, schema)
    for path, bad in ((("spec", "replicas"), -1), (("spec", "engine", "batch"), "many"),
                      (("spec", "service", "type"), "Ingress"), (("spec", "model"), ""),
                      (("spec", "engine", "layerSplit"), "half"), (("spec", "service", "sessionAffinity"), "Cookie"),
                      (("spec", "service", "sessionAffinityTimeoutSeconds"), 0),
                      (("spec", "service", "sessionAffinityTimeoutSeconds"), 86401),
                      (("spec", "ingress", "affinity"), "cookie"), (("spec", "ingress", "sessionHeader"), "X_Id")):
        broken = json.loads(json.dumps(resource))
        node = broken
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = bad
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(broken, schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**resource, "spec": {"replicas": 1}}, schema)  # model is required
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({**resource, "status": {"conditions": [{"type": "Ready", "status": "yes"}]}}, schema)


# the operator

def test_operator_runs_kopf_from_the_same_image_with_its_liveness_probe(rendered):
    objects = rendered["everything"]
    operator = only(objects, "Deployment", "operator")
    server = only(objects, "Deployment", "server")
    op = container(operator)
    assert op["image"] == container(server)["image"] == "strata:0.1.0"
    assert op["command"][:5] == ["kopf", "run", "-m", "strata_operator", "--liveness=http://0.0.0.0:8080/healthz"]
    assert "--all-namespaces" in op["command"]
    assert "args" not in op
    probe = op["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz"
    assert {p["name"]: p["containerPort"] for p in op["ports"]}[probe["port"]] == 8080
    pod = operator["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] and op["securityContext"]["allowPrivilegeEscalation"] is False
    (account,) = [a for a in by_kind(objects, "ServiceAccount") if a["metadata"]["labels"]["app.kubernetes.io/component"] == "operator"]
    assert pod["serviceAccountName"] == account["metadata"]["name"]


def rules_of(objects: list[dict], subject: str) -> list[dict]:
    """Every rule granted to the ServiceAccount `subject`, through any binding."""
    roles = {(r["kind"], r["metadata"]["name"]): r for r in objects if r["kind"] in ("ClusterRole", "Role")}
    rules = []
    for binding in objects:
        if binding["kind"] in ("ClusterRoleBinding", "RoleBinding") and any(
                s["kind"] == "ServiceAccount" and s["name"] == subject for s in binding["subjects"]):
            rules += roles[(binding["roleRef"]["kind"], binding["roleRef"]["name"])]["rules"]
    return rules


def allows(rules: list[dict], group: str, resource: str, verb: str) -> bool:
    return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"] for r in rules)


def test_rbac_is_least_privilege(rendered):
    objects = rendered["default"]
    for role in by_kind(objects, "ClusterRole"):
        for rule in role["rules"]:
            for key in ("apiGroups", "resources", "verbs"):
                assert "*" not in rule[key], (role["metadata"]["name"], rule)
            assert "secrets" not in rule["resources"], role["metadata"]["name"]
    operator = container(only(objects, "Deployment", "operator"))
    account = only(objects, "Deployment", "operator")["spec"]["template"]["spec"]["serviceAccountName"]
    rules = rules_of(objects, account)
    # exactly what it uses is checked on a real API server (tests/test_kube_operator.py); here, what it must have
    for verb in ("list", "watch", "patch"):
        assert allows(rules, "strata.dev", "stratadeployments", verb)
    assert allows(rules, "strata.dev", "stratadeployments/status", "patch")
    for group, resource in (("apps", "deployments"), ("", "services"), ("", "configmaps"),
                            ("networking.k8s.io", "ingresses")):
        for verb in ("get", "list", "create", "patch", "delete"):
            assert allows(rules, group, resource, verb), (resource, verb)
    for verb in ("list", "watch"):
        assert allows(rules, "", "nodes", verb) and allows(rules, "apiextensions.k8s.io", "customresourcedefinitions", verb)
    assert allows(rules, "", "events", "create")
    assert not any(allows(rules, "", "nodes", v) for v in ("patch", "update", "delete")), "the operator only reads nodes"
    assert not allows(rules, "apiextensions.k8s.io", "customresourcedefinitions", "create")
    assert operator["command"][-1] == "--all-namespaces"
    facts = rules_of(objects, "strata-node-facts")
    assert facts == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get", "patch"]}]


def test_watched_namespaces_bind_write_access_only_there(rendered):
    objects = rendered["operator-namespaced"]
    command = container(only(objects, "Deployment", "operator"))["command"]
    assert "--namespace=team-a" in command and "--namespace=team-b" in command and "--all-namespaces" not in command
    workloads = {b["metadata"].get("namespace") for b in objects
                 if b["kind"] in ("RoleBinding", "ClusterRoleBinding") and b["roleRef"]["name"] == "strata-operator-workloads"}
    assert workloads == {"team-a", "team-b"}
    assert all(b["kind"] == "RoleBinding" for b in objects if b["kind"].endswith("Binding")
               and b["roleRef"]["name"] == "strata-operator-workloads")


def test_node_facts_daemonset_annotates_gpu_nodes(rendered):
    ds = only(rendered["default"], "DaemonSet", "node-facts")
    pod = ds["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["command"] == ["strata", "autoconfig", "facts", "--annotate-node"]
    assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in init["env"]
    assert "nvidia.com/gpu" not in json.dumps(init.get("resources", {})), "it must not claim a GPU"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.present": "true"}


# the server

def test_server_deployment_is_ready_for_large_models_on_gpus(rendered):
    objects = rendered["server-hostpath"]
    deployment = only(objects, "Deployment", "server")
    pod = deployment["spec"]["template"]["spec"]
    c = container(deployment)
    assert c["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert c["resources"]["limits"]["memory"] == "64Gi"  # the values' limits merged with the GPUs
    assert pod["runtimeClassName"] == "nvidia"
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        path = "/live" if probe == "livenessProbe" else "/health"  # liveness apart from readiness
        assert c[probe]["httpGet"]["path"] == path and ports[c[probe]["httpGet"]["port"]] == 8000, probe
    startup = c["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 1800, "patient enough to load a large model"
    sleep = c["lifecycle"]["preStop"]["exec"]["command"]
    assert sleep[0] == "sleep"
    assert pod["terminationGracePeriodSeconds"] == int(sleep[1]) + 120 > int(sleep[1])
    assert "--shutdown-grace=110" in c["args"]  # the server ends what still runs before the pod's grace is over
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["name"]: m["mountPath"] for m in c["volumeMounts"]}
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory" and mounts["shm"] == "/dev/shm"
    assert volumes["models"]["hostPath"]["path"] == "/var/lib/strata/models" and mounts["models"] == "/models"
    assert {"name": "STRATA_MODEL_DIR", "value": "/models"} in c["env"]
    assert "--model=default" in c["args"] and "--device=cuda" in c["args"]
    assert pod["securityContext"]["runAsNonRoot"] and pod["automountServiceAccountToken"] is False
    assert not by_kind(objects, "PersistentVolumeClaim")


def test_server_on_the_cpu_claims_no_gpu_and_a_gpu_device_needs_gpus(rendered):
    c = container(only(rendered["server-cpu"], "Deployment", "server"))
    assert "nvidia.com/gpu" not in json.dumps(c["resources"]) and "--device=cpu" in c["args"]
    proc = run([tool("helm"), "template", "strata", str(CHART), "--set", "server.enabled=true", "--set", "server.gpus=0"],
               check=False)
    assert proc.returncode != 0 and "server.gpus is 0" in proc.stderr, proc.stderr


def test_server_model_cache_on_a_pvc(rendered):
    created = rendered["everything"]
    claim = only(created, "PersistentVolumeClaim")
    assert claim["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    pod = only(created, "Deployment", "server")["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]

    existing = rendered["server-existing-claim"]
    assert not by_kind(existing, "PersistentVolumeClaim")
    deployment = only(existing, "Deployment", "server")
    volumes = {v["name"]: v for v in deployment["spec"]["template"]["spec"]["volumes"]}
    assert volumes["models"]["persistentVolumeClaim"]["claimName"] == "models"
    c = container(deployment)
    assert "--model=/models/Qwen3-30B-A3B" in c["args"]  # a relative model is a path on the model cache
    assert {"name": "STRATA_API_KEY", "valueFrom": {"secretKeyRef": {"name": "strata-key", "key": "api-key"}}} in c["env"]


def test_service_monitor_scrapes_the_server_service_as_job_strata(rendered):
    objects = rendered["server-monitoring"]
    service = only(objects, "Service", "server")
    monitor = only(objects, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    assert selector.items() <= service["metadata"]["labels"].items()
    assert service["metadata"]["labels"][monitor["spec"]["jobLabel"]] == "strata", "the alerts select job=strata"
    assert set(monitor["spec"]) <= SERVICE_MONITOR_FIELDS, set(monitor["spec"]) - SERVICE_MONITOR_FIELDS
    (endpoint,) = monitor["spec"]["endpoints"]
    assert set(endpoint) <= ENDPOINT_FIELDS, set(endpoint) - ENDPOINT_FIELDS
    (port,) = service["spec"]["ports"]
    assert endpoint["port"] == port["name"] == "service-port" and endpoint["path"] == "/metrics"
    assert port["targetPort"] == "http"
    assert monitor["spec"]["namespaceSelector"] == {"any": True}
    labelled = helm_template(*COMBINATIONS["server-monitoring"], "serviceMonitor.additionalLabels.release=kps",
                             "prometheusRule.additionalLabels.release=kps")
    assert only(labelled, "ServiceMonitor")["metadata"]["labels"]["release"] == "kps"
    assert only(labelled, "PrometheusRule")["metadata"]["labels"]["release"] == "kps"


# routing a conversation's follow-ups to the replica that parked it

def test_the_service_keeps_a_client_on_one_replica_only_with_client_ip_affinity(rendered):
    plain = only(rendered["server-only"], "Service", "server")["spec"]
    assert plain["sessionAffinity"] == "None" and "sessionAffinityConfig" not in plain
    pinned = only(rendered["server-client-ip"], "Service", "server")["spec"]
    assert pinned["sessionAffinity"] == "ClientIP"
    assert pinned["sessionAffinityConfig"] == {"clientIP": {"timeoutSeconds": 3600}}
    defaulted = only(helm_template(*SERVER_ON, "server.service.sessionAffinity=ClientIP"), "Service", "server")
    assert defaulted["spec"]["sessionAffinityConfig"]["clientIP"]["timeoutSeconds"] == 10800


def ingress_backend(objects: list[dict]) -> tuple[dict, dict]:
    """The Ingress's one rule and path, after checking that it leads to the server Service's port."""
    ingress = only(objects, "Ingress", "server")
    service = only(objects, "Service", "server")
    (rule,) = ingress["spec"]["rules"]
    (path,) = rule["http"]["paths"]
    assert (path["path"], path["pathType"]) == ("/", "Prefix")
    backend = path["backend"]["service"]
    assert backend["name"] == service["metadata"]["name"]
    (port,) = service["spec"]["ports"]
    assert backend["port"] == {"name": port["name"]}
    return ingress, rule


def test_the_ingress_is_off_by_default_and_leads_to_the_server_service(rendered):
    assert not by_kind(rendered["server-only"], "Ingress") and not by_kind(rendered["everything"], "Ingress")
    ingress, rule = ingress_backend(rendered["server-ingress"])
    assert "host" not in rule and "tls" not in ingress["spec"] and "ingressClassName" not in ingress["spec"]
    assert "annotations" not in ingress["metadata"], "no affinity: no hash annotation"
    ingress, rule = ingress_backend(rendered["server-ingress-header"])
    assert rule["host"] == "llm.example.com" and ingress["spec"]["ingressClassName"] == "nginx"
    assert ingress["spec"]["tls"] == [{"secretName": "strata-tls", "hosts": ["llm.example.com"]}]
    proc = run([tool("helm"), "template", "strata", str(CHART), "--set", "server.ingress.enabled=true"], check=False)
    assert proc.returncode != 0 and "server.ingress.enabled needs server.enabled" in proc.stderr, proc.stderr


def test_header_affinity_hashes_the_session_header_in_ingress_nginx(rendered):
    ingress, _ = ingress_backend(rendered["server-ingress-header"])
    assert ingress["metadata"]["annotations"] == {"nginx.ingress.kubernetes.io/upstream-hash-by": "$http_x_session_id"}
    custom, _ = ingress_backend(rendered["server-ingress-custom-header"])  # the Service on port 80: still matched
    assert custom["metadata"]["annotations"]["nginx.ingress.kubernetes.io/upstream-hash-by"] == "$http_x_chat_id"
    nginx = "server.ingress.annotations.nginx\\.ingress\\.kubernetes\\.io"
    mine = only(helm_template(*COMBINATIONS["server-ingress-header"], f"{nginx}/upstream-hash-by=$http_x_tenant",
                              f"{nginx}/proxy-body-size=8m"), "Ingress")
    assert mine["metadata"]["annotations"] == {"nginx.ingress.kubernetes.io/upstream-hash-by": "$http_x_tenant",
                                               "nginx.ingress.kubernetes.io/proxy-body-size": "8m"}, "the user's win"


def test_the_schema_refuses_a_bad_session_affinity_with_a_clear_message():
    proc = run([tool("helm"), "template", "strata", str(CHART), "--set", "server.service.sessionAffinity=Cookie"],
               check=False)
    assert proc.returncode != 0
    assert "/server/service/sessionAffinity" in proc.stderr and "'None', 'ClientIP'" in proc.stderr, proc.stderr


def test_dashboards_are_configmaps_for_the_grafana_sidecar_holding_the_files(rendered):
    maps = by_kind(rendered["everything"], "ConfigMap")
    files = sorted((CHART / "dashboards").glob("*.json"))
    assert len(maps) == len(files) >= 2
    data = {}
    for m in maps:
        assert m["metadata"]["labels"]["grafana_dashboard"] == "1"
        data.update(m["data"])
    assert data == {f.name: f.read_text() for f in files}
    moved = helm_template("dashboards.namespace=monitoring", "dashboards.annotations.grafana_folder=Strata")
    for m in by_kind(moved, "ConfigMap"):
        assert m["metadata"]["namespace"] == "monitoring" and m["metadata"]["annotations"] == {"grafana_folder": "Strata"}


def test_notes_render_for_an_install():
    out = run([tool("helm"), "install", "strata", str(CHART), "--dry-run=client", "--namespace", "llm",
               "--set", "server.enabled=true", "--set", "serviceMonitor.enabled=true"]).stdout
    notes = out[out.index("NOTES:"):]
    assert "kind: StrataDeployment" in notes and "port-forward svc/strata-server" in notes and 'job="strata"' in notes


# values.schema.json

@pytest.mark.parametrize("bad", [
    "server.service.type=Ingress", "image.pullPolicy=Sometimes", "server.enabled=yes", "server.gpus=-1",
    "server.modelCache.type=nfs", "server.replica=2", "serviceMonitor.interval=15", "server.dtype=int4",
    "server.device=tpu", "operator.watchNamespaces={Team_A}", "prometheusRule.runbookBaseUrl=docs",
    "server.service.sessionAffinity=Cookie", "server.service.sessionAffinityTimeoutSeconds=0",
    "server.service.sessionAffinityTimeoutSeconds=86401", "server.ingress.affinity=cookie",
    "server.ingress.sessionHeader=X_Session_Id", "server.ingress.host=LLM.example.com", "server.ingress.hosts=a",
])
def test_schema_rejects_wrong_types_enums_and_unknown_keys(bad):
    proc = run([tool("helm"), "template", "strata", str(CHART), "--set", bad], check=False)
    assert proc.returncode != 0, f"{bad} was accepted"
    assert "schema" in proc.stderr.lower(), proc.stderr


def test_schema_passes_through_kubernetes_blocks(tmp_path):
    values = {"server": {
        "enabled": True,
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [{"key": "nvidia.com/gpu.memory", "operator": "Gt", "values": ["80000"]}]}]}}},
        "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "llm", "effect": "NoExecute",
                         "tolerationSeconds": 60}],
        "startupProbe": {"exec": {"command": ["true"]}, "failureThreshold": 720, "periodSeconds": 5},
        "resources": {"requests": {"cpu": "16", "memory": "256Gi", "ephemeral-storage": "50Gi"}},
        "extraArgs": ["--max-window-tokens", "1024"],
    }, "operator": {"affinity": {"podAntiAffinity": {}}, "env": [{"name": "KOPF_X", "value": "1"}]}}
    objects = helm_template(values=values, tmp_path=tmp_path)
    server = only(objects, "Deployment", "server")
    c = container(server)
    assert c["startupProbe"]["failureThreshold"] == 720
    assert c["resources"]["requests"]["ephemeral-storage"] == "50Gi" and c["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert c["args"][-2:] == ["--max-window-tokens", "1024"]
    assert server["spec"]["template"]["spec"]["affinity"] == values["server"]["affinity"]
    for obj in objects:
        if obj["kind"] not in PROMETHEUS_OPERATOR_KINDS:
            validate_k8s(obj, versions=K8S_VERSIONS[-1:])
