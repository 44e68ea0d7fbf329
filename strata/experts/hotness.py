"""Hot residency (`--expert-residency hot`): the experts a layer keeps on its device follow the traffic.

Each pooled layer's `ExpertPool` counts the routed pairs of every expert of its layer: the pool already receives
every row's expert ids on the host, so counting costs no device work. Every `REFRESH_WINDOWS` windows the engine
(`Engine.refresh_experts`) compares each layer's counts, halved at each refresh so recent traffic weighs more,
and swaps up to `max_swaps` experts: the hottest expert in host RAM takes the device slot of the coldest resident
one when it was routed at least `margin` times as often; the cold one's weights take the host slot the hot one
left. A swap copies one expert each way, queued on the stage's stream after the windows before it, and rewrites
both maps in place (the device's `expert_slot`, the pool's `index`), so captured graphs stay valid. On a GPU nothing
waits for the device: the leaving expert goes to pinned host buffers and the hot one comes up from a pinned copy,
both asynchronously, and the pool takes the leaving weights into its slot once their copy has landed
(`ExpertPool.put(..., ready=event)`), before it next reads that slot; the device slots are mirrored on the host
(`ExpertPool.device_slots`), so a refresh reads nothing back from the device either.

Arithmetic: a pair is computed by the device's kernels or by the CPU pool, which round differently, so after a
swap a row's output can change in its last bits, and a greedy token can differ where two logits nearly tie.
Batched output still equals solo output for a given resident set. With `--expert-residency fixed` (the default:
the lowest ids, never moved) every run repeats exactly.
"""

from __future__ import annotations

import torch

from strata.experts.pool import ExpertPool, to_pinned

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
        if pool.device_slots is None:  # the host's mirror of `expert_slot`, read once
            pool.device_slots = slot_of.cpu().long()
        slots = pool.device_slots
        resident = torch.nonzero(slots < m).squeeze(1)
        here = torch.nonzero(pool.index < pool.num_here).squeeze(1)
        hot = here[torch.argsort(counts[here], descending=True, stable=True)].tolist()
        cold = resident[torch.argsort(counts[resident], stable=True)].tolist()
        for h, r in zip(hot, cold):
            if swaps >= max_swaps or counts[h] < margin * counts[r] or counts[h] == 0:
                break
            s, j = int(slots[r]), int(pool.index[h])
            hot_gate_up, hot_down = pool.slot_weights(j)
            if gate_up.device.type == "cuda":  # all queued on the stream, after the windows that read slot s
                leaving = to_pinned(gate_up[s]), to_pinned(down[s])
                # from pinned copies: the host slot may take the leaving weights before these uploads have run
                gate_up[s].copy_(to_pinned(hot_gate_up, copy_on_host=True), non_blocking=True)
                down[s].copy_(to_pinned(hot_down, copy_on_host=True), non_blocking=True)
                landed = torch.cuda.Event()
                landed.record(torch.cuda.current_stream(gate_up.device))
                pool.put(j, r, *leaving, ready=landed)
            else:
                leaving = gate_up[s].clone(), down[s].clone()
                gate_up[s].copy_(hot_gate_up)
                down[s].copy_(hot_down)
                pool.put(j, r, *leaving)
            slot_of[r] = m
            slot_of[h] = s
            slots[r], slots[h] = m, s
            swaps += 1
    pool.counts *= DECAY
    pool.swaps += swaps
    return swaps

