"""A `StrataDeployment` as the operator reads it: the CRD's fields (helm/strata/templates/crd-stratadeployment.yaml)
with the CRD's defaults, so a resource that came through an API server without defaulting reads the same."""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic.alias_generators import to_camel

GROUP, VERSION, PLURAL, KIND = "strata.dev", "v1alpha1", "stratadeployments", "StrataDeployment"
# As the chart's values.schema.json (server.ingress): a DNS name, a leading `*.` for a wildcard; an HTTP header name of
# letters, digits and single dashes (nginx drops a header whose name holds `_`, and names its variable with `_` for `-`)
HOST_PATTERN = r"^(\*\.)?([a-z0-9]([-a-z0-9]*[a-z0-9])?\.)*[a-z0-9]([-a-z0-9]*[a-z0-9])?$|^$"
HEADER_PATTERN = r"^[A-Za-z0-9]+(-[A-Za-z0-9]+)*$"


class _Camel(BaseModel):
    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="ignore", frozen=True,
                              protected_namespaces=())


class Engine(_Camel):
    """Explicit engine settings: each one given replaces what autoconfig would choose."""
    batch: int | None = Field(None, ge=1, le=256)
    batch_groups: int | None = Field(None, ge=1)
    layer_split: str | None = Field(None, pattern=r"^[0-9]+(,[0-9]+)*$")
    trim_stage_weights: bool | None = None
    context: int | None = Field(None, ge=1)
    extra_args: list[str] = Field(default_factory=list)


class Autoconfig(_Camel):
    enabled: bool = True
    expected_concurrency: int | None = Field(None, ge=1, description="conversations one replica serves at once")
    context: int | None = Field(None, ge=1)


class Storage(_Camel):
    mount_path: str = "/models"
    volume: dict[str, Any] | None = None
    shm_size: int | str | None = None


class Service(_Camel):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: int = Field(8000, ge=1, le=65535)
    annotations: dict[str, str] = Field(default_factory=dict)
    # ClientIP: kube-proxy keeps a client address on one replica, the one its conversations are parked on
    session_affinity: Literal["None", "ClientIP"] = "None"
    session_affinity_timeout_seconds: int = Field(10800, ge=1, le=86400)


class IngressTLS(_Camel):
    secret_name: str | None = Field(None, description="the Secret holding the certificate and key")
    hosts: list[str] = Field(default_factory=list, description="the hosts the certificate covers")


class Ingress(_Camel):
    """An Ingress to the Service; with `affinity: header`, ingress-nginx hashes `session_header` to choose the replica,
    so a conversation's follow-ups reach the replica that parked it (the chart's `server.ingress`)."""
    enabled: bool = Field(False, description="make the Ingress; switched off, the operator deletes it")
    class_name: str = Field("", description="the IngressClass; empty, the cluster's default class")
    host: str = Field("", pattern=HOST_PATTERN, description="a DNS name (*. for a wildcard); empty, every host")
    path: str = Field("/", pattern=r"^/", description="the path prefix routed to the Service")
    annotations: dict[str, str] = Field(default_factory=dict, description="added as they are; they win over the hash")
    tls: list[IngressTLS] = Field(default_factory=list, description="the Ingress' TLS, as the chart's")
    affinity: Literal["none", "header"] = Field("none", description="header: ingress-nginx hashes session_header")
    session_header: str = Field("X-Session-Id", description="the request header naming the conversation")

    @field_validator("session_header")
    @classmethod
    def _header_name(cls, value: str) -> str:
        if not re.fullmatch(HEADER_PATTERN, value):
            raise ValueError(f"{value!r} is not an HTTP header name that ingress-nginx can hash: "
                             "letters, digits and single dashes, e.g. X-Session-Id")
        return value


class Monitoring(_Camel):
    enabled: bool = True


class Spec(_Camel):
    model: str = Field(min_length=1)
    served_model_name: str | None = None
    replicas: int = Field(1, ge=0)
    gpus_per_replica: int = Field(1, ge=0)
    engine: Engine = Engine()
    autoconfig: Autoconfig = Autoconfig()
    model_facts: dict[str, Any] | None = None
    image: str | None = None
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] | None = None
    resources: dict[str, Any] = Field(default_factory=dict)
    node_selector: dict[str, str] = Field(default_factory=dict)
    tolerations: list[dict[str, Any]] = Field(default_factory=list)
    storage: Storage = Storage()
    service: Service = Service()
    ingress: Ingress = Ingress()
    monitoring: Monitoring = Monitoring()

    @property
    def model_path(self) -> str:
        """`strata serve`'s model: `default`, an absolute path, or the path relative to the model volume."""
        if self.model == "default" or self.model.startswith("/"):
            return self.model
        return f"{self.storage.mount_path.rstrip('/')}/{self.model}"

    @property
    def wished_context(self) -> int | None:
        return self.engine.context or self.autoconfig.context


class StrataDeployment(_Camel):
    """The resource: its identity and its spec (the status is the operator's to write)."""
    name: str
    namespace: str
    uid: str = ""
    generation: int | None = None
    spec: Spec

    @classmethod
    def from_body(cls, body: dict) -> StrataDeployment:
        """Raises pydantic's ValidationError for a spec the CRD would have refused."""
        meta = body.get("metadata", {})
        return cls(name=meta["name"], namespace=meta.get("namespace") or "default", uid=meta.get("uid", ""),
                   generation=meta.get("generation"), spec=Spec.model_validate(body.get("spec") or {}))
