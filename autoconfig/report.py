"""What autoconfig shows and writes: the settings with their reasons, and the config file `strata serve` reads."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from autoconfig.facts import Facts
from autoconfig.memory import GB
from autoconfig.rules import Proposal


def describe(facts: Facts, proposal: Proposal) -> str:
    """The proposal as a person reads it: the machine in one line, each setting with its reason, then notes."""
    m, model = facts.machine, facts.model
    kinds: dict[str, int] = {}
    for g in m.gpus:
        kind = f"{g.name} ({g.vram_total_bytes / GB:.1f} GB)"
        kinds[kind] = kinds.get(kind, 0) + 1
    gpus = ", ".join(f"{n} x {kind}" for kind, n in kinds.items()) or "no GPU"
    if m.gpus:
        gpus += " on " + ", ".join(f"Gen{g.pcie_gen_max} x{g.pcie_width}" for g in m.gpus)
    lines = [
        f"machine: {gpus}; {m.host.ram_total_bytes / GB:.0f} GB RAM ({m.host.ram_available_bytes / GB:.0f} GB "
        f"available), {m.host.cpu_cores} cores",
        f"model: {model.name}: {model.num_layers} layers, {model.weight_bytes / GB:.1f} GB of weights" + (
            f" ({sum(model.expert_bytes) / GB:.1f} GB in {model.num_experts} experts per layer)"
            if model.num_experts else ""),
        "",
    ]
    shown = {k: "-" if v is None else json.dumps(v) if isinstance(v, bool) else str(v)
             for k, v in proposal.settings.items()}
    width, value_width = max(len(k) for k in shown), max(len(v) for v in shown.values())
    for key, value in shown.items():
        lines.append(f"  {key:<{width}}  {value:<{value_width}}  {proposal.reasons.get(key, '')}")
    if proposal.stages:
        lines += ["", "  stage  card     layers   dense+head  state     experts   resident"]
        for i, p in enumerate(proposal.stages):
            lines.append(f"  {i:<5}  cuda:{p.gpu:<3}  {p.layers[0]:>2}..{p.layers[1] - 1:<3}  "
                         f"{p.fixed_bytes / GB:>7.1f} GB  {p.state_bytes / GB:>5.1f} GB  "
                         f"{p.budget_bytes / GB:>5.1f} GB  {p.resident:>6.0%}")
    if proposal.env:
        lines += ["", "  run with: " + " ".join(f"{k}={v}" for k, v in proposal.env.items())]
    lines += [f"  note: {n}" for n in proposal.notes]
    return "\n".join(lines)


def write_config(path: str | Path, values: dict[str, Any]) -> Path:
    """Write `values` (EngineSettings keys) as .json or .toml, the two formats `strata serve --config` reads."""
    path = Path(path)
    values = {k: v for k, v in values.items() if v is not None}
    if path.suffix == ".json":
        text = json.dumps(values, indent=2) + "\n"
    elif path.suffix == ".toml":
        text = "# written by `strata autoconfig`\n" + "".join(f"{k} = {_toml(v)}\n" for k, v in values.items())
    else:
        raise ValueError(f"{path}: the config file must end in .json or .toml")
    path.write_text(text)
    return path


def _toml(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return json.dumps(str(value))  # a TOML basic string: JSON's escapes are valid TOML
