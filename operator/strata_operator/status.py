"""The status the operator writes: replicas and ready replicas of every profile's Deployment, the selector for the
scale subresource, the settings chosen per profile with autoconfig's reasons, and the conditions Ready, Progressing
and Degraded. Pure: the live Deployments are passed in."""

from __future__ import annotations

from typing import Any

from strata_operator.builders import child_name, selector
from strata_operator.plan import Plan, ProfilePlan
from strata_operator.spec import StrataDeployment


def build_status(sd: StrataDeployment, plan: Plan, deployments: list[dict], old: dict | None, now: str) -> dict:
    """`deployments`: the live Deployments this resource owns (its current profiles' and any left from before)."""
    live = {d["metadata"]["name"]: d for d in deployments}
    replicas = sum(_count(d, "replicas") for d in deployments)
    ready = sum(_count(d, "readyReplicas") for d in deployments)
    status: dict[str, Any] = {
        "replicas": replicas,
        "readyReplicas": ready,
        "selector": selector(sd),
        "profiles": [_profile(sd, p, live) for p in plan.profiles],
        "notes": list(plan.notes),
    }
    if sd.generation is not None:
        status["observedGeneration"] = sd.generation
    rolling = [_rolling(d, p.profile.replicas) if d else f"{name} is not created yet"
               for p in plan.serving for name in [child_name(sd, p.profile)] for d in [live.get(name)]]
    rolling = [r for r in rolling if r]
    want = sd.spec.replicas
    if plan.problem:
        reason, message = plan.problem
        kept = f"; the {len(deployments)} Deployment(s) made before keep running" if deployments else \
            "; nothing was created"
        states = {"Degraded": (True, reason, message + kept),
                  "Progressing": (False, reason, "the spec cannot be served as it is"),
                  "Ready": (False, reason, "the spec cannot be served as it is")}
    else:
        profiles = ", ".join(f"{p.profile.name}: {p.profile.replicas}" for p in plan.serving)
        states = {"Degraded": (False, "Planned", f"replicas per profile: {profiles}"),
                  "Progressing": (True, "RollingOut", "; ".join(rolling)) if rolling else
                  (False, "Complete", "every Deployment has its replicas, updated and ready"),
                  "Ready": (ready >= want, "ReplicasReady" if ready >= want else "ReplicasNotReady",
                            f"{ready} of {want} replicas ready")}
    status["conditions"] = conditions((old or {}).get("conditions") or [], states, sd.generation, now)
    return status


def _profile(sd: StrataDeployment, p: ProfilePlan, live: dict[str, dict]) -> dict:
    entry: dict[str, Any] = {"name": p.profile.name, "nodes": p.profile.nodes, "hardware": p.profile.summary}
    if p.proposal is None:
        entry.update(replicas=0, error=p.error, reasons=[])
        return entry
    name = child_name(sd, p.profile)
    s = p.proposal
    entry.update(
        replicas=p.profile.replicas,
        readyReplicas=_count(live.get(name), "readyReplicas"),
        deployment=name,
        settings={k: v for k, v in s.settings.items() if v is not None},
        reasons=[f"{k} {why}" for k, why in s.reasons.items()] + [f"note: {n}" for n in s.notes],
    )
    if s.env:
        entry["env"] = dict(s.env)
    return entry


def _count(deployment: dict | None, key: str) -> int:
    return int(((deployment or {}).get("status") or {}).get(key) or 0)


def _rolling(d: dict, want: int) -> str | None:
    """Why a Deployment is still rolling, or None when it has `want` replicas, updated and ready."""
    name, status = d["metadata"]["name"], d.get("status") or {}
    generation, seen = d["metadata"].get("generation"), status.get("observedGeneration")
    if generation is not None and (seen is None or seen < generation):
        return f"{name}: the Deployment controller has not seen generation {generation} yet"
    updated, ready, total = (int(status.get(k) or 0) for k in ("updatedReplicas", "readyReplicas", "replicas"))
    if updated < want or ready < want or total > want:
        return f"{name}: {updated} updated, {ready} ready, {total} in all of {want}"
    return None


def conditions(old: list[dict], states: dict[str, tuple[bool, str, str]], generation: int | None,
               now: str) -> list[dict]:
    """Conditions in a stable order; a condition keeps its lastTransitionTime while its status does not change."""
    before = {c.get("type"): c for c in old}
    out = []
    for kind in ("Ready", "Progressing", "Degraded"):
        value, reason, message = states[kind]
        status = "True" if value else "False"
        previous = before.get(kind)
        since = previous["lastTransitionTime"] if previous and previous.get("status") == status and \
            previous.get("lastTransitionTime") else now
        condition = {"type": kind, "status": status, "reason": reason, "message": message,
                     "lastTransitionTime": since}
        if generation is not None:
            condition["observedGeneration"] = generation
        out.append(condition)
    return out
