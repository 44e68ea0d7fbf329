"""The kopf handlers: short, each one calling `reconcile`, which plans (pure), builds (pure), adopts and applies the
children, deletes the ones no plan wants, and returns the status.

- nodes are kept in a kopf index (`strata_nodes`), never listed per event;
- create, update and resume reconcile at once; a timer reconciles every `RESYNC_SECONDS` (a change of the nodes'
  facts, the Deployments' readiness), writing only what changed;
- delete removes the children (unless the resource is deleted with `--cascade=orphan`); owner references make the
  garbage collector do the same;
- `kopf run --liveness=...` serves the liveness endpoint; the probe below adds the node count to it.
"""

from __future__ import annotations

import datetime
import logging
import os
import threading
from typing import Any

import kopf
from pydantic import ValidationError

from strata_operator import builders
from strata_operator.kube import Kube
from strata_operator.plan import Plan, plan
from strata_operator.profiles import NodeView, node_view
from strata_operator.spec import GROUP, PLURAL, VERSION, StrataDeployment
from strata_operator.status import build_status

RESOURCE = (GROUP, VERSION, PLURAL)
RESYNC_SECONDS = float(os.environ.get("STRATA_OPERATOR_RESYNC_SECONDS", "10"))
DEFAULT_IMAGE = "strata:latest"  # when neither the resource nor $STRATA_OPERATOR_IMAGE names one
FINALIZER = "strata.dev/operator"
CHILD_KINDS = ("Deployment", "ConfigMap", "Service", "Ingress")

_kube: Kube | None = None
_locks: dict[tuple[str, str], threading.Lock] = {}
_applied: dict[str, int] = {}  # the newest generation reconciled, per resource uid
_locks_guard = threading.Lock()


def kube() -> Kube:
    global _kube
    if _kube is None:
        _kube = Kube()
    return _kube


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    settings.persistence.finalizer = FINALIZER
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix="strata.dev")
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix="strata.dev")
    settings.watching.server_timeout = 600  # restart watches every 10 minutes rather than trusting them forever
    # a deletion waits for a running timer to finish before the finalizer goes: check every second, not minute
    settings.background.cancellation_polling = 1
    settings.posting.level = logging.INFO


@kopf.index("", "v1", "nodes")
def strata_nodes(body: kopf.Body, name: str, **_: Any) -> dict[str, NodeView]:
    return {name: node_view(dict(body))}


@kopf.on.probe(id="nodes")
def nodes_seen(strata_nodes: kopf.Index, **_: Any) -> int:
    return len(strata_nodes)


@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE)
@kopf.on.resume(*RESOURCE)
def reconcile_on_change(body: kopf.Body, patch: kopf.Patch, strata_nodes: kopf.Index, logger: logging.Logger,
                        **_: Any) -> None:
    _write_status(body, patch, reconcile(dict(body), _nodes(strata_nodes), logger, announce=True))


@kopf.timer(*RESOURCE, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS)
def reconcile_on_timer(body: kopf.Body, patch: kopf.Patch, strata_nodes: kopf.Index, logger: logging.Logger,
                       **_: Any) -> None:
    _write_status(body, patch, reconcile(dict(body), _nodes(strata_nodes), logger, announce=False))


@kopf.on.delete(*RESOURCE)
def delete_children(meta: kopf.Meta, logger: logging.Logger, **_: Any) -> None:
    namespace, name, uid = meta["namespace"], meta["name"], meta["uid"]
    with _locks_guard:
        _applied.pop(uid, None)
    if "orphan" in (meta.get("finalizers") or []):  # kubectl delete --cascade=orphan: leave them
        logger.info("deleted with orphan propagation: the children stay")
        return
    labels = builders.owned_labels(StrataDeployment(name=name, namespace=namespace, spec={"model": "-"}))
    with _lock(namespace, name):
        for kind in CHILD_KINDS:
            for child in _call(kube().owned, kind, namespace, labels, uid):
                if _call(kube().delete, kind, namespace, child["metadata"]["name"]):
                    logger.info(f"deleted {kind} {child['metadata']['name']}")
    with _locks_guard:
        _locks.pop((namespace, name), None)


# ---------------------------------------------------------------------------------------------- reconcile


def reconcile(body: dict, nodes: list[NodeView], logger: logging.Logger, *, announce: bool) -> dict | None:
    """Bring the children in line with the resource and the nodes; return the status to write (None: the body is
    older than one already reconciled, e.g. a timer that waited while an update was applied)."""
    meta = body["metadata"]
    try:
        sd = StrataDeployment.from_body(body)
    except ValidationError as e:
        sd = StrataDeployment(name=meta["name"], namespace=meta.get("namespace", "default"), uid=meta.get("uid", ""),
                              generation=meta.get("generation"), spec={"model": "-"})
        the_plan = Plan(profiles=[], problem=("InvalidSpec", f"the spec is not valid: {e.errors()[0]['msg']} at "
                                                             f"{'.'.join(map(str, e.errors()[0]['loc']))}"))
    else:
        the_plan = plan(sd, nodes)
    key = (sd.namespace, sd.name)
    with _lock(*key):
        if sd.generation is not None:
            if sd.generation < _applied.get(sd.uid, 0):
                return None
            _applied[sd.uid] = sd.generation
        if the_plan.problem is None:
            _apply(sd, the_plan, body, logger)
        deployments = _call(kube().owned, "Deployment", sd.namespace, builders.owned_labels(sd), sd.uid)
    status = build_status(sd, the_plan, deployments, body.get("status"), _now())
    if announce:
        _announce(body, the_plan, logger)
    return status


def _apply(sd: StrataDeployment, the_plan: Plan, owner: dict, logger: logging.Logger) -> None:
    image = os.environ.get("STRATA_OPERATOR_IMAGE") or DEFAULT_IMAGE
    wanted = []
    for p in the_plan.serving:
        configmap = builders.build_configmap(sd, p.profile, p.proposal)
        wanted += [configmap, builders.build_deployment(sd, p.profile, p.proposal, configmap, default_image=image)]
    wanted.append(builders.build_service(sd))
    if sd.spec.ingress.enabled:
        wanted.append(builders.build_ingress(sd))
    for obj in wanted:
        kopf.adopt(obj, owner=owner)
        _, action = _call(kube().apply, obj)
        if action != "unchanged":
            logger.info(f"{action} {obj['kind']} {obj['metadata']['name']}")
    keep = {(o["kind"], o["metadata"]["name"]) for o in wanted}
    # children no longer wanted: profiles that are gone (nodes removed, facts changed), an Ingress switched off
    gone = {"Deployment": "its profile is gone", "ConfigMap": "its profile is gone", "Ingress": "ingress is off"}
    for kind, why in gone.items():
        for child in _call(kube().owned, kind, sd.namespace, builders.owned_labels(sd), sd.uid):
            if (kind, child["metadata"]["name"]) not in keep:
                _call(kube().delete, kind, sd.namespace, child["metadata"]["name"])
                logger.info(f"deleted {kind} {child['metadata']['name']}: {why}")


def _announce(body: dict, the_plan: Plan, logger: logging.Logger) -> None:
    if the_plan.problem:
        reason, message = the_plan.problem
        logger.warning(f"{reason}: {message}")
        kopf.warn(body, reason=reason, message=message[:1000])
    for p in the_plan.profiles:
        if p.error:
            kopf.warn(body, reason="ProfileCannotServe", message=f"{p.profile.name}: {p.error}"[:1000])


def _write_status(body: kopf.Body, patch: kopf.Patch, status: dict | None) -> None:
    """Only what changed: an unchanged status is not written again."""
    if status is None:
        return
    old = dict(body.get("status") or {})
    changed = {k: v for k, v in status.items() if old.get(k) != v}
    if changed:
        patch.status.update(changed)


def _nodes(index: kopf.Index) -> list[NodeView]:
    return [view for store in index.values() for view in store]


def _call(fn, *args):
    """An API call; a failure is retried by kopf later (an unreachable or overloaded API server is temporary)."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError

    try:
        return fn(*args)
    except ApiException as e:
        if e.status in (400, 403, 422):  # a manifest or a permission the operator got wrong: say so, retry slowly
            raise kopf.TemporaryError(f"{fn.__name__}: {e.status} {e.reason}: {e.body}", delay=60) from e
        raise kopf.TemporaryError(f"{fn.__name__}: {e.status} {e.reason}", delay=5) from e
    except HTTPError as e:
        raise kopf.TemporaryError(f"{fn.__name__}: {e}", delay=5) from e


def _lock(namespace: str, name: str) -> threading.Lock:
    with _locks_guard:
        return _locks.setdefault((namespace, name), threading.Lock())


def _now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
