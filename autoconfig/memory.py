"""Memory arithmetic of a layer split: what a card can give, what a stage costs, where the stage boundaries fall.

Pure functions over facts, no torch; `rules.py` makes the decisions and words the reasons.
"""

from __future__ import annotations

from pydantic import BaseModel

from autoconfig.facts import GpuFacts, HostFacts, ModelFacts

GB = 1e9
GIB = 1 << 30
SLOW_LINK = 0.75  # a card whose host link carries less than this share of the best card's is on a slow link


class NoGpuFit(Exception):
    """The GPUs cannot take the dense weights and state: the CPU path may still serve."""


class StagePlan(BaseModel):
    gpu: int  # NVML index of the card
    layers: tuple[int, int]  # [start, stop)
    capacity_bytes: int  # free VRAM less the reserve
    fixed_bytes: int  # dense weights (+ embedding / head) of its layers
    state_bytes: int  # K/V cells and GDN state of every sequence
    expert_bytes: int  # all routed experts of its layers
    budget_bytes: int  # experts it keeps resident

    @property
    def num_layers(self) -> int:
        return self.layers[1] - self.layers[0]

    @property
    def resident(self) -> float:
        return self.budget_bytes / self.expert_bytes if self.expert_bytes else 1.0


def vram_capacity(gpu: GpuFacts) -> int:
    """Free VRAM less a reserve for the CUDA context, workspaces, graphs and activations (1 GiB + 2 %)."""
    return max(gpu.vram_free_bytes - GIB - gpu.vram_total_bytes // 50, 0)


def ram_capacity(host: HostFacts) -> int:
    """Available RAM less a reserve for the OS, the server and page cache (4 GiB + 10 %)."""
    return max(host.ram_available_bytes - 4 * GIB - host.ram_available_bytes // 10, 0)


def extras_bytes(model: ModelFacts, stage: int, num_stages: int) -> int:
    """Embedding on the first stage, head + MTP on the last (one tensor serves both when tied on one stage)."""
    extra = model.embed_bytes if stage == 0 else 0
    if stage == num_stages - 1:
        head = model.head_bytes - model.embed_bytes if model.tie_embeddings and num_stages == 1 else model.head_bytes
        extra += head + model.mtp_bytes
    return extra


def kv_per_position(model: ModelFacts) -> int:
    return model.state_bytes(None, 1, 1) - model.state_bytes(None, 0, 1)


def link_factors(cards: list[GpuFacts]) -> list[float]:
    """1 for a card on a full-speed host link; less for one whose link carries under SLOW_LINK of the best one's."""
    best = max(g.link_gbps for g in cards)
    return [0.5 + 0.5 * g.link_gbps / best if best and 0 < g.link_gbps < SLOW_LINK * best else 1.0 for g in cards]


def split_layers(model: ModelFacts, cards: list[GpuFacts], capacity: list[int], extras: list[int], context: int,
                 seqs: int) -> list[StagePlan]:
    """Contiguous layer ranges: each card's share of the layers' cost in proportion to what it has left after its
    embedding / head, weighing a layer as dense + state + r x experts (r: the share of experts the GPUs can hold),
    so every stage keeps about the same share of its experts resident. A slow-link card's share is cut when
    experts spill (the link then carries expert uploads)."""
    fixed = [model.dense_bytes[i] + model.state_bytes(range(i, i + 1), context, seqs) for i in range(model.num_layers)]
    experts = sum(model.expert_bytes)
    budgets = [max(c - e, 0) for c, e in zip(capacity, extras)]
    r = min(max((sum(budgets) - sum(fixed)) / experts, 0.0), 1.0) if experts else 0.0
    weights = [f + r * e for f, e in zip(fixed, model.expert_bytes)]
    factors = link_factors(cards) if r < 1 else [1.0] * len(cards)
    shares = [b * f for b, f in zip(budgets, factors)]
    bounds = partition(weights, shares)
    stages = []
    for s, card in enumerate(cards):
        layers = range(bounds[s], bounds[s + 1])
        fixed_s = sum(model.dense_bytes[i] for i in layers) + extras[s]
        state_s = model.state_bytes(layers, context, seqs)
        experts_s = sum(model.expert_bytes[i] for i in layers)
        budget = min(max(capacity[s] - fixed_s - state_s, 0), experts_s)
        stages.append(StagePlan(gpu=card.index, layers=(layers.start, layers.stop), capacity_bytes=capacity[s],
                                fixed_bytes=fixed_s, state_bytes=state_s, expert_bytes=experts_s, budget_bytes=budget))
    return stages


def partition(weights: list[float], shares: list[float]) -> list[int]:
    """Stage boundaries [0, b1, ..., n]: cumulative layer weight as near as can be to the cumulative shares, at
    least one layer per stage."""
    n, k = len(weights), len(shares)
    if k > n:
        raise NoGpuFit(f"{k} cards for {n} layers: a stage needs at least one layer")
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)
    total_share = sum(shares) or k
    bounds, cum = [0], 0.0
    for s in range(k - 1):
        cum += shares[s] if sum(shares) else 1
        target = prefix[-1] * cum / total_share
        lo, hi = bounds[-1] + 1, n - (k - 1 - s)
        bounds.append(min(range(lo, hi + 1), key=lambda j: (abs(prefix[j] - target), j)))
    return bounds + [n]


def gb(n: float) -> str:
    """Bytes for a person: 12.3 GB, or 45 MB below a tenth of a GB."""
    return f"{n / GB:.1f} GB" if abs(n) >= 1e8 or n == 0 else f"{n / 1e6:.0f} MB"
