"""The few API calls the operator makes, on plain dicts, through the `kubernetes` client (synchronous: kopf runs
the handlers in threads). `apply` creates a child or merge-patches it when it differs from what is wanted (and
removes the fields that `builders.CLEARED_WHEN_ABSENT` says must go when the wanted object lacks them), and does
nothing when it does not, so a reconcile that changes nothing writes nothing."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from strata_operator.builders import CLEARED_WHEN_ABSENT, MANAGER

MERGE_PATCH = "application/merge-patch+json"


class Kube:
    """ConfigMaps, Services, Deployments and Ingresses in a namespace, read and written as dicts."""

    def __init__(self, api_client=None):
        from kubernetes import client

        self.client = api_client or client.ApiClient(_configuration())
        core, apps = client.CoreV1Api(self.client), client.AppsV1Api(self.client)
        networking = client.NetworkingV1Api(self.client)
        self._calls: dict[str, dict[str, Callable]] = {
            "ConfigMap": dict(read=core.read_namespaced_config_map, create=core.create_namespaced_config_map,
                              patch=core.patch_namespaced_config_map, delete=core.delete_namespaced_config_map,
                              list=core.list_namespaced_config_map),
            "Service": dict(read=core.read_namespaced_service, create=core.create_namespaced_service,
                            patch=core.patch_namespaced_service, delete=core.delete_namespaced_service,
                            list=core.list_namespaced_service),
            "Deployment": dict(read=apps.read_namespaced_deployment, create=apps.create_namespaced_deployment,
                               patch=apps.patch_namespaced_deployment, delete=apps.delete_namespaced_deployment,
                               list=apps.list_namespaced_deployment),
            "Ingress": dict(read=networking.read_namespaced_ingress, create=networking.create_namespaced_ingress,
                            patch=networking.patch_namespaced_ingress, delete=networking.delete_namespaced_ingress,
                            list=networking.list_namespaced_ingress),
        }

    def read(self, kind: str, namespace: str, name: str) -> dict | None:
        from kubernetes.client.exceptions import ApiException

        try:
            return _raw(self._calls[kind]["read"](name, namespace, _preload_content=False))
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def apply(self, obj: dict) -> tuple[dict, str]:
        """Make the live object hold `obj`: ("created" | "patched" | "unchanged", with the live object)."""
        from kubernetes.client.exceptions import ApiException

        kind, meta = obj["kind"], obj["metadata"]
        calls = self._calls[kind]
        live = self.read(kind, meta["namespace"], meta["name"])
        if live is None:
            try:
                return _raw(calls["create"](meta["namespace"], obj, field_manager=MANAGER,
                                            _preload_content=False)), "created"
            except ApiException as e:
                if e.status != 409:  # made meanwhile (another handler of the same resource): patch it below
                    raise
                live = self.read(kind, meta["namespace"], meta["name"]) or {}
        stale = [path for path in CLEARED_WHEN_ABSENT.get(kind, ()) if _at(live, path) is not None
                 and _at(obj, path) is None]
        if contains(live, obj) and not stale:
            return live, "unchanged"
        patch = obj
        if stale:  # null removes a field in a merge patch (RFC 7386)
            patch = json.loads(json.dumps(obj))
            for path in stale:
                node = patch
                for key in path[:-1]:
                    node = node.setdefault(key, {})
                node[path[-1]] = None
        patched = calls["patch"](meta["name"], meta["namespace"], patch, field_manager=MANAGER,
                                 _content_type=MERGE_PATCH, _preload_content=False)
        return _raw(patched), "patched"

    def owned(self, kind: str, namespace: str, labels: dict[str, str], owner_uid: str) -> list[dict]:
        """The objects of `kind` with these labels whose controller is the owner `owner_uid`."""
        selector = ",".join(f"{k}={v}" for k, v in sorted(labels.items()))
        items = _raw(self._calls[kind]["list"](namespace, label_selector=selector, _preload_content=False))["items"]
        return [o for o in items if _has_labels(o, labels) and owner_uid and _controlled_by(o, owner_uid)]

    def delete(self, kind: str, namespace: str, name: str) -> bool:
        """Delete it if it is there (True) or not (False)."""
        from kubernetes.client.exceptions import ApiException

        try:
            self._calls[kind]["delete"](name, namespace, _preload_content=False)
            return True
        except ApiException as e:
            if e.status == 404:
                return False
            raise


def contains(live: Any, wanted: Any) -> bool:
    """Whether `live` holds everything `wanted` says: dicts may have more keys (the server's defaults), lists must
    have as many items, each holding the wanted one."""
    if isinstance(wanted, dict):
        return isinstance(live, dict) and all(k in live and contains(live[k], v) for k, v in wanted.items())
    if isinstance(wanted, list):
        return isinstance(live, list) and len(live) == len(wanted) and all(map(contains, live, wanted))
    return live == wanted


def _at(obj: Any, path: tuple[str, ...]) -> Any:
    for key in path:
        if not isinstance(obj, dict):
            return None
        obj = obj.get(key)
    return obj


def _controlled_by(obj: dict, uid: str) -> bool:
    refs = obj.get("metadata", {}).get("ownerReferences") or []
    return any(ref.get("uid") == uid and ref.get("controller") for ref in refs)


def _has_labels(obj: dict, labels: dict[str, str]) -> bool:
    have = obj.get("metadata", {}).get("labels") or {}
    return all(have.get(k) == v for k, v in labels.items())


def _raw(response) -> dict:
    return json.loads(response.data)


def _configuration():
    """In a pod, its service account; elsewhere, the kubeconfig ($KUBECONFIG or ~/.kube/config)."""
    import os

    from kubernetes import client, config

    configuration = client.Configuration()
    try:
        config.load_incluster_config(client_configuration=configuration)
    except config.ConfigException:
        path = os.environ.get("KUBECONFIG", "").split(os.pathsep)[0] or None
        config.load_kube_config(config_file=path, client_configuration=configuration)
    return configuration
