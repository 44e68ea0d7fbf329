"""Driving batch slots in tests: prompts read each in a prompt window of its own (so a slot's state is bitwise
what a lone read gives, whatever else the slots hold), then one decode window over the slots."""

from __future__ import annotations

import torch


def read_alone(slots, index: int, prompt: list[int], max_new: int) -> int:
    """Admit `prompt` into slot `index` (greedy) and read it at once in windows of its own, outside the slots'
    windows, so no other slot decodes meanwhile; the slot then decodes from its first token, which is returned."""
    slot = slots.slots[index]
    slots.admit(index, prompt, max_new)
    logits = slots.engine.run(slot.state, slot.unread)
    slot.unread = []
    slot.generated.append(int(logits[-1].argmax()))
    return slot.next_token


def decode_logits(slots, prompts: dict[int, list[int]], max_new: int = 4) -> torch.Tensor:
    """Each prompt read alone into its slot, then the logits of one decode window over those slots (slot order)."""
    for index, prompt in prompts.items():
        read_alone(slots, index, prompt, max_new)
    sw = slots.run_slots()
    assert sw.prompt_rows == 0 and sw.decoding == sorted(prompts)
    return sw.logits
