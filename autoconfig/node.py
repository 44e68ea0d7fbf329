"""A Kubernetes node's facts as an annotation: what GPU Feature Discovery does not publish (PCIe links, free VRAM,
host RAM), written by `strata autoconfig facts --annotate-node` from a DaemonSet and read back by the operator."""

from __future__ import annotations

import json
import os

from autoconfig.facts import MachineFacts

ANNOTATION = "strata.dev/facts"


def node_patch(machine: MachineFacts) -> dict:
    """The merge patch that sets the annotation (compact JSON of the machine's facts)."""
    return {"metadata": {"annotations": {ANNOTATION: machine.model_dump_json()}}}


def facts_from_annotations(annotations: dict[str, str] | None) -> MachineFacts | None:
    """The machine facts a node carries, or None when it has no (readable) annotation."""
    text = (annotations or {}).get(ANNOTATION)
    if not text:
        return None
    try:
        return MachineFacts.model_validate(json.loads(text))
    except ValueError:
        return None


def annotate_node(machine: MachineFacts, node_name: str | None = None) -> str:
    """Patch the annotation onto the node named `node_name` (default: $NODE_NAME, set from the downward API)."""
    node_name = node_name or os.environ.get("NODE_NAME")
    if not node_name:
        raise RuntimeError("--annotate-node needs the node's name in $NODE_NAME (env valueFrom fieldRef spec.nodeName)")
    try:
        from kubernetes import client, config
    except ImportError:
        raise RuntimeError("--annotate-node needs the `kubernetes` package: pip install kubernetes") from None
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()
    client.CoreV1Api().patch_node(node_name, node_patch(machine))
    return node_name
