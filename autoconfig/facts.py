"""Facts about a machine and a model: what the rules decide from.

Facts are pydantic models that serialise to JSON, so they are read once on a machine (`read_machine`,
`read_model`) and replayed anywhere: the tests, `strata autoconfig --facts FILE`, the operator (which
builds `MachineFacts` from a node's labels and its `strata.dev/facts` annotation).

Sizes are bytes. Model sizes are as the engine holds the weights: `bytes_per_param` bytes per parameter
(2: the engine dequantizes every checkpoint, GGUF included, to bfloat16 on a GPU). Nothing here imports
torch at module level; `read_model` imports strata lazily.
"""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from strata.experts.threads import cgroup_number, usable_cores

# GB/s per lane, after line encoding (8b/10b up to Gen2, 128b/130b from Gen3), by PCIe generation
PCIE_LANE_GBPS = {1: 0.25, 2: 0.5, 3: 0.985, 4: 1.969, 5: 3.938, 6: 7.563}


class GpuFacts(BaseModel):
    index: int = Field(description="NVML index (PCI bus order; CUDA uses the same with CUDA_DEVICE_ORDER=PCI_BUS_ID)")
    name: str
    vram_total_bytes: int
    vram_free_bytes: int
    pcie_gen: int = Field(description="link generation now (an idle link may run below its maximum to save power)")
    pcie_width: int = Field(description="lanes the link trained at now")
    pcie_gen_max: int = Field(description="the highest generation the GPU and its slot support together")
    pcie_width_max: int = Field(description="the widest link the GPU and its slot support together (8 in a x8 slot)")

    @property
    def link_gbps(self) -> float:
        """Host link bandwidth one way, GB/s: the maximum generation (links idle below it) at the trained width."""
        return PCIE_LANE_GBPS.get(self.pcie_gen_max, 0.0) * self.pcie_width

    @property
    def link(self) -> str:
        return f"PCIe Gen{self.pcie_gen_max} x{self.pcie_width}"


class HostFacts(BaseModel):
    ram_total_bytes: int
    ram_available_bytes: int
    cpu_cores: int = Field(description="CPUs this process may use (affinity and cgroup quota)")
    cpu_bf16_dots: bool = Field(False, description="the CPU has AVX512_BF16 dot products, so the CPU expert pool runs "
                                "its own kernel (strata/experts/native.py), which reads experts faster than oneDNN")
    ram_read_gbps: float = Field(0.0, description="measured: GB/s this process's threads read host RAM at (a sum "
                                 "over a buffer larger than the caches); 0 when not measured")


class MachineFacts(BaseModel):
    gpus: list[GpuFacts] = Field(default_factory=list)
    host: HostFacts


class ModelFacts(BaseModel):
    name: str = Field(description="where the facts came from: a model path, `default`, or a spec name")
    num_layers: int
    layer_kinds: list[Literal["attention", "gdn"]]
    mlp_kinds: list[Literal["dense", "moe"]]
    num_experts: int = 0
    experts_per_token: int = 0
    expert_bytes: list[int] = Field(description="per layer: all its routed experts together (0 for a dense MLP)")
    dense_bytes: list[int] = Field(
        description="per layer: everything else (norms, attention or GDN, router, shared expert)")
    embed_bytes: int
    head_bytes: int = Field(description="final norm + output head (the embedding's size again when tied)")
    tie_embeddings: bool = False
    mtp_bytes: int = Field(0, description="multi-token-prediction weights, loaded with the last stage")
    kv_bytes_per_token: int = Field(description="K and V of one position in one attention layer")
    recurrent_bytes_per_sequence: int = Field(description="conv history + float32 recurrent state of one GDN layer")
    hidden_size: int
    vocab_size: int
    max_positions: int
    bytes_per_param: float = 2.0

    @property
    def weight_bytes(self) -> int:
        head = self.head_bytes - self.embed_bytes if self.tie_embeddings else self.head_bytes
        return sum(self.expert_bytes) + sum(self.dense_bytes) + self.embed_bytes + head + self.mtp_bytes

    def state_bytes(self, layers: range | None, context: int, sequences: int) -> int:
        """K/V cells for `context` positions and GDN state, for `sequences` sequences, over `layers`."""
        layers = layers if layers is not None else range(self.num_layers)
        kv, recurrent = self.kv_bytes_per_token * context, self.recurrent_bytes_per_sequence
        per_seq = sum(kv if self.layer_kinds[i] == "attention" else recurrent for i in layers)
        return per_seq * sequences


class Facts(BaseModel):
    machine: MachineFacts
    model: ModelFacts


def load_facts(path: str | Path) -> MachineFacts | Facts:
    """A recorded facts file: a machine alone (`{"gpus": ..., "host": ...}`) or machine + model."""
    data = json.loads(Path(path).read_text())
    return Facts.model_validate(data) if "machine" in data else MachineFacts.model_validate(data)


# ---------------------------------------------------------------------------------------------- machine


def read_machine(node: bool = False) -> MachineFacts:
    """This machine's GPUs (through NVML; none when `nvidia-ml-py` or a driver is missing) and host, with the host's
    RAM read bandwidth measured (about a quarter of a second)."""
    host = read_host(node=node)
    host.ram_read_gbps = measure_ram_read_gbps()
    return MachineFacts(gpus=read_gpus(), host=host)


def measure_ram_read_gbps(nbytes: int = 512 * 2**20, repeats: int = 3) -> float:
    """GB/s torch's threads read host RAM at: the best of `repeats` sums over a buffer of `nbytes` (0.0 without
    torch). What the CPU expert pool's products can read at best."""
    try:
        import torch
    except ImportError:
        return 0.0
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    buf.sum()  # touch it once: the pages are mapped before the timing
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return round(nbytes / best / 1e9, 1)


def read_gpus() -> list[GpuFacts]:
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []  # no driver, or no GPU
    try:
        gpus = []
        for index in range(pynvml.nvmlDeviceGetCount()):
            handle = pynvml.nvmlDeviceGetHandleByIndex(index)
            name = pynvml.nvmlDeviceGetName(handle)
            memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
            gpus.append(GpuFacts(
                index=index,
                name=name.decode() if isinstance(name, bytes) else name,
                vram_total_bytes=int(memory.total),
                vram_free_bytes=int(memory.free),
                pcie_gen=_nvml_or(pynvml.nvmlDeviceGetCurrPcieLinkGeneration, handle, 0),
                pcie_width=_nvml_or(pynvml.nvmlDeviceGetCurrPcieLinkWidth, handle, 0),
                pcie_gen_max=_nvml_or(pynvml.nvmlDeviceGetMaxPcieLinkGeneration, handle, 0),
                pcie_width_max=_nvml_or(pynvml.nvmlDeviceGetMaxPcieLinkWidth, handle, 0),
            ))
        return gpus
    except pynvml.NVMLError:
        return []
    finally:
        pynvml.nvmlShutdown()


def _nvml_or(query, handle, default: int) -> int:
    import pynvml

    try:
        return int(query(handle))
    except pynvml.NVMLError:  # e.g. NOT_SUPPORTED on some virtualised GPUs
        return default


def read_host(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup"), node: bool = False) -> HostFacts:
    """RAM and CPUs, within the container's cgroup limits when there are any. `node`: the whole machine's, as
    the node-facts pod reports them for the server pods it describes (its own small limits do not count)."""
    meminfo = _meminfo(proc / "meminfo")
    total = meminfo.get("MemTotal", 0)
    available = meminfo.get("MemAvailable", meminfo.get("MemFree", 0))
    if node:
        cgroup = Path("/nonexistent")  # no limits of this container apply
    limit = cgroup_number(cgroup / "memory.max")  # cgroup v2; v1 below
    used = cgroup_number(cgroup / "memory.current")
    if limit is None:
        limit = cgroup_number(cgroup / "memory" / "memory.limit_in_bytes")
        used = cgroup_number(cgroup / "memory" / "memory.usage_in_bytes")
    if limit is not None and limit < total:
        total, available = limit, min(available, max(limit - (used or 0), 0))
    if not total:  # not Linux: fall back on what the OS offers
        total = available = _sysconf_ram()
    cores = usable_cores(cgroup)
    from strata.experts.native import cpu_has_bf16_dots  # (imports torch: not at module level)

    return HostFacts(ram_total_bytes=total, ram_available_bytes=available, cpu_cores=cores,
                     cpu_bf16_dots=cpu_has_bf16_dots(proc / "cpuinfo"))


def _meminfo(path: Path) -> dict[str, int]:
    try:
        text = path.read_text()
    except OSError:
        return {}
    out = {}
    for line in text.splitlines():
        match = re.fullmatch(r"(\w+):\s+(\d+)\s*kB", line.strip())
        if match:
            out[match[1]] = int(match[2]) * 1024
    return out


def _sysconf_ram() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


# ---------------------------------------------------------------------------------------------- model


def read_model(path, bytes_per_param: float = 2.0, packed: bool = False) -> ModelFacts:
    """Facts from a model's own files (a Hugging Face folder, a .gguf file, or `default`; or a `ModelFiles`
    already open), reading no tensor data.

    Tensor sizes come from the checkpoint's shapes at `bytes_per_param`. Quantized weights count at their
    dequantized size, except with `packed` (the Triton kernels on a GPU keep them packed: `strata.quant.packed`)
    for the matrices the loader keeps packed, which count at their packed size (`packed_sizes`)."""
    from strata.model.loader import ModelFiles

    files = path if isinstance(path, ModelFiles) else ModelFiles.open(path)
    spec, ckpt, prefix = files.spec, files.checkpoint, files.family.prefix
    layer_re = re.compile(re.escape(prefix) + r"layers\.(\d+)\.(.*)")
    expert = [0] * spec.num_layers
    dense = [0] * spec.num_layers
    embed = head = mtp = 0
    kept = packed_sizes(ckpt, prefix) if packed else {}
    for name in ckpt.names():
        if name.endswith("_scale_inv"):  # FP8 block scales: folded into their weights as read, not held
            continue
        size = kept.get(name) or int(math.prod(ckpt.shape(name)) * bytes_per_param)
        if (match := layer_re.fullmatch(name)) is not None:
            layer, rest = int(match[1]), match[2]
            if layer >= spec.num_layers:
                continue
            if rest.startswith("mlp.experts."):
                expert[layer] += size
            else:
                dense[layer] += size
        elif name == f"{prefix}embed_tokens.weight":
            embed += size
        elif name in ("lm_head.weight", f"{prefix}norm.weight"):
            head += size
        elif name.startswith("mtp."):
            mtp += size
        # anything else (a vision tower, say) is not loaded by the engine
    if spec.tie_embeddings:
        head += embed  # a split's last stage holds the embedding again as its head
    return ModelFacts(
        name=str(ckpt.path if path is files else path), **_spec_fields(spec, bytes_per_param), expert_bytes=expert,
        dense_bytes=dense,
        embed_bytes=embed, head_bytes=head, mtp_bytes=mtp,
    )


# the loader joins these into one weight: q/k/v, gate/up, and a Gated DeltaNet layer's input projections
_FUSED = re.compile(r"(q_proj|k_proj|v_proj|gate_proj|up_proj|in_proj_qkvz|in_proj_ba|in_proj_qkv|in_proj_z|in_proj_b"
                    r"|in_proj_a)(?=\.weight$)")


def _joined_name(m: re.Match) -> str:
    part = m[1]
    return "in_proj" if part.startswith("in_proj") else "qkv" if part[0] in "qkv" else "gate_up"


def packed_sizes(ckpt, prefix: str) -> dict[str, int]:
    """name -> bytes for the tensors the loader keeps packed (the checkpoint's `packed_format`): projections,
    experts and the head, not the embedding or the router; parts the loader joins (q/k/v, gate/up) only when
    all of them share one format (else the joined weight is dequantized)."""
    from strata.quant.packed import KERNEL_FORMAT, packed_nbytes

    if not hasattr(ckpt, "packed_format"):
        return {}
    fmt = {}
    for name in ckpt.names():
        if (name == f"{prefix}embed_tokens.weight" or name.startswith("mtp.")  # (the draft layer: plain)
                or name.endswith(("mlp.gate.weight", "shared_expert_gate.weight"))):
            continue
        f = ckpt.packed_format(name)
        if f is None and hasattr(ckpt, "column_order"):  # kept packed in the file's column order (GGUF Qwen3.5)
            f = (ckpt.column_order(name) or (None,))[0]
        if f in KERNEL_FORMAT:  # (a format only the CPU's kernel reads, Q4_1, is dequantized on a GPU)
            fmt[name] = f
    joined = {name: _FUSED.sub(_joined_name, name)
              for name in ckpt.names() if _FUSED.search(name)}  # a part -> the weight it is joined into
    groups: dict[str, set] = {}
    for name, key in joined.items():
        groups.setdefault(key, set()).add(fmt.get(name))
    sizes = {}
    for name, f in fmt.items():
        if name in joined and len(groups[joined[name]]) > 1:
            continue  # joined with a part of another format: dequantized
        *lead, n, k = ckpt.shape(name)
        sizes[name] = packed_nbytes(f, n, k) * math.prod(lead)
    return sizes


def model_facts_from_spec(spec, bytes_per_param: float = 2.0, name: str | None = None) -> ModelFacts:
    """Facts computed from a `strata.model.spec.ModelSpec` alone (e.g. bench/shapes.py's real model shapes)."""
    h, b = spec.hidden_size, bytes_per_param
    a = spec.attention
    expert, dense = [], []
    for layer in spec.layers:
        params = 2 * h  # the two RMSNorms
        if layer.mixer == "attention":
            q_out = a.num_heads * a.head_dim * (2 if a.output_gate else 1)
            params += (q_out + 2 * a.num_kv_heads * a.head_dim) * h + h * a.num_heads * a.head_dim
            params += 2 * a.head_dim if a.qk_norm else 0
        else:
            g = spec.gdn
            params += (g.conv_dim + g.value_dim + 2 * g.num_v_heads) * h + g.conv_dim * g.conv_kernel
            params += 2 * g.num_v_heads + g.v_head_dim + h * g.value_dim
        if layer.mlp == "dense":
            params += 3 * h * spec.dense_dim
            expert.append(0)
        else:
            m = spec.moe
            params += m.num_experts * h + 3 * h * m.shared_dim + (h if m.shared_gate else 0)
            expert.append(int(m.num_experts * 3 * h * m.expert_dim * b))
        dense.append(int(params * b))
    embed = int(spec.vocab_size * h * b)
    return ModelFacts(
        name=name or spec.family, **_spec_fields(spec, bytes_per_param), expert_bytes=expert, dense_bytes=dense,
        embed_bytes=embed, head_bytes=embed + int(h * b), mtp_bytes=0,
    )


def _spec_fields(spec, bytes_per_param: float) -> dict:
    a, g, m = spec.attention, spec.gdn, spec.moe
    recurrent = 0
    if g is not None:  # conv history [K-1, conv_dim] in the compute dtype, recurrent state [Hv, Dk, Dv] in float32
        conv = int((g.conv_kernel - 1) * g.conv_dim * bytes_per_param)
        recurrent = conv + g.num_v_heads * g.k_head_dim * g.v_head_dim * 4
    return dict(
        num_layers=spec.num_layers,
        layer_kinds=[layer.mixer for layer in spec.layers],
        mlp_kinds=[layer.mlp for layer in spec.layers],
        num_experts=m.num_experts if m else 0,
        experts_per_token=m.top_k if m else 0,
        tie_embeddings=spec.tie_embeddings,
        kv_bytes_per_token=int(2 * a.num_kv_heads * a.head_dim * bytes_per_param),
        recurrent_bytes_per_sequence=recurrent,
        hidden_size=spec.hidden_size,
        vocab_size=spec.vocab_size,
        max_positions=spec.max_positions,
        bytes_per_param=bytes_per_param,
    )
