"""From a resource and the nodes to a plan: per hardware profile, the engine settings (autoconfig's proposal with the
spec's explicit settings over it, each with its reason) and its share of the replicas; or why nothing can be made.
Pure: no API calls."""

from __future__ import annotations

from collections.abc import Iterable

from pydantic import BaseModel

from autoconfig.facts import Facts, ModelFacts
from autoconfig.rules import ImpossibleWish, Proposal, Wishes, propose
from strata_operator.modelfacts import BadModelFacts, model_facts
from strata_operator.profiles import NodeView, Profile, distribute, profiles
from strata_operator.spec import Spec, StrataDeployment

# spec.engine's fields and the EngineSettings keys they set
EXPLICIT = {"batch": "batch", "batch_groups": "batchGroups", "layer_split": "layerSplit",
            "trim_stage_weights": "trimStageWeights", "max_cells": "context"}
_ENGINE_FIELD = {"batch": "batch", "batch_groups": "batch_groups", "layer_split": "layer_split",
                 "trim_stage_weights": "trim_stage_weights", "max_cells": "context"}


class ProfilePlan(BaseModel):
    profile: Profile
    proposal: Proposal | None = None  # None: this profile cannot serve the spec (`error` says why)
    error: str | None = None


class Plan(BaseModel):
    profiles: list[ProfilePlan]
    problem: tuple[str, str] | None = None  # (reason, message): nothing can be made, the spec is not served
    notes: list[str] = []
    skipped_nodes: dict[str, str] = {}

    @property
    def serving(self) -> list[ProfilePlan]:
        return [p for p in self.profiles if p.proposal is not None]


def plan(sd: StrataDeployment, nodes: Iterable[NodeView]) -> Plan:
    spec = sd.spec
    invalid = _invalid(spec)
    if invalid:
        return Plan(profiles=[], problem=("InvalidSpec", invalid))
    try:
        model, source = model_facts(spec)
    except BadModelFacts as e:
        return Plan(profiles=[], problem=("InvalidSpec", str(e)))
    found, skipped = profiles(nodes, spec)
    notes = [f"model facts: {source}"] if spec.autoconfig.enabled else []
    if not found:
        why = "; ".join(f"{name}: {reason}" for name, reason in skipped.items()) or "the cluster has no nodes"
        return Plan(profiles=[], problem=("NoEligibleNodes", f"no node can run a replica ({why})"),
                    notes=notes, skipped_nodes=skipped)
    plans = [plan_profile(spec, p, model, source) for p in found]
    serving = [p for p in plans if p.proposal is not None]
    if not serving:
        why = "; ".join(f"{p.profile.name}: {p.error}" for p in plans)
        return Plan(profiles=plans, problem=("DoesNotFit", f"{spec.model} cannot be served on any node ({why})"),
                    notes=notes, skipped_nodes=skipped)
    for p, n in zip(serving, distribute(spec.replicas, [p.profile.slots for p in serving])):
        p.profile.replicas = n
    room = sum(p.profile.slots for p in serving)
    if spec.replicas > room:
        notes.append(f"{spec.replicas} replicas are asked, the eligible nodes hold {room}: the rest stay Pending")
    return Plan(profiles=plans, notes=notes, skipped_nodes=skipped)


def _invalid(spec: Spec) -> str | None:
    if spec.engine.layer_split:
        stages = len(spec.engine.layer_split.split(","))
        if stages > max(spec.gpus_per_replica, 1) or (stages > 1 and spec.gpus_per_replica == 0):
            return (f"engine.layerSplit {spec.engine.layer_split} has {stages} stages, but a replica gets "
                    f"{spec.gpus_per_replica} GPU(s): one stage per GPU")
    return None


def plan_profile(spec: Spec, profile: Profile, model: ModelFacts | None, source: str = "") -> ProfilePlan:
    """The settings for one profile: autoconfig's (when it is on and the model's facts are known), then the spec's."""
    if spec.autoconfig.enabled and model is not None:
        wishes = Wishes(context=spec.wished_context, concurrency=spec.autoconfig.expected_concurrency or 1)
        e = spec.engine
        forced = dict(batch=e.batch, groups=e.batch_groups,
                      num_gpus=len(e.layer_split.split(",")) if e.layer_split else None)
        try:
            proposal = propose(Facts(machine=profile.machine, model=model), wishes, **forced)
        except ImpossibleWish as err:
            return ProfilePlan(profile=profile, error=str(err))
        used, k = len(proposal.stages), spec.gpus_per_replica
        if 0 < used < k:
            idle = "the other one stays" if k - used == 1 else f"the other {k - used} stay"
            proposal.notes.append(f"the model fits {used} of the replica's {k} GPUs, so {idle} idle: "
                                  f"gpusPerReplica {used} would let these nodes hold more replicas")
    else:
        proposal = _without_autoconfig(spec, model, source)
    return ProfilePlan(profile=profile, proposal=_explicit(spec, proposal))


def _without_autoconfig(spec: Spec, model: ModelFacts | None, source: str) -> Proposal:
    why = "autoconfig is off (spec.autoconfig.enabled)" if not spec.autoconfig.enabled else \
        f"autoconfig needs the model's facts: {source}"
    k = spec.gpus_per_replica
    device = "cuda" if k else "cpu"
    p = Proposal(settings={"device": device}, reasons={})
    p.reasons["device"] = (f"{device}: the replica's {'first GPU' if k else 'CPU'}" +
                           (f" (of its {k}; engine.layerSplit spreads stages over more)" if k > 1 else "") +
                           f"; {why}, so every other setting is the engine's default unless spec.engine sets it")
    return p


def _explicit(spec: Spec, proposal: Proposal) -> Proposal:
    """The proposal with spec.engine's settings over it."""
    p = proposal.model_copy(deep=True)
    for key, field in _ENGINE_FIELD.items():
        value = getattr(spec.engine, field)
        if value is not None:
            p.settings[key] = value
            p.reasons[key] = f"{_show(value)}: as spec.engine.{EXPLICIT[key]} says"
    return p


def _show(value) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)
