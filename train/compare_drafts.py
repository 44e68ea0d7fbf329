"""Diagnostic: the engine's MTP drafts against `mtp_head.py`'s `MtpHead.draft` fed the engine's own hidden states.

Runs the embedded default with its shipped head (`--spec mtp:3`) on one chat prompt and, after every verified
window, drafts again with the training code's head from the same hidden states and tokens; prints both.

    python train/compare_drafts.py [--tokens 40]

Run in the twenty-second session on issue 26's lead (the third drafted position never accepted in the engine):
33 of 33 windows agree, one to three drafts each, after windows that kept one to four rows. The engine drafts what
the trained head drafts; its acceptance is the head's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> None:
    from mtp_head import DEFAULT_OUT, MtpHead

    from strata.model.loader import ModelFiles
    from strata.runtime.drafts import SpeculativeConfig
    from strata.runtime.generate import Engine

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--prompt", default="Explain in a few sentences why the sky is blue.")
    args = p.parse_args(argv)
    engine = Engine(ModelFiles.open("default"), max_cells=512, speculative=SpeculativeConfig("mtp", 3))
    ids = engine.tokenizer.encode_chat([{"role": "user", "content": args.prompt}])
    head = MtpHead.from_file(DEFAULT_OUT, engine.stages[-1].forward.weights.embed.float())
    slots = engine.solo_slots()
    slots.admit(0, ids, args.tokens, stop_ids=frozenset())
    hidden: dict[int, torch.Tensor] = {}  # position -> the latest hidden state computed there
    run_mtp = slots._run_mtp
    agree = disagree = 0

    def compare(sw, indices, tokens):
        nonlocal agree, disagree
        start, n, first = sw.spans[0]
        for j in range(n):
            hidden[first + j] = sw.hidden[start + j].float().clone()
        run_mtp(sw, indices, tokens)
        slot = slots.slots[0]
        if slot.mtp_drafts and 0 in indices:
            length = slot.state.length
            last = len(indices) - 1 - indices[::-1].index(0)  # a slot's kept tokens in order: its last is next
            toks = torch.tensor(slot.state.tokens[:length] + [tokens[last]])
            ref = head.draft(torch.stack([hidden[q] for q in range(length)]), toks, len(slot.mtp_drafts))
            same = ref == slot.mtp_drafts
            agree, disagree = agree + same, disagree + (not same)
            print(f"length {length}: window rows {n}, engine {slot.mtp_drafts}, head {ref}{'' if same else '  DIFF'}")

    slots._run_mtp = compare
    while slots.slots[0].active or slots.in_flight:
        slots.step()
    print(f"{agree} windows agree, {disagree} differ")


if __name__ == "__main__":
    main()
