"""Engine settings from a machine's facts: `facts` (what the machine and the model are), `rules` (pure decisions,
each with its reason), `calibrate` (measure the top candidates here), `node` (facts as a Kubernetes node
annotation), `cli` (`strata autoconfig`). No module imports torch at import time."""

from autoconfig.facts import (
    Facts, GpuFacts, HostFacts, MachineFacts, ModelFacts, model_facts_from_spec, read_machine, read_model,
)
from autoconfig.rules import ImpossibleWish, Proposal, Wishes, candidates, propose

__all__ = [
    "Facts", "GpuFacts", "HostFacts", "MachineFacts", "ModelFacts", "model_facts_from_spec", "read_machine",
    "read_model",
    "ImpossibleWish", "Proposal", "Wishes", "candidates", "propose",
]
