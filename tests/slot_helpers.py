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
