"""`strata autoconfig`: engine settings from this machine (or recorded facts) and a model, with reasons.

    strata autoconfig [--model PATH] [--facts FILE] [--context N] [--concurrency N] [--calibrate] [--write CONFIG]
    strata autoconfig facts [--annotate-node]

Exit codes: 0, or 2 with `strata autoconfig: error: ...` for a wish the machine cannot serve or bad input.
"""

from __future__ import annotations

import argparse
import json
import sys

from pydantic import ValidationError

from autoconfig.facts import Facts, MachineFacts, ModelFacts, load_facts, read_machine, read_model
from autoconfig.report import describe, write_config
from autoconfig.rules import ImpossibleWish, Proposal, Wishes, candidates, propose


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="strata autoconfig",
        description="Propose engine settings for this machine and a model, each with its reason. "
                    "`strata autoconfig facts` prints this machine's facts.")
    p.add_argument("--model", help="a Hugging Face model folder, a .gguf file, or 'default' (default: the model in "
                                   "--facts, else 'default')")
    p.add_argument("--quantization", choices=["q8_0", "q4_k", "q5_k", "q6_k", "iq3_s", "fp8"],
                   help="the model will be served with `--quantization` (its float matrices quantized as they load): "
                        "count them at that format's packed size, and propose it")
    p.add_argument("--facts", metavar="FILE", help="recorded facts (JSON: a machine, or machine + model) instead of "
                                                   "reading this machine")
    p.add_argument("--context", type=int, metavar="N",
                   help="positions per conversation, prompt + answer (default 8192)")
    p.add_argument("--concurrency", type=int, default=1, metavar="N", help="conversations expected at once (default 1)")
    p.add_argument("--calibrate", action="store_true", help="measure the top candidates here and keep the fastest")
    p.add_argument("--calibrate-windows", type=int, default=8, metavar="N", help="decode windows timed per candidate")
    p.add_argument("--write", metavar="CONFIG", help="write the settings to CONFIG (.json or .toml) for "
                                                     "`strata serve --config CONFIG`")
    p.add_argument("--json", action="store_true", help="print the proposal (settings, reasons, env, notes) as JSON")
    return p


def _facts_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strata autoconfig facts", description="Print this machine's facts as JSON.")
    p.add_argument("--annotate-node", action="store_true",
                   help="also write them on the Kubernetes node $NODE_NAME as the annotation strata.dev/facts "
                        "(the node's RAM and CPUs, not this pod's own limits)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["facts"]:
            return _facts(_facts_parser().parse_args(argv[1:]))
        return _autoconfig(_parser().parse_args(argv))
    except (ImpossibleWish, ValidationError, OSError, ValueError, RuntimeError) as e:
        print(f"strata autoconfig: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:
        if type(e).__module__.startswith("strata"):  # StrataError: a model that cannot be read, say
            print(f"strata autoconfig: error: {e}", file=sys.stderr)
            return 2
        raise


def _facts(args: argparse.Namespace) -> int:
    machine = read_machine(node=args.annotate_node)  # a node's facts: not limited by this pod's own cgroup
    print(machine.model_dump_json(indent=2))
    if args.annotate_node:
        from autoconfig.node import ANNOTATION, annotate_node

        node = annotate_node(machine)
        print(f"annotated node {node} with {ANNOTATION}", file=sys.stderr)
    return 0


def _autoconfig(args: argparse.Namespace) -> int:
    if args.calibrate and args.facts:
        raise ValueError("--calibrate measures this machine: it cannot replay --facts")
    wishes = Wishes(context=args.context, concurrency=args.concurrency)
    machine, model = _load(args)
    facts = Facts(machine=machine, model=model)
    model_ref = args.model or model.name
    if args.calibrate:
        proposal = _calibrated(model_ref, facts, wishes, args.calibrate_windows, args.quantization)
    else:
        proposal = propose(facts, wishes)
        _quantized(proposal, args.quantization)
    if args.json:
        print(json.dumps({"settings": proposal.settings, "reasons": proposal.reasons, "env": proposal.env,
                          "notes": proposal.notes}, indent=2))
    else:
        print(describe(facts, proposal))
    if args.write:
        path = write_config(args.write, proposal.config(model_ref))
        env = " ".join(f"{k}={v}" for k, v in proposal.env.items())
        print(f"wrote {path}: run `{env + ' ' if env else ''}strata serve --config {path}`", file=sys.stderr)
    return 0


def _load(args: argparse.Namespace) -> tuple[MachineFacts, ModelFacts]:
    if args.facts:
        recorded = load_facts(args.facts)
        machine = recorded.machine if isinstance(recorded, Facts) else recorded
        if args.model is None and isinstance(recorded, Facts):
            if args.quantization:
                raise ValueError(f"--quantization {args.quantization}: the model in {args.facts} was counted when "
                                 "its facts were recorded; pass --model to count it quantized")
            return machine, recorded.model
    else:
        machine = read_machine()
    # on a GPU the Triton kernels keep quantized weights packed: they count at their packed size
    from strata.model.loader import ModelFiles

    files = ModelFiles.open(args.model or "default", args.quantization)
    return machine, read_model(files, packed=bool(machine.gpus))


def _quantized(proposal: Proposal, quantization: str | None) -> Proposal:
    if quantization is not None:
        proposal.settings["quantization"] = quantization
        proposal.reasons["quantization"] = (f"asked for (--quantization): the float matrices quantized to "
                                            f"{quantization} as they load, counted at that size")
    return proposal


def _calibrated(model_ref: str, facts: Facts, wishes: Wishes, windows: int, quantization: str | None = None) -> Proposal:
    from autoconfig.calibrate import calibrate, fastest, table

    proposals = [_quantized(p, quantization) for p in candidates(facts, wishes)]
    print(f"calibrating {len(proposals)} candidates ({windows} decode windows each) ...", file=sys.stderr)
    measurements = calibrate(model_ref, proposals, wishes.concurrency, windows=windows)
    print(table(measurements))
    print()
    best = fastest(measurements)
    if best is None:
        proposals[0].notes.append("calibration measured no candidate: these are the rules' settings")
        return proposals[0]
    others = [m for m in measurements if m is not best and m.tokens_per_s is not None]
    runner_up = max(others, key=lambda m: m.tokens_per_s) if others else None
    ahead = f", ahead of {runner_up.proposal.label} at {runner_up.tokens_per_s:.1f}" if runner_up else ""
    best.proposal.notes.append(f"calibrated here: {best.proposal.label} decoded {best.tokens_per_s:.1f} tokens/s over "
                               f"{best.conversations} conversation(s){ahead}")
    return best.proposal
