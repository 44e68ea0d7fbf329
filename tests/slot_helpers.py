"""Comparing decode windows in tests: prompts read each in a prompt window of its own (`Slots.admit_now`, so a
slot's state is bitwise what a lone read gives, whatever the other slots hold), then one decode window."""

from __future__ import annotations

import torch


def decode_logits(slots, prompts: dict[int, list[int]], max_new: int = 4) -> torch.Tensor:
    """Each prompt read alone into its slot, then the logits of one decode window over those slots (slot order)."""
    for index, prompt in prompts.items():
        slots.admit_now(index, prompt, max_new)
    sw = slots.run_slots()
    assert sw.prompt_rows == 0 and sw.decoding == sorted(prompts)
    return sw.logits


def decode_rows_alone_and_beside(engine, slots, decoding: list[int], prompt_slot: int, chunk: list[int]):
    """The logits of the decoding slots' next rows in a window of their own, then in a window with a prompt chunk of
    `prompt_slot` beside them (each slot's GDN state put back in between: a window advances it). Nothing is
    committed. Returns (alone [D, V], mixed [D + 1, V])."""
    from strata.runtime.window import Window

    states = [s.state for s in slots.slots]
    parts = [(states[i], [slots.slots[i].next_token], False) for i in decoding]
    gdn = [t for st in states for t in (*st.conv.values(), *st.recurrent.values())]
    saved = [t.clone() for t in gdn]
    alone = engine.forward(Window.build(parts, engine.device))
    for t, v in zip(gdn, saved):
        t.copy_(v)
    mixed = engine.forward(Window.build(parts + [(states[prompt_slot], chunk, False)], engine.device))
    return alone, mixed
