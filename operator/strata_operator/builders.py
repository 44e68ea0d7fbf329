"""The children of a `StrataDeployment`, as pure functions: facts and settings in, manifests out.

Per hardware profile, a ConfigMap holding `strata serve`'s config file (autoconfig's settings with the spec's over
them) and a Deployment pinned to the profile's nodes, whose pod template carries the config's hash, so a change of
settings (from the spec or from the nodes' facts) rolls the pods; one Service over all of them, labelled and named
as the chart's ServiceMonitor selects; with `spec.ingress.enabled`, an Ingress to that Service. Owner references
are not set here: the handlers adopt the children.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from autoconfig.rules import Proposal
from strata_operator.profiles import GPU_RESOURCE, Profile
from strata_operator.spec import StrataDeployment

MANAGER = "strata-operator"
CONFIG_DIR, CONFIG_FILE = "/etc/strata", "config.json"
CONFIG_HASH = "strata.dev/config-hash"
PROFILE_LABEL = "strata.dev/profile"
PORT = 8000
METRICS_PORT_NAME = "service-port"  # what the chart's ServiceMonitor scrapes
USER = 10001  # the image's user
PRE_STOP_SECONDS, REQUEST_SECONDS = 15, 120  # as the chart's server.drain


# ---------------------------------------------------------------------------------------------- names, labels


def child_name(sd: StrataDeployment, profile: Profile) -> str:
    """`<resource>-<profile>`, shortened with a hash when it would not leave room for the pods' suffixes."""
    return _short(f"{sd.name}-{profile.name}", 52)


def service_name(sd: StrataDeployment) -> str:
    return _short(sd.name, 63)


def selector_labels(sd: StrataDeployment) -> dict[str, str]:
    """The server pods of one resource, all profiles: the Service's selector and the scale subresource's."""
    return {"app.kubernetes.io/name": "strata", "app.kubernetes.io/instance": _short(sd.name, 63),
            "app.kubernetes.io/component": "server", "app.kubernetes.io/managed-by": MANAGER}


def selector(sd: StrataDeployment) -> str:
    """`status.selector`: the label selector of the pods, as a string (for HPA and KEDA)."""
    return ",".join(f"{k}={v}" for k, v in sorted(selector_labels(sd).items()))


def owned_labels(sd: StrataDeployment) -> dict[str, str]:
    """Every child carries these: how the operator finds what it made."""
    return {"app.kubernetes.io/name": "strata", "app.kubernetes.io/instance": _short(sd.name, 63),
            "app.kubernetes.io/managed-by": MANAGER, "app.kubernetes.io/part-of": "strata"}


def _short(name: str, limit: int) -> str:
    if len(name) <= limit:
        return name
    return f"{name[:limit - 6].rstrip('-')}-{hashlib.sha1(name.encode()).hexdigest()[:5]}"


# ---------------------------------------------------------------------------------------------- ConfigMap


def engine_config(sd: StrataDeployment, proposal: Proposal) -> dict[str, Any]:
    """`strata serve --config`'s content: ServeSettings keys (EngineSettings + host, port, served_model_name)."""
    config = proposal.config(sd.spec.model_path)
    config.update(host="0.0.0.0", port=PORT)
    if sd.spec.served_model_name:
        config["served_model_name"] = sd.spec.served_model_name
    return config


def build_configmap(sd: StrataDeployment, profile: Profile, proposal: Proposal) -> dict:
    text = json.dumps(engine_config(sd, proposal), indent=2, sort_keys=True) + "\n"
    return {
        "apiVersion": "v1", "kind": "ConfigMap",
        "metadata": {"name": child_name(sd, profile), "namespace": sd.namespace,
                     "labels": {**owned_labels(sd), "app.kubernetes.io/component": "config",
                                PROFILE_LABEL: profile.name}},
        "data": {CONFIG_FILE: text},
    }


def config_hash(configmap: dict) -> str:
    return hashlib.sha256(json.dumps(configmap["data"], sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------------- Deployment


def build_deployment(sd: StrataDeployment, profile: Profile, proposal: Proposal, configmap: dict, *,
                     default_image: str) -> dict:
    spec = sd.spec
    name = child_name(sd, profile)
    match = {**selector_labels(sd), PROFILE_LABEL: profile.name}
    env = [{"name": "STRATA_DEVICE", "value": proposal.settings["device"]},  # the image sets cuda; env beats config
           {"name": "STRATA_MODEL_DIR", "value": spec.storage.mount_path}]
    env += [{"name": k, "value": v} for k, v in sorted(proposal.env.items())]
    # the server ends answers still running this long after SIGTERM, before the pod's grace is over
    env.append({"name": "STRATA_SHUTDOWN_GRACE", "value": str(REQUEST_SECONDS - 10)})
    probe = {"httpGet": {"path": "/health", "port": "http"}, "timeoutSeconds": 5}
    container = {
        "name": "server",
        "image": spec.image or default_image,
        "args": ["--config", f"{CONFIG_DIR}/{CONFIG_FILE}", *spec.engine.extra_args],  # the entrypoint: strata serve
        "env": env,
        "ports": [{"name": "http", "containerPort": PORT, "protocol": "TCP"}],
        # an hour to load a model before liveness and readiness begin; /health is 503 while the engine reloads;
        # /live fails only for a hung engine, or one not back 10 minutes after it went away
        "startupProbe": {**probe, "periodSeconds": 10, "failureThreshold": 360},
        "readinessProbe": {**probe, "periodSeconds": 10, "failureThreshold": 3},
        "livenessProbe": {"httpGet": {"path": "/live", "port": "http"}, "timeoutSeconds": 5, "periodSeconds": 30,
                          "failureThreshold": 3},
        "lifecycle": {"preStop": {"exec": {"command": ["sleep", str(PRE_STOP_SECONDS)]}}},
        "resources": _resources(spec.resources, spec.gpus_per_replica),
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
        "volumeMounts": [
            {"name": "models", "mountPath": spec.storage.mount_path},
            {"name": "config", "mountPath": CONFIG_DIR, "readOnly": True},
            {"name": "shm", "mountPath": "/dev/shm"},
            {"name": "tmp", "mountPath": "/tmp"},
        ],
    }
    if spec.image_pull_policy:
        container["imagePullPolicy"] = spec.image_pull_policy
    shm: dict[str, Any] = {"medium": "Memory"}
    if spec.storage.shm_size is not None:
        shm["sizeLimit"] = str(spec.storage.shm_size)
    pod: dict[str, Any] = {
        "automountServiceAccountToken": False,
        "securityContext": {"runAsNonRoot": True, "runAsUser": USER, "runAsGroup": USER, "fsGroup": USER,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "terminationGracePeriodSeconds": PRE_STOP_SECONDS + REQUEST_SECONDS,
        "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
            "nodeSelectorTerms": [profile.node_term]}}},
        "containers": [container],
        "volumes": [
            {"name": "models", **(spec.storage.volume or {"emptyDir": {}})},
            {"name": "config", "configMap": {"name": configmap["metadata"]["name"]}},
            {"name": "shm", "emptyDir": shm},
            {"name": "tmp", "emptyDir": {}},
        ],
    }
    if spec.node_selector:
        pod["nodeSelector"] = dict(spec.node_selector)
    if spec.tolerations:
        pod["tolerations"] = [dict(t) for t in spec.tolerations]
    return {
        "apiVersion": "apps/v1", "kind": "Deployment",
        "metadata": {"name": name, "namespace": sd.namespace,
                     "labels": {**owned_labels(sd), "app.kubernetes.io/component": "server",
                                PROFILE_LABEL: profile.name}},
        "spec": {
            "replicas": profile.replicas,
            "selector": {"matchLabels": match},
            # no surge: a new pod needs GPUs that a full node does not have
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 0, "maxUnavailable": 1}},
            "template": {
                "metadata": {"labels": {**match, "app.kubernetes.io/part-of": "strata"},
                             "annotations": {CONFIG_HASH: config_hash(configmap)}},
                "spec": pod,
            },
        },
    }


def _resources(resources: dict[str, Any], gpus: int) -> dict[str, Any]:
    """The spec's resources with the replica's GPUs as a limit; quantities as strings, as the API returns them."""
    out = {kind: {k: str(v) for k, v in (resources.get(kind) or {}).items()} for kind in ("requests", "limits")}
    out.update({k: v for k, v in resources.items() if k not in out})
    if gpus:
        out["limits"][GPU_RESOURCE] = str(gpus)
    return {k: v for k, v in out.items() if v}


# ---------------------------------------------------------------------------------------------- Service


def build_service(sd: StrataDeployment) -> dict:
    """One Service over every profile's pods: the OpenAI API and /metrics on the port the ServiceMonitor scrapes.
    With monitoring on it carries `app.kubernetes.io/component: server`, which the ServiceMonitor selects. Its
    session affinity is always said: ClientIP keeps a client address on the replica that parked its conversations."""
    spec = sd.spec
    labels = owned_labels(sd)
    if spec.monitoring.enabled:
        labels["app.kubernetes.io/component"] = "server"
    metadata: dict[str, Any] = {"name": service_name(sd), "namespace": sd.namespace, "labels": labels}
    if spec.service.annotations:
        metadata["annotations"] = dict(spec.service.annotations)
    service_spec: dict[str, Any] = {
        "type": spec.service.type,
        "selector": selector_labels(sd),
        "ports": [{"name": METRICS_PORT_NAME, "port": spec.service.port, "targetPort": "http", "protocol": "TCP"}],
        "sessionAffinity": spec.service.session_affinity,
    }
    if spec.service.session_affinity == "ClientIP":
        service_spec["sessionAffinityConfig"] = {
            "clientIP": {"timeoutSeconds": spec.service.session_affinity_timeout_seconds}}
    return {"apiVersion": "v1", "kind": "Service", "metadata": metadata, "spec": service_spec}


# ---------------------------------------------------------------------------------------------- Ingress

HASH_BY = "nginx.ingress.kubernetes.io/upstream-hash-by"


def nginx_header_variable(header: str) -> str:
    """ingress-nginx's variable for a request header, as the chart writes it: X-Session-Id -> $http_x_session_id."""
    return "$http_" + header.lower().replace("-", "_")


def build_ingress(sd: StrataDeployment) -> dict:
    """`spec.ingress`: an Ingress to the Service's port (by name), as the chart's `server.ingress` makes one. With
    header affinity ingress-nginx hashes the session header to choose the replica, so every turn of a conversation
    reaches the replica that parked it; an annotation of the spec's wins over that one."""
    ingress = sd.spec.ingress
    annotations = {HASH_BY: nginx_header_variable(ingress.session_header)} if ingress.affinity == "header" else {}
    annotations.update(ingress.annotations)
    metadata: dict[str, Any] = {"name": service_name(sd), "namespace": sd.namespace,
                                "labels": {**owned_labels(sd), "app.kubernetes.io/component": "server"}}
    if annotations:
        metadata["annotations"] = annotations
    backend = {"service": {"name": service_name(sd), "port": {"name": METRICS_PORT_NAME}}}
    rule: dict[str, Any] = {"http": {"paths": [{"path": ingress.path, "pathType": "Prefix", "backend": backend}]}}
    if ingress.host:
        rule["host"] = ingress.host
    spec: dict[str, Any] = {"rules": [rule]}
    if ingress.class_name:
        spec["ingressClassName"] = ingress.class_name
    if ingress.tls:  # as given; empty fields left out, as the API server leaves them
        spec["tls"] = [{k: v for k, v in t.model_dump(by_alias=True).items() if v} for t in ingress.tls]
    return {"apiVersion": "networking.k8s.io/v1", "kind": "Ingress", "metadata": metadata, "spec": spec}


# Fields a builder leaves out when they must not be there: `Kube.apply` removes them from the live object (a merge
# patch only adds and changes). The API server refuses a sessionAffinityConfig beside sessionAffinity None; an
# Ingress whose affinity went back to none must lose the hash, and one whose TLS went must lose it.
CLEARED_WHEN_ABSENT: dict[str, tuple[tuple[str, ...], ...]] = {
    "Service": (("spec", "sessionAffinityConfig"),),
    "Ingress": (("metadata", "annotations", HASH_BY), ("spec", "tls")),
}
