"""From facts and wishes to engine settings: pure functions, no torch, one reason per decision.

    proposal = propose(Facts(machine=..., model=...), Wishes(context=32768, concurrency=8))
    proposal.settings   # {"device": "cuda", "layer_split": "13,13,12,10", "batch": 8, ...}: EngineSettings keys
    proposal.reasons    # {"layer_split": "13,13,12,10: proportional to ...; cuda:3 is on PCIe Gen3 x8 ...", ...}

The rules, in order (docs/AUTOCONFIG.md explains each): the wish must fit VRAM + RAM; the fewest GPUs that hold
the whole model, else all of them; batch slots from the concurrency, capped by memory; one group per stage;
layers split in proportion to what each card has left after its dense weights and state, fewer on a card whose
host link is slow; the expert budget per card is what is left; the CPU pool gets the cores but a few. A machine
without a usable GPU gets the CPU path.
"""

from __future__ import annotations

import math
from typing import Any

from pydantic import BaseModel, Field

from autoconfig.facts import Facts, GpuFacts, HostFacts, ModelFacts
from autoconfig.memory import (
    GIB, NoGpuFit, StagePlan, extras_bytes, gb, kv_per_position, link_factors, ram_capacity, split_layers,
    vram_capacity,
)
from strata.experts.threads import pool_threads

DEFAULT_CONTEXT = 8192
MAX_SLOTS = 256  # EngineSettings.batch's limit
# The CPU pool's products read host experts at about this share of the RAM read bandwidth measured by a plain sum,
# inside the engine's decode windows (bench/experts.py, docs/PERFORMANCE.md): oneDNN's products 17-31 GB/s against
# 90-104 measured (H200 host); the pool's own kernel, where the CPU has AVX512_BF16, 33-59 GB/s against 94 at one to
# eight rows (H100 host, thirty-third session)
POOL_READ_SHARE = 0.25
POOL_KERNEL_READ_SHARE = 0.45
PARK_VRAM_SHARE = 0.5  # of the VRAM a card has left after weights and state: copies of parked conversations
PARK_VRAM_MIN_GB = 1.0  # less is not proposed (one 9K-token conversation of the 30B shape parks 0.9 GB)
PARK_GB_DEFAULT = 4.0  # the host tier's default budget (strata.state.parking.DEFAULT_PARK_GB, a quarter of RAM at most)
STATE_SHARE = 0.25  # when experts spill to the CPU, state takes at most this share of the VRAM left after dense weights


class Wishes(BaseModel):
    context: int | None = Field(None, gt=0, description="positions per conversation (prompt + answer)")
    concurrency: int = Field(1, ge=1, description="conversations expected at once")


class ImpossibleWish(ValueError):
    """The wish cannot be served on this machine; the message says why, with the numbers."""


class Proposal(BaseModel):
    settings: dict[str, Any]
    reasons: dict[str, str]
    env: dict[str, str] = Field(default_factory=dict)  # variables the engine must run with
    notes: list[str] = Field(default_factory=list)
    stages: list[StagePlan] = Field(default_factory=list)  # empty on the CPU path

    @property
    def label(self) -> str:
        s = self.settings
        parts = [s["device"], f"batch {s['batch']}"]
        if s["layer_split"]:
            parts += [f"split {s['layer_split']}", f"{s['batch_groups']} group" + "s" * (s["batch_groups"] > 1)]
        return ", ".join(parts)

    def config(self, model: str | None = None) -> dict[str, Any]:
        """The config file's content (`strata serve --config FILE`): the settings that are set, plus the model."""
        values = {k: v for k, v in self.settings.items() if v is not None}
        return {"model": model, **values} if model else values


def propose(facts: Facts, wishes: Wishes = Wishes(), *, num_gpus: int | None = None, batch: int | None = None,
            groups: int | None = None) -> Proposal:
    """The settings for `facts` and `wishes`. `num_gpus`, `batch`, `groups` force a choice (calibration candidates)."""
    model, machine = facts.model, facts.machine
    context = _context(model, wishes)
    gpus = [g for g in machine.gpus if vram_capacity(g) >= GIB]
    _check_fits(model, gpus, machine.host, context)
    notes = [f"{_card(g)} ({g.name}) is left out: only {gb(g.vram_free_bytes)} of its "
             f"{gb(g.vram_total_bytes)} are free" for g in machine.gpus if g not in gpus]
    if batch is not None and not 1 <= batch <= MAX_SLOTS:
        raise ValueError(f"batch {batch}: slots are 1 to {MAX_SLOTS} (a lone request is a slot like any other)")
    want = batch if batch is not None else min(wishes.concurrency, MAX_SLOTS)
    if gpus:
        try:
            proposal = _gpu_proposal(model, gpus, machine.host, context, wishes, want, num_gpus, groups)
            proposal.notes[:0] = notes
            if len(machine.gpus) > 1:
                proposal.env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"  # CUDA's indices = NVML's
            return proposal
        except NoGpuFit as e:
            why = f"cpu: {e}; the whole model runs on the CPU instead"
    else:
        why = "cpu: this machine has no usable GPU" + (" (NVML found none)" if not machine.gpus else "")
    proposal = _cpu_proposal(model, machine.host, context, wishes, want, why)
    proposal.notes[:0] = notes
    return proposal


def candidates(facts: Facts, wishes: Wishes = Wishes(), limit: int = 4) -> list[Proposal]:
    """The rules' proposal first, then variants worth measuring (`--calibrate`): no groups, half the slots, one
    slot, one more card."""
    base = propose(facts, wishes)
    s, stages = base.settings, max(len(base.stages), 1)
    variants: list[dict] = []
    if s["batch_groups"] > 1:
        variants.append(dict(groups=1))
    if s["batch"] >= 4:
        variants.append(dict(batch=s["batch"] // 2))
    if s["batch"] >= 2:
        variants.append(dict(batch=1))
    spills = any(p.budget_bytes < p.expert_bytes for p in base.stages)
    if base.stages and not spills and stages < sum(vram_capacity(g) >= GIB for g in facts.machine.gpus):
        variants.append(dict(num_gpus=stages + 1))
    out = [base]
    for v in variants:
        try:
            p = propose(facts, wishes, **v)
        except ImpossibleWish:
            continue
        if bool(p.stages) == bool(base.stages) and all(p.settings != q.settings for q in out):
            (forced,) = v
            key = {"groups": "batch_groups", "batch": "batch", "num_gpus": "device"}[forced]
            p.reasons[key] = f"{p.settings[key]}: a calibration candidate (the rules chose {base.settings[key]})"
            out.append(p)
    return out[:limit]


# ---------------------------------------------------------------------------------------------- the wish


def _context(model: ModelFacts, wishes: Wishes) -> int:
    if wishes.context is None:
        return min(DEFAULT_CONTEXT, model.max_positions)
    if wishes.context > model.max_positions:
        raise ImpossibleWish(f"context {wishes.context} is beyond what {model.name} was trained for "
                             f"({model.max_positions} positions); ask for at most {model.max_positions}")
    return wishes.context


def _check_fits(model: ModelFacts, gpus: list[GpuFacts], host: HostFacts, context: int) -> None:
    """The first rule: weights + one conversation's state must fit in usable VRAM + RAM."""
    weights, state = model.weight_bytes, model.state_bytes(None, context, 1)
    vram, ram = sum(vram_capacity(g) for g in gpus), ram_capacity(host)
    if weights + state <= vram + ram:
        return
    cards = f"{len(gpus)} GPU{'s' * (len(gpus) != 1)}" if gpus else "no GPU"
    raise ImpossibleWish(
        f"{model.name} does not fit this machine: it needs {gb(weights)} of weights ({model.bytes_per_param:g} bytes "
        f"per parameter) + {gb(state)} of state for one conversation of {context} positions = {gb(weights + state)}; "
        f"this machine has {gb(vram)} of VRAM ({cards}) + {gb(ram)} of RAM = {gb(vram + ram)} to give (free "
        f"memory less reserves for CUDA and the OS). It needs {gb(weights + state - vram - ram)} more: a larger "
        "machine, a smaller model, or a shorter --context"
    )


# ---------------------------------------------------------------------------------------------- GPUs


def _gpu_proposal(model: ModelFacts, gpus: list[GpuFacts], host: HostFacts, context: int, wishes: Wishes, want: int,
                  num_gpus: int | None, groups: int | None) -> Proposal:
    ranked = sorted(gpus, key=lambda g: (-vram_capacity(g), -g.link_gbps, g.index))
    counts = [min(num_gpus, len(gpus))] if num_gpus else range(1, len(gpus) + 1)
    failure = None
    for k in counts:
        cards = sorted(ranked[:k], key=lambda g: g.index)
        try:
            stages, slots, num_groups, slots_reason = _plan(model, cards, context, want, groups)
        except NoGpuFit as e:
            failure = e
            continue
        spills = any(p.budget_bytes < p.expert_bytes for p in stages)
        if not spills or k == counts[-1]:
            return _gpu_settings(model, gpus, cards, stages, host, context, wishes, slots, num_groups, slots_reason,
                                 forced=num_gpus is not None)
    raise failure


def _plan(model: ModelFacts, cards: list[GpuFacts], context: int, want: int,
          groups: int | None) -> tuple[list[StagePlan], int, int, str]:
    """Slots, then the layer split and each stage's memory, on these cards (in stage order)."""
    k = len(cards)
    capacity = [vram_capacity(g) for g in cards]
    extras = [extras_bytes(model, s, k) for s in range(k)]
    dense, experts = sum(model.dense_bytes), sum(model.expert_bytes)
    room = sum(capacity) - sum(extras) - dense  # what experts and state can share
    label = f"{k} card{'s' * (k > 1)}"
    if room <= 0:
        raise NoGpuFit(f"the dense weights and embedding ({gb(dense + sum(extras))}) do not fit the "
                        f"{gb(sum(capacity))} usable on {label}")
    per_seq = model.state_bytes(None, context, 1)
    if room - experts >= per_seq * want:  # every expert stays resident: state may take the rest
        max_seqs = int((room - experts) // per_seq) if per_seq else MAX_SLOTS
        cap_reason = f"the {gb(room - experts)} left after all the weights"
    else:
        budget = max(room - experts, room * STATE_SHARE)
        max_seqs = int(budget // per_seq) if per_seq else want
        cap_reason = (f"the {gb(budget)} that state may take while experts spill to RAM (of the {gb(room)} left "
                      "after the dense weights)")
        if max_seqs < 1:
            if per_seq > room:
                most = (room - model.state_bytes(None, 0, 1)) // max(kv_per_position(model), 1)
                raise NoGpuFit(f"one conversation of {context} positions needs {gb(per_seq)} of K/V and state, "
                                f"more than the {gb(room)} {label} have left after the dense weights "
                                f"(about {max(most, 0)} positions would fit)")
            max_seqs = 1
    slots, reason = _slots(want, max_seqs, per_seq, context, cap_reason)
    num_groups = min(groups, slots) if groups is not None else (min(k, slots) if k > 1 and slots >= 2 else 1)
    if num_groups > 1 and slots % num_groups:
        up = slots + num_groups - slots % num_groups
        slots = up if up <= max_seqs and up <= MAX_SLOTS else slots - slots % num_groups
        reason += f", rounded to {slots}: a multiple of the {num_groups} groups"
    stages = split_layers(model, cards, capacity, extras, context, slots)
    for plan, card in zip(stages, cards):
        if plan.fixed_bytes + plan.state_bytes > plan.capacity_bytes:
            need = gb(plan.fixed_bytes + plan.state_bytes)
            raise NoGpuFit(f"layers {plan.layers[0]}..{plan.layers[1] - 1} need {need} of dense weights and state, "
                           f"more than the {gb(plan.capacity_bytes)} usable on {_card(card)}")
    return stages, slots, num_groups, reason


def _slots(want: int, max_seqs: int, per_seq: int, context: int, cap_reason: str) -> tuple[int, str]:
    """At least one slot: `max_seqs` (the conversations whose state fits, at least 1) caps `want` (at least 1)."""
    if want == 1:
        return 1, (f"1: one conversation at a time is expected, so one slot ({gb(per_seq)} of state for {context} "
                   "positions; --concurrency N for more)")
    slots = max(min(want, max_seqs), 1)
    if slots == 1:
        return 1, (f"1: {want} concurrent conversations are expected, but {cap_reason} holds the state of at most "
                   f"one conversation of {context} positions ({gb(per_seq)}): one slot serves them in turn, the "
                   "others wait for it")
    if slots < want:
        return slots, (f"{slots}: {want} concurrent conversations are expected, but state for {context} positions "
                       f"takes {gb(per_seq)} a conversation, and {slots} slots are what fits in {cap_reason}")
    return slots, (f"{slots}: one slot per expected concurrent conversation; the state of {slots} slots "
                   f"({gb(per_seq)} each for {context} positions) fits in {cap_reason}")


def _gpu_settings(model: ModelFacts, gpus: list[GpuFacts], cards: list[GpuFacts], stages: list[StagePlan],
                  host: HostFacts, context: int, wishes: Wishes, slots: int, num_groups: int, slots_reason: str,
                  forced: bool = False) -> Proposal:
    k = len(cards)
    split = ",".join(str(p.num_layers) for p in stages)
    spills = any(p.budget_bytes < p.expert_bytes for p in stages)
    offloaded = sum(p.expert_bytes - p.budget_bytes for p in stages)
    if offloaded > ram_capacity(host):
        raise ImpossibleWish(
            f"{model.name}: {gb(offloaded)} of experts do not fit the {gb(sum(p.capacity_bytes for p in stages))} "
            f"usable VRAM and must stay in RAM, but only {gb(ram_capacity(host))} of RAM is available (after the "
            "reserve for the OS); a shorter --context or fewer --concurrency frees a little VRAM, more RAM is the cure")
    p = Proposal(settings={}, reasons={})
    s, why = p.settings, p.reasons
    fit = f"the model's {gb(model.weight_bytes)}"
    if k == 1:
        s["device"] = _card(cards[0])
        rest = [g for g in gpus if g is not cards[0]]
        why["device"] = (f"{s['device']} ({cards[0].name}): {fit} and the state fit on it alone" if not spills else
                         f"{s['device']} ({cards[0].name}): {'one card' if forced else 'the only usable GPU'}; {fit} "
                         "do not all fit its "
                         f"{gb(stages[0].capacity_bytes)} usable, so the CPU pool computes the experts left in RAM")
        if rest and not spills:
            why["device"] += f"; {_cards(rest)} {'stays' if len(rest) == 1 else 'stay'} free (for another replica)"
    else:
        s["device"] = "cuda"
        why["device"] = (f"cuda: {k} stages on {_cards(cards)} in order; " + (
            f"{k} cards, a calibration candidate" if forced else f"{fit} do not fit fewer cards" if not spills else
            f"{fit} do not fit their {gb(sum(p.capacity_bytes for p in stages))} usable VRAM, so every card is used "
            "and the CPU pool computes the experts left in RAM"))
        if [g.index for g in cards] != list(range(k)):
            p.env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g.index) for g in cards)
            why["device"] += f" (CUDA_VISIBLE_DEVICES={p.env['CUDA_VISIBLE_DEVICES']} makes them cuda:0..{k - 1})"
    s["dtype"] = "bfloat16"
    why["dtype"] = "bfloat16: the GPU compute type (K/V cells in bfloat16, GDN recurrent state in float32)"
    s["max_cells"] = context
    why["max_cells"] = _context_reason(model, wishes, context)
    s["batch"] = slots
    why["batch"] = slots_reason
    s["layer_split"] = split if k > 1 else None
    s["split_device"] = None
    s["batch_groups"] = 1
    s["trim_stage_weights"] = k > 1
    if k > 1:
        why["layer_split"] = _split_reason(model, cards, stages, context, slots, spills)
        why["split_device"] = "not set: each stage has a GPU of its own"
        why["trim_stage_weights"] = (f"true: each of the {k} stages loads only its own layers' tensors, not all "
                                     f"{gb(sum(model.dense_bytes) + model.embed_bytes)} of the model's dense weights, "
                                     "so the VRAM goes to experts and state")
        s["batch_groups"] = num_groups
        per_group = slots // num_groups
        why["batch_groups"] = (
            f"{num_groups}: one group per stage ({per_group} slot{'s' * (per_group != 1)} each), so stage k runs group "
            f"g while stage k+1 runs group g-1 and {'both' if k == 2 else f'all {k}'} cards work at once (each stage "
            "has its own GPU)"
            if num_groups > 1 else
            "1: " + ("one slot, nothing to pipeline" if slots < 2 else f"the {slots} slots run as one group"))
    else:
        why["layer_split"] = "not set: one card holds every layer"
        why["split_device"] = "not set: no split"
        why["trim_stage_weights"] = "false: one stage loads every layer anyway"
        why["batch_groups"] = "1: one stage, nothing to pipeline"
    if spills:
        s["expert_budget_gb"] = ",".join(f"{math.floor(p.budget_bytes / 1e8) / 10:.1f}" for p in stages)
        resident = ", ".join(f"{p.resident:.0%}" for p in stages)
        who, whose = ("each card", "of each stage's experts") if k > 1 else (_card(cards[0]), "of the experts")
        why["expert_budget_gb"] = (
            f"{s['expert_budget_gb']} GB: what {who} has left after its dense weights "
            f"({', '.join(gb(p.fixed_bytes) for p in stages)}) and state "
            f"({', '.join(gb(p.state_bytes) for p in stages)}); "
            f"{resident} {whose} stay resident, the other {gb(offloaded)} stay in RAM")
        threads = pool_threads(host.cpu_cores)
        s["cpu_threads"] = threads
        why["cpu_threads"] = (f"{threads}: the CPU pool computes the rows whose experts are in RAM; the host's "
                              f"{host.cpu_cores} cores less {host.cpu_cores - threads} for the engine's host loop, "
                              "CUDA's threads and the server (a pool thread preempted by them holds up the window)")
        s["pcie_frac"], why["pcie_frac"] = _pcie_frac(cards, host)
    else:
        s["expert_budget_gb"] = None
        s["cpu_threads"] = None
        s["pcie_frac"] = 0.0
        why["pcie_frac"] = "0: no expert is in host RAM"
        if model.num_experts:
            why["expert_budget_gb"] = "not set: every expert fits in VRAM and stays resident"
            why["cpu_threads"] = "not set: every expert is resident, the CPU pool stays idle"
        else:
            why["expert_budget_gb"] = "not set: the model has no routed experts"
            why["cpu_threads"] = "not set: the model has no routed experts for a CPU pool to compute"
    s["park_vram_gb"], why["park_vram_gb"] = _park_vram(stages, host, slots, spills)
    s["kernels"] = "auto"
    why["kernels"] = "auto: the Triton kernels on the GPU"
    s["cuda_graphs"] = True
    why["cuda_graphs"] = "true: decode windows replay captured CUDA graphs (fewer launches per token)"
    p.stages = stages
    p.notes += _link_notes(cards, spills)
    return p


def _park_vram(stages: list[StagePlan], host: HostFacts, slots: int, spills: bool) -> tuple[float, str]:
    """--park-vram-gb: half of the VRAM each card has left after its weights and state, at most the host tier's
    budget (every VRAM copy is also in host RAM), 0 when experts spill (they are worth the VRAM more)."""
    if spills:
        return 0.0, ("0: the VRAM left after the dense weights and state holds experts (every window reads them), "
                     "not copies of parked conversations")
    left = min(p.capacity_bytes - p.fixed_bytes - p.state_bytes - p.budget_bytes for p in stages)
    host_tier = min(PARK_GB_DEFAULT * 1e9, host.ram_total_bytes / 4)
    size = math.floor(min(left * PARK_VRAM_SHARE, host_tier) / 1e8) / 10
    where = "each card" if len(stages) > 1 else "the card"
    if size < PARK_VRAM_MIN_GB:
        return 0.0, (f"0: {where} has {gb(max(left, 0))} left after the weights and the state of {slots} "
                     f"slot{'s' * (slots != 1)}, too little for copies of parked conversations to be worth it")
    capped = " (the host tier's budget: every copy is also kept in host RAM)" if size * 1e9 >= host_tier - 1e8 else ""
    return size, (f"{size:.1f} GB{capped}: of the {gb(left)} {where} has left after the weights and the state of "
                  f"{slots} slot{'s' * (slots != 1)}, for copies of the conversations parked last; a follow-up is "
                  "restored from them at the GPU's own speed instead of over the host link (0.9 GB in 3.1 ms against "
                  "17.3 ms from host RAM, measured on an H100)")


def _split_reason(model: ModelFacts, cards: list[GpuFacts], stages: list[StagePlan], context: int, seqs: int,
                  spills: bool) -> str:
    split = ",".join(str(p.num_layers) for p in stages)
    left = ", ".join(f"{_card(g)} {gb(p.capacity_bytes - p.fixed_bytes - p.state_bytes)}"
                     for g, p in zip(cards, stages))
    reason = (f"layers {split}: proportional to the VRAM each card has left after its dense weights and the state of "
              f"{seqs} sequence{'s' * (seqs != 1)} x {context} positions ({left})")
    slow = [g for g, f in zip(cards, link_factors(cards)) if f < 1]
    if slow and spills:
        best = max(g.link_gbps for g in cards)
        reason += "; " + "; ".join(
            f"{_card(g)} is on {g.link} ({g.link_gbps:.1f} GB/s against {best:.1f} GB/s), so it takes fewer layers "
            "and keeps more of their experts resident" for g in slow)
    elif slow:
        reason += "; " + ", ".join(f"{_card(g)} is on a slow link ({g.link})" for g in slow) + (
            ", but every expert is resident, so only the small hand-offs cross it and its share is not cut")
    return reason


def _pcie_frac(cards: list, host) -> tuple[float, str]:
    """The share of the host experts the GPU computes after uploading them, so that the link's uploads and the CPU
    pool's products take the same time: F / link = (1 - F) / pool, F = link / (link + pool)."""
    link = min(g.link_gbps for g in cards) if cards else 0.0
    if not link:
        return 0.0, "0: the cards' PCIe links are not known"
    if not host.ram_read_gbps:
        return 0.0, "0: the host's RAM read bandwidth was not measured (the CPU pool computes every host expert)"
    share, way = ((POOL_KERNEL_READ_SHARE, "its own kernel: the CPU has AVX512_BF16") if host.cpu_bf16_dots
                  else (POOL_READ_SHARE, "oneDNN's products: the CPU has no AVX512_BF16"))
    pool = host.ram_read_gbps * share
    frac = round(link / (link + pool), 2)
    return frac, (f"{frac}: the link uploads {link:.0f} GB/s and the CPU pool reads about {pool:.0f} GB/s "
                  f"({share:.0%} of the {host.ram_read_gbps:.0f} GB/s measured, on {way}), so uploading that "
                  "share of the host experts' weights takes as long as the CPU computing the rest")


def _link_notes(cards: list[GpuFacts], spills: bool) -> list[str]:
    notes = []
    for g in cards:
        if 0 < g.pcie_width < g.pcie_width_max:
            notes.append(f"{_card(g)} runs its link at x{g.pcie_width} of the x{g.pcie_width_max} it and its slot "
                         "support: a degraded link (reseat the card, check the riser)")
    if spills and cards and max(g.pcie_gen_max for g in cards) <= 3:
        best = max(g.link_gbps for g in cards)
        notes.append(f"every card is on PCIe Gen{max(g.pcie_gen_max for g in cards)} ({best:.1f} GB/s at most): the "
                     "experts left in RAM are best computed by the CPU pool, not uploaded window by window")
    return notes


# ---------------------------------------------------------------------------------------------- CPU


def _cpu_proposal(model: ModelFacts, host: HostFacts, context: int, wishes: Wishes, want: int,
                  why_cpu: str) -> Proposal:
    ram = ram_capacity(host)
    options = []
    for dtype, width in (("float32", 4), ("bfloat16", 2)):
        scale = width / model.bytes_per_param
        weights = int(model.weight_bytes * scale)
        per_seq = model.state_bytes(None, context, 1) + int(kv_per_position(model) * context * (scale - 1))
        options.append((dtype, weights, per_seq))
    fitting = [o for o in options if o[1] + o[2] <= ram]
    if not fitting:
        dtype, weights, per_seq = options[-1]
        raise ImpossibleWish(f"{model.name} on the CPU needs {gb(weights)} of weights in bfloat16 + {gb(per_seq)} of "
                             f"state for one conversation of {context} positions, more than the {gb(ram)} of RAM "
                             "available (after the reserve for the OS)")
    dtype, weights, per_seq = fitting[0]
    max_seqs = int((ram - weights) // per_seq) if per_seq else want
    room = f"the {gb(ram - weights)} of RAM left after the weights"
    slots, slots_reason = _slots(want, max_seqs, per_seq, context, room)
    p = Proposal(settings={}, reasons={})
    s, why = p.settings, p.reasons
    s["device"], why["device"] = "cpu", why_cpu
    s["dtype"] = dtype
    why["dtype"] = (f"float32: the CPU compute type; the weights take {gb(weights)} of the {gb(ram)} of RAM available"
                    if dtype == "float32" else
                    f"bfloat16: in float32 the weights would take {gb(options[0][1])}, more than the {gb(ram)} of RAM "
                    f"available; bfloat16 needs {gb(weights)} (slower on CPUs without native bfloat16)")
    s["max_cells"], why["max_cells"] = context, _context_reason(model, wishes, context)
    s["batch"], why["batch"] = slots, slots_reason
    s["layer_split"], why["layer_split"] = None, "not set: one stage on the CPU"
    s["split_device"], why["split_device"] = None, "not set: no split"
    s["batch_groups"], why["batch_groups"] = 1, "1: one stage, nothing to pipeline"
    s["trim_stage_weights"], why["trim_stage_weights"] = False, "false: one stage loads every layer anyway"
    s["park_vram_gb"] = 0.0
    why["park_vram_gb"] = "0: no GPU (parked conversations stay in host RAM)"
    s["expert_budget_gb"] = None
    why["expert_budget_gb"] = "not set: " + ("every expert is in RAM with the rest of the model" if model.num_experts
                                             else "the model has no routed experts")
    s["cpu_threads"] = None
    why["cpu_threads"] = (f"not set: nothing is offloaded; torch computes the whole model on the host's "
                          f"{host.cpu_cores} cores")
    s["pcie_frac"], why["pcie_frac"] = 0.0, "0: no GPU to upload experts to"
    s["kernels"], why["kernels"] = "torch", "torch: the reference kernels (the Triton kernels need a GPU)"
    s["cuda_graphs"], why["cuda_graphs"] = False, "false: no GPU"
    return p


# ---------------------------------------------------------------------------------------------- words


def _context_reason(model: ModelFacts, wishes: Wishes, context: int) -> str:
    if wishes.context is not None:
        return (f"{context}: positions per conversation (prompt + answer), as asked; the model allows "
                f"{model.max_positions}")
    return (f"{context}: the default context (the model allows {model.max_positions}); --context N asks for longer "
            "conversations")


def _card(gpu: GpuFacts) -> str:
    return f"cuda:{gpu.index}"


def _cards(gpus: list[GpuFacts]) -> str:
    """cuda:0..3 for a run of indices, else cuda:0, cuda:2."""
    idx = [g.index for g in gpus]
    if len(idx) > 2 and idx == list(range(idx[0], idx[0] + len(idx))):
        return f"cuda:{idx[0]}..{idx[-1]}"
    return ", ".join(_card(g) for g in gpus)
