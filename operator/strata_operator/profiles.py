"""Nodes into hardware profiles: which nodes may run a replica, which of them are alike, and what one replica of a
profile gets (the facts autoconfig plans with). Pure functions over `NodeView`s, the records the node index keeps.

A node's GPUs come from its `strata.dev/facts` annotation (the node-facts DaemonSet); its RAM and cores from its
own status (`allocatable`: what pods may use; the annotation's host part was read inside a small container and
describes that container). GPU Feature Discovery's labels name a profile and, where they tell its nodes apart from
every other profile's, pin the profile's pods to it; otherwise the pods are pinned to the node names.
"""

from __future__ import annotations

import hashlib
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from pydantic import BaseModel

from autoconfig.facts import GpuFacts, HostFacts, MachineFacts
from autoconfig.memory import gb
from autoconfig.node import facts_from_annotations
from strata_operator.spec import Spec

GFD_PRODUCT, GFD_COUNT, GFD_MEMORY = "nvidia.com/gpu.product", "nvidia.com/gpu.count", "nvidia.com/gpu.memory"
GFD_LABELS = (GFD_PRODUCT, GFD_COUNT, GFD_MEMORY)
GPU_RESOURCE = "nvidia.com/gpu"
GIB = 2**30


@dataclass(frozen=True)
class NodeView:
    """What the operator keeps of a node (the node index's value)."""
    name: str
    labels: dict[str, str] = field(default_factory=dict)
    facts: MachineFacts | None = None
    allocatable: dict[str, str] = field(default_factory=dict)
    taints: list[dict] = field(default_factory=list)
    unschedulable: bool = False

    @property
    def gpu_count(self) -> int:
        if GPU_RESOURCE in self.allocatable:
            return int(quantity(self.allocatable[GPU_RESOURCE]))
        if self.labels.get(GFD_COUNT, "").isdigit():
            return int(self.labels[GFD_COUNT])
        return len(self.facts.gpus) if self.facts else 0

    @property
    def memory_bytes(self) -> int:
        if "memory" in self.allocatable:
            return int(quantity(self.allocatable["memory"]))
        return self.facts.host.ram_available_bytes if self.facts else 0

    @property
    def cpu_cores(self) -> int:
        if "cpu" in self.allocatable:
            return max(1, int(quantity(self.allocatable["cpu"])))
        return self.facts.host.cpu_cores if self.facts else 1


def node_view(body: dict) -> NodeView:
    meta, spec, status = body.get("metadata", {}), body.get("spec") or {}, body.get("status") or {}
    return NodeView(
        name=meta["name"], labels=dict(meta.get("labels") or {}),
        facts=facts_from_annotations(meta.get("annotations")), allocatable=dict(status.get("allocatable") or {}),
        taints=list(spec.get("taints") or []), unschedulable=bool(spec.get("unschedulable")),
    )


class Profile(BaseModel):
    """Nodes of one kind, and what one replica gets on them."""
    name: str
    nodes: list[str]
    machine: MachineFacts  # one replica's share: its GPUs (numbered as the pod sees them), RAM and cores
    slots: int  # replicas that its nodes hold
    node_term: dict  # a NodeSelectorTerm that pins pods to these nodes
    summary: str
    replicas: int = 0


# ---------------------------------------------------------------------------------------------- eligibility


def eligible(nodes: Iterable[NodeView], spec: Spec) -> tuple[list[NodeView], dict[str, str]]:
    """The nodes a replica may run on, and why each other node may not."""
    ok, skipped = [], {}
    k = spec.gpus_per_replica
    for node in sorted(nodes, key=lambda n: n.name):
        why = _ineligible(node, spec, k)
        if why:
            skipped[node.name] = why
        else:
            ok.append(node)
    return ok, skipped


def _ineligible(node: NodeView, spec: Spec, k: int) -> str | None:
    if node.unschedulable:
        return "cordoned"
    wrong = [key for key, value in spec.node_selector.items() if node.labels.get(key) != value]
    if wrong:
        return f"nodeSelector: {', '.join(f'{key}={spec.node_selector[key]}' for key in wrong)} does not match"
    for taint in node.taints:
        if not tolerates(spec.tolerations, taint):
            return f"taint {taint.get('key')}={taint.get('value', '')}:{taint.get('effect')} is not tolerated"
    if k == 0:
        return None
    if node.facts is None:
        return "no strata.dev/facts annotation (the node-facts DaemonSet writes it when it runs there)"
    if min(node.gpu_count, len(node.facts.gpus)) < k:
        return f"{node.gpu_count} GPU(s), fewer than gpusPerReplica {k}"
    return None


def tolerates(tolerations: list[dict], taint: dict) -> bool:
    """Kubernetes' matching of a taint by tolerations; only taints that keep pods off (NoSchedule, NoExecute)."""
    if taint.get("effect") not in ("NoSchedule", "NoExecute"):
        return True
    for t in tolerations:
        if t.get("effect") and t["effect"] != taint.get("effect"):
            continue
        exists = t.get("operator", "Equal") == "Exists"
        if not t.get("key"):
            if exists:
                return True
            continue
        if t["key"] == taint.get("key") and (exists or t.get("value", "") == taint.get("value", "")):
            return True
    return False


# ---------------------------------------------------------------------------------------------- grouping


def profiles(nodes: Iterable[NodeView], spec: Spec) -> tuple[list[Profile], dict[str, str]]:
    """The hardware profiles among the eligible nodes (sorted by name), and the nodes left out with the reason."""
    ok, skipped = eligible(nodes, spec)
    k = spec.gpus_per_replica
    groups: dict[tuple, list[NodeView]] = {}
    for node in ok:
        groups.setdefault(_signature(node, k), []).append(node)
    names = _names(groups, k)
    triples = {sig: _label_triple(members) for sig, members in groups.items()}
    out = []
    for sig, members in groups.items():
        shares = [replica_machine(n, k, spec) for n in members]
        machine = _least(shares)
        others = [t for s, t in triples.items() if s != sig]
        triple = triples[sig]
        pin_by_labels = k > 0 and triple is not None and triple not in others
        out.append(Profile(
            name=names[sig], nodes=[n.name for n in members], machine=machine,
            slots=sum(node_slots(n, k, spec) for n in members),
            node_term=_labels_term(triple) if pin_by_labels else _names_term(members),
            summary=_summary(members, machine, k),
        ))
    return sorted(out, key=lambda p: p.name), skipped


def _signature(node: NodeView, k: int) -> tuple:
    """What makes two nodes plan alike: the GPUs and links (not their free memory, which varies), RAM, cores."""
    gpus = tuple((g.name, g.vram_total_bytes, g.pcie_gen_max, g.pcie_width, g.pcie_width_max)
                 for g in node.facts.gpus) if k and node.facts else ()
    return gpus, node.gpu_count if k else 0, node.memory_bytes // GIB, node.cpu_cores


def _names(groups: dict[tuple, list[NodeView]], k: int) -> dict[tuple, str]:
    base = {sig: _base_name(members[0], k) for sig, members in groups.items()}
    names = {}
    for sig, name in base.items():
        clash = sum(other == name for other in base.values()) > 1
        names[sig] = f"{name}-{hashlib.sha1(repr(sig).encode()).hexdigest()[:5]}" if clash else name
    return names


def _base_name(node: NodeView, k: int) -> str:
    if k == 0:
        return "cpu"
    product = node.labels.get(GFD_PRODUCT) or (node.facts.gpus[0].name if node.facts and node.facts.gpus else "gpu")
    slug = re.sub(r"[^a-z0-9]+", "-", product.lower()).strip("-")[:30].strip("-") or "gpu"
    return f"{slug}-x{node.gpu_count}"


def _label_triple(members: list[NodeView]) -> tuple | None:
    triples = {tuple(n.labels.get(key) for key in GFD_LABELS) for n in members}
    if len(triples) != 1:
        return None
    (triple,) = triples
    return None if None in triple else triple


def _labels_term(triple: tuple) -> dict:
    return {"matchExpressions": [{"key": key, "operator": "In", "values": [value]}
                                 for key, value in zip(GFD_LABELS, triple)]}


def _names_term(members: list[NodeView]) -> dict:
    return {"matchFields": [{"key": "metadata.name", "operator": "In", "values": sorted(n.name for n in members)}]}


# ---------------------------------------------------------------------------------------------- one replica


def node_slots(node: NodeView, k: int, spec: Spec) -> int:
    """Replicas that one node holds: by its GPUs, and by its RAM where the spec limits a replica's memory."""
    by_gpus = node.gpu_count // k if k else None
    limit = _limit(spec, "memory")
    by_memory = max(1, node.memory_bytes // limit) if limit else None
    counts = [c for c in (by_gpus, by_memory) if c is not None]
    return min(counts) if counts else 1


def replica_machine(node: NodeView, k: int, spec: Spec) -> MachineFacts:
    """What one replica on `node` gets: `k` of its GPUs (the ones with the least free memory and the slowest links,
    renumbered 0..k-1 as the pod sees them) and its share of the RAM and cores."""
    gpus: list[GpuFacts] = []
    if k and node.facts:
        chosen = sorted(node.facts.gpus, key=lambda g: (g.vram_free_bytes, g.link_gbps, g.index))[:k]
        gpus = [g.model_copy(update={"index": i}) for i, g in enumerate(sorted(chosen, key=lambda g: g.index))]
    slots = max(node_slots(node, k, spec), 1)
    ram = node.memory_bytes // slots
    cores = max(1, node.cpu_cores // slots)
    if (limit := _limit(spec, "memory")) is not None:
        ram = min(ram, limit)
    if (limit := _limit(spec, "cpu")) is not None:
        cores = max(1, min(cores, math.ceil(limit)))
    return MachineFacts(gpus=gpus, host=HostFacts(ram_total_bytes=ram, ram_available_bytes=ram, cpu_cores=cores))


def _least(shares: list[MachineFacts]) -> MachineFacts:
    """The facts of a profile: position by position, the least that any of its nodes gives."""
    first = shares[0]
    gpus = [g.model_copy(update={"vram_free_bytes": min(s.gpus[i].vram_free_bytes for s in shares)})
            for i, g in enumerate(first.gpus)]
    host = HostFacts(ram_total_bytes=min(s.host.ram_total_bytes for s in shares),
                     ram_available_bytes=min(s.host.ram_available_bytes for s in shares),
                     cpu_cores=min(s.host.cpu_cores for s in shares))
    return MachineFacts(gpus=gpus, host=host)


def _limit(spec: Spec, resource: str) -> float | None:
    limits = (spec.resources or {}).get("limits") or {}
    return quantity(limits[resource]) if resource in limits else None


def _summary(members: list[NodeView], machine: MachineFacts, k: int) -> str:
    node = members[0]
    nodes = f"{len(members)} node{'s' * (len(members) != 1)}"
    if k and node.facts:
        g = node.facts.gpus[0]
        hardware = f"{node.gpu_count} x {g.name} ({gb(g.vram_total_bytes)}, {g.link})"
        share = f"a replica gets {k} GPU{'s' * (k != 1)}, "
    else:
        hardware, share = f"{node.cpu_cores} cores", "a replica gets "
    return (f"{nodes} of {hardware}, {gb(node.memory_bytes)} of RAM for pods; "
            f"{share}{gb(machine.host.ram_total_bytes)} of RAM and {machine.host.cpu_cores} cores")


# ---------------------------------------------------------------------------------------------- replicas


def distribute(replicas: int, slots: list[int]) -> list[int]:
    """Replicas over profiles in proportion to the replicas each holds (largest remainders, then the larger)."""
    total = sum(slots)
    if not total:
        return [0] * len(slots)
    exact = [replicas * s / total for s in slots]
    out = [math.floor(e) for e in exact]
    order = sorted(range(len(slots)), key=lambda i: (out[i] - exact[i], -slots[i], i))
    for i in order[:replicas - sum(out)]:
        out[i] += 1
    return out


_SUFFIXES = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60, "n": 1e-9, "u": 1e-6,
             "m": 1e-3, "": 1, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}


def quantity(value: str | int | float) -> float:
    """A Kubernetes quantity ("128Gi", "15900m", "4") as a number."""
    match = re.fullmatch(r"\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)([a-zA-Z]*)\s*", str(value))
    if not match or match[2] not in _SUFFIXES:
        raise ValueError(f"{value!r} is not a Kubernetes quantity")
    return float(match[1]) * _SUFFIXES[match[2]]
