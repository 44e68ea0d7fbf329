"""Hot residency (`--expert-residency hot`): the experts a layer keeps on its device follow the traffic.

Each pooled layer's `ExpertPool` counts the routed pairs of every expert of its layer: the pool already receives
every row's expert ids on the host, so counting costs no device work. Every `REFRESH_WINDOWS` windows the engine
(`Engine.refresh_experts`) compares each layer's counts, halved at each refresh so recent traffic weighs more,
and swaps up to `max_swaps` experts: the hottest expert in host RAM takes the device slot of the coldest resident
one when it was routed at least `margin` times as often; the cold one's weights take the host slot the hot one
left. A swap copies one expert each way between windows (queued on the stage's stream after the windows before
it) and rewrites both maps in place (the device's `expert_slot`, the pool's `index`), so captured graphs stay
valid.

Arithmetic: a pair is computed by the device's kernels or by the CPU pool, which round differently, so after a
swap a row's output can change in its last bits, and a greedy token can differ where two logits nearly tie.
Batched output still equals solo output for a given resident set. With `--expert-residency fixed` (the default:
the lowest ids, never moved) every run repeats exactly.
"""

from __future__ import annotations

import torch

from strata.experts.pool import ExpertPool

Tensors = dict[str, torch.Tensor]
MODES = ("fixed", "hot")
REFRESH_WINDOWS = 64  # windows between two refreshes
DECAY = 0.5  # the counts are multiplied by this at each refresh


def refresh_layer(weights: Tensors, pool: ExpertPool, max_swaps: int = 4, margin: float = 1.25) -> int:
    """Swap up to `max_swaps` hot host experts of one layer with its cold resident ones (see the module); the
    number swapped."""
    gate_up, down, slot_of = weights["experts_gate_up"], weights["experts_down"], weights["expert_slot"]
    m = gate_up.shape[0]
    counts = pool.counts
    swaps = 0
    if m and pool.num_here:
        slots = slot_of.cpu().long()
        resident = torch.nonzero(slots < m).squeeze(1)
        here = torch.nonzero(pool.index < pool.num_here).squeeze(1)
        hot = here[torch.argsort(counts[here], descending=True, stable=True)].tolist()
        cold = resident[torch.argsort(counts[resident], stable=True)].tolist()
        for h, r in zip(hot, cold):
            if swaps >= max_swaps or counts[h] < margin * counts[r] or counts[h] == 0:
                break
            s, j = int(slots[r]), int(pool.index[h])
            # a copy (also where the device is the CPU); waits for the windows before it, which may read the slot
            leaving = gate_up[s].to("cpu", copy=True), down[s].to("cpu", copy=True)
            hot_gate_up, hot_down = pool.slot_weights(j)
            gate_up[s].copy_(hot_gate_up)
            down[s].copy_(hot_down)
            pool.put(j, r, *leaving)
            slot_of[r] = m
            slot_of[h] = s
            swaps += 1
    pool.counts *= DECAY
    pool.swaps += swaps
    return swaps
