"""Which routed experts stay on a stage's device, and the split of a layer's experts between device and host.

A stage's budget (`--expert-budget-gb`, its share) is divided equally between its MoE layers: each keeps
n = floor(budget / (MoE layers x one expert's bytes)) experts resident (at most all of them), the same n in
every layer. Which n: the lowest expert ids. There is no usage profile to rank them by, and a trained router
spreads tokens over its experts (the load-balancing loss asks it to), so any fixed choice of n serves about
n/E of the pairs; a hotness profile would replace `chosen` below, nothing else.

A stage whose budget holds all of its experts keeps every layer as it was (one stacked tensor of E experts,
no map, no pool): only stages short of room pay for the pool.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.model.spec import ModelSpec
from strata.quant.packed import PackedWeight

Tensors = dict[str, torch.Tensor]


def expert_bytes(spec: ModelSpec, dtype_bytes: int) -> int:
    """One routed expert's gate, up and down weights."""
    return 3 * spec.moe.expert_dim * spec.hidden_size * dtype_bytes if spec.moe else 0


@dataclass(frozen=True)
class StageResidency:
    """The routed experts of one stage's MoE layers: which ids of each layer stay on the device."""

    device: torch.device
    num_experts: int  # per MoE layer
    expert_bytes: int  # one expert as the device holds it (packed, for weights kept quantized; else the dtype's)
    resident: dict[int, tuple[int, ...]]  # MoE layer -> resident expert ids, ascending
    host_expert_bytes: int  # one expert in host RAM, counted at the dtype's size (the pool holds at most that)

    @property
    def per_layer(self) -> int:
        """Experts resident in each MoE layer (the same in all of them)."""
        return min((len(ids) for ids in self.resident.values()), default=self.num_experts)

    @property
    def pooled(self) -> bool:
        """Some experts stay in host RAM: the stage's MoE layers run with the CPU pool."""
        return any(len(ids) < self.num_experts for ids in self.resident.values())

    @property
    def device_bytes(self) -> int:
        return sum(len(ids) for ids in self.resident.values()) * self.expert_bytes

    @property
    def host_bytes(self) -> int:
        return sum(self.num_experts - len(ids) for ids in self.resident.values()) * self.host_expert_bytes

    @property
    def fraction(self) -> float:
        """The share of the stage's routed experts on its device (1.0 with no MoE layer: none is missing)."""
        total = self.num_experts * len(self.resident)
        return sum(len(ids) for ids in self.resident.values()) / total if total else 1.0

    def layer_ids(self) -> dict[int, tuple[int, ...]] | None:
        """The resident ids of the layers that keep only some experts, or None when every expert fits."""
        return {i: ids for i, ids in self.resident.items() if len(ids) < self.num_experts} or None


def chosen(num_experts: int, count: int) -> tuple[int, ...]:
    """Which `count` experts of a layer stay resident: the lowest ids (see the module docstring)."""
    return tuple(range(min(count, num_experts)))


def plan_residency(spec: ModelSpec, layers: range, device: torch.device, budget_bytes: float | None,
                   dtype_bytes: int, packed_bytes: int | None = None) -> StageResidency:
    """The residency of one stage's MoE layers under `budget_bytes` (None: no budget, every expert resident).
    `packed_bytes`: one expert's bytes as the device keeps it when its weights stay quantized (None: plain, at
    `dtype_bytes` a value); the budget counts experts at that size."""
    moe_layers = [i for i in layers if spec.layers[i].mlp == "moe"]
    e = spec.moe.num_experts if spec.moe else 0
    plain = expert_bytes(spec, dtype_bytes)
    size = packed_bytes or plain
    count = e
    if budget_bytes is not None and moe_layers:  # (a millionth of an expert forgives GB -> bytes rounding)
        count = min(e, int(budget_bytes / (len(moe_layers) * size) + 1e-6))
    return StageResidency(device, e, size, {i: chosen(e, count) for i in moe_layers}, plain)


def split_experts(gate_up: torch.Tensor | PackedWeight, down: torch.Tensor | PackedWeight, resident: tuple[int, ...],
                  device: torch.device) -> tuple[Tensors, Tensors]:
    """A layer's stacked experts (gate_up [E, 2I, H], down [E, H, I], plain or packed, on the host or anywhere) split into
    what its device holds (`experts_gate_up` / `experts_down` of the resident experts only, and `expert_slot`
    [E] int32: each global id's resident slot, or the resident count M for an expert not held) and what stays
    in host RAM (`gate_up`, `down` of the other experts, `ids` [E - M] int64 their global ids, ascending)."""
    e = gate_up.shape[0]
    keep = torch.tensor(resident, dtype=torch.int64)
    held = torch.zeros(e, dtype=torch.bool)
    held[keep] = True
    rest = torch.arange(e)[~held]
    slot = torch.full((e,), len(resident), dtype=torch.int32)
    slot[keep] = torch.arange(len(resident), dtype=torch.int32)
    take = lambda w, ids: w.index(ids) if isinstance(w, PackedWeight) else w.index_select(0, ids.to(w.device))  # noqa: E731
    on_device = {
        "experts_gate_up": take(gate_up, keep).to(device).contiguous(),
        "experts_down": take(down, keep).to(device).contiguous(),
        "expert_slot": slot.to(device),
    }
    on_host = {
        "gate_up": take(gate_up, rest).to("cpu").contiguous(),
        "down": take(down, rest).to("cpu").contiguous(),
        "ids": rest,
    }
    return on_device, on_host


def residency_by_device(spec: ModelSpec, stages) -> dict[str, float]:
    """Per device (its name, e.g. "cuda:0" or "cpu"): the share of its stages' routed experts held on it, read
    from the loaded weights. A device whose stages have no MoE layer reports 1.0: no expert of it is missing."""
    held: dict[str, list[int]] = {}
    for stage in stages:
        counts = held.setdefault(str(stage.device), [0, 0])
        for i, w in stage.weights.layers.items():
            if spec.layers[i].mlp == "moe" and "experts_gate_up" in w:
                counts[0] += w["experts_gate_up"].shape[0]
                counts[1] += spec.moe.num_experts
    return {device: (resident / total if total else 1.0) for device, (resident, total) in held.items()}


def place_experts(weights, resident: dict[int, tuple[int, ...]] | None, device: torch.device):
    """Weights loaded whole (benchmarks' random weights, weights handed to `Engine`) split as the loader splits
    a checkpoint: a new `StageWeights` whose `resident` layers keep only those experts on `device` and the rest
    in `offloaded`. The given object is left as it was (it may be shared)."""
    from dataclasses import replace

    if not resident:
        return weights
    layers, offloaded = dict(weights.layers), dict(weights.offloaded)
    for i, ids in resident.items():
        w = dict(layers[i])
        on_device, offloaded[i] = split_experts(w.pop("experts_gate_up"), w.pop("experts_down"), ids, device)
        layers[i] = w | on_device
    return replace(weights, layers=layers, offloaded=offloaded)
