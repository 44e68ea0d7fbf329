"""The engine: one model split over stages, and its one generation path (batch slots; `strata.runtime.slots`).

`Engine.generate` / `Engine.stream` run a request in a slot of their own, through the same windows as the
engine process: a lone request is a slot like any other."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Iterator

import torch

from strata.runtime.drafts import SpeculativeConfig
from strata.errors import PromptTooLong, StrataError
from strata.experts.budget import check_expert_budget, set_pool_threads
from strata.experts.hotness import MODES, refresh_layer
from strata.experts.residency import place_experts, residency_by_device
from strata.kernels import cpu_packed
from strata.kernels.onednn import block_stage
from strata.model.loader import ModelFiles
from strata.model.spec import ModelSpec
from strata.model.weights import StageWeights
from strata.runtime.forward import Forward
from strata.runtime.stages import Pipeline, Stage, plan_stages
from strata.runtime.sampling import SamplingParams
from strata.runtime.window import Window
from strata.state.park_disk import open_park_dir
from strata.state.parking import GB, ParkingLot, model_fingerprint, park_budget, reuse_prefix
from strata.state.park_vram import VramTier, park_vram_gb_problem
from strata.state.session import SessionState, StatePool

if TYPE_CHECKING:
    from strata.grammar import Grammars
    from strata.runtime.slots import Slots

log = logging.getLogger("strata.engine")


@dataclass
class Generation:
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" (a stop token) or "length" (max_new_tokens or max_cells reached)


class Engine:
    """One model, split over one or more stages, decoding sequences through the window forward pass."""

    def __init__(self, files: ModelFiles | None, *, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 max_cells: int = 4096, max_window_tokens: int | None = None, spec: ModelSpec | None = None,
                 weights: StageWeights | None = None, kernels: str = "auto", cuda_graphs: bool = True,
                 layer_split: str | None = None, split_device: str | None = None, batch_groups: int = 1,
                 trim_stage_weights: bool = False, expert_budget_gb: list[float] | None = None, cpu_threads: int | None = None,
                 park_gb: float | None = None, lookahead: int | None = None, speculative: SpeculativeConfig | None = None,
                 checkpoint_every: int | None = None, park_dir: str | None = None, park_disk_gb: float | None = None,
                 expert_residency: str = "fixed", pcie_frac: float = 0.0, dequantize_weights: bool = False,
                 park_vram_gb: float = 0.0):
        """Load `files` (stage by stage with `layer_split`); or, for benchmarks, run given `spec` + `weights`.
        `park_gb`: host RAM for parked conversations (`strata.state.parking.park_budget`; 0 turns parking off).
        `park_dir`, `park_disk_gb`: a folder where they are also written, and its budget (`strata.state.park_disk`;
        None: no disk tier), found again by a later engine.
        `park_vram_gb`: on a GPU, GB of VRAM per GPU where the conversations parked last are also kept, restored
        from there first (`strata.state.park_vram`; 0: none).
        `checkpoint_every`: with GDN layers, also keep their state every this many prompt tokens (`Slots`; the
        state before each prompt's last token is always kept); None turns checkpoints off.
        `pcie_frac`: the share of each CPU pool's experts whose pairs the device computes after uploading their
        weights (`strata.experts.pool`).
        `dequantize_weights`: a quantized checkpoint's weights written out in `dtype` at load even where the Triton
        kernels would read them packed (`strata.kernels.packed`; the torch kernels always dequantize)."""
        if not 0.0 <= pcie_frac <= 1.0:
            raise StrataError(f"--pcie-frac {pcie_frac}: expected a share from 0 to 1")
        if expert_residency not in MODES:
            raise StrataError(f"--expert-residency {expert_residency!r}: expected one of {', '.join(MODES)}")
        self.expert_residency_mode = expert_residency  # "hot": `refresh_experts` follows the traffic
        self.files = files
        self.spec = files.spec if files is not None else spec
        self.tokenizer = files.tokenizer if files is not None else None
        self.device, self.dtype = torch.device(device), dtype
        self._grammars = None
        self.max_cells = min(max_cells, self.spec.max_positions)
        self.max_window_tokens = default_window_tokens(self.device) if max_window_tokens is None else max_window_tokens
        if self.max_window_tokens < 1:
            raise StrataError(f"--max-window-tokens {self.max_window_tokens}: a window needs at least one row")
        self.batch_groups = batch_groups
        # windows launched ahead of the one the host reads: 1 by default on a GPU,
        # where the host then works while the device computes, 0 on the CPU, where the host computes
        self.lookahead = (1 if self.device.type == "cuda" else 0) if lookahead is None else lookahead
        self.speculative = speculative  # drafts verified in the windows (`strata.runtime.drafts`), or None
        if checkpoint_every is not None and checkpoint_every < 0:
            raise StrataError(f"--checkpoint-every {checkpoint_every}: give 0 or more prompt tokens (0: only the "
                              "checkpoint before each prompt's last token)")
        self.checkpoint_every = checkpoint_every  # GDN checkpoints while prompts are read (`Slots`), None: none
        if checkpoint_every is not None and batch_groups > 1 and self.spec.gdn_layers():
            log.warning("GDN checkpoints (--checkpoint-every) are not kept with --batch-groups %d: the stages' workers "
                        "queue the windows; a prompt is then reused only where a held or parked conversation's "
                        "every token begins it (--batch-groups 1 keeps them)", batch_groups)
        if speculative is not None:
            if lookahead == 1:
                raise StrataError(f"--spec {speculative} needs --lookahead 0: the window after a drafting slot's "
                                  "depends on how many of its drafts the model accepted")
            self.lookahead = 0
        self._solo: "Slots | None" = None  # `solo_slots`
        self.parking = ParkingLot(park_budget(park_gb), truncatable=not self.spec.gdn_layers(),
                                  fingerprint=model_fingerprint(
                                      self.spec, dtype, files.checkpoint.path if files is not None else None,
                                      getattr(files.checkpoint, "fmt", None) if files is not None else None))
        self.parking.disk = open_park_dir(park_dir, park_disk_gb, self.parking.fingerprint,
                                          pinned=self.device.type == "cuda")
        problem = park_vram_gb_problem(park_vram_gb)
        if problem is None and park_vram_gb and self.device.type != "cuda":
            problem = "copies in VRAM need the engine on a GPU (--device cuda); on the CPU give 0"
        if problem is None and park_vram_gb and not self.parking.budget:
            problem = "the copies in VRAM are of conversations parked in host RAM, and --park-gb is 0"
        if problem:
            raise StrataError(f"--park-vram-gb {park_vram_gb:g}: {problem}")
        if park_vram_gb:
            self.parking.vram = VramTier(int(park_vram_gb * GB))
        if kernels == "auto":
            kernels = "triton" if self.device.type == "cuda" else "torch"
        self.kernels = kernels
        plan = plan_stages(self.spec, layer_split, self.device, split_device, batch_groups)
        if weights is not None and not callable(weights) and len(plan) > 1:
            raise StrataError("a layer split needs a checkpoint (or a weights factory) to load each stage from")
        # expert_budget_gb: per stage, GB of routed experts kept on its device; the CPU pool computes the rest
        # (strata.experts), in cpu_threads threads (torch's, process-wide: a GPU engine does no other CPU math)
        dtype_bytes = torch.tensor([], dtype=dtype).element_size()
        packed_experts = None  # one expert's bytes where a GPU stage keeps quantized experts packed
        if expert_budget_gb is not None and files is not None and kernels == "triton" and not dequantize_weights \
                and expert_residency != "hot":
            packed_experts = packed_expert_bytes(files, dtype, dtype_bytes)
        residency = check_expert_budget(self.spec, plan, expert_budget_gb, dtype_bytes, packed_bytes=packed_experts)
        set_pool_threads(cpu_threads, residency)
        stages = []
        for k, (layers, stage_device) in enumerate(plan):
            resident = residency[k].layer_ids()  # None when every expert of the stage fits its budget
            if callable(weights):  # a factory (layers, device, trim) -> StageWeights, e.g. random weights
                w = place_experts(weights(layers, stage_device, trim_stage_weights), resident, stage_device)
            elif weights is not None:
                w = place_experts(weights, resident, stage_device)
            else:
                # the Triton kernels read quantized weights packed (`strata.kernels.packed`), and so does a CPU
                # stage's own kernel on the torch path (`strata.kernels.cpu_packed`) where it can be had
                host = kernels == "torch" and stage_device.type == "cpu" and cpu_packed.available()
                w = files.load(stage_device, dtype, layers, trim=trim_stage_weights, resident=resident,
                               packed=(kernels == "triton" or host) and not dequantize_weights,
                               split_packed=expert_residency != "hot",  # hot residency swaps plain experts
                               packed_kernels="cpu" if host else "triton")
                if kernels == "torch" and stage_device.type == "cpu":  # oneDNN's products (`strata.kernels.onednn`)
                    block_stage(w, dtype)
            graphs = cuda_graphs and kernels == "triton" and stage_device.type == "cuda"
            forward = Forward(self.spec, w, stage_device, dtype, kernels, graphs,
                              pack_pools=False if expert_residency == "hot" else None,  # swapped experts: plain
                              upload=pcie_frac)
            stages.append(Stage(k, layers, stage_device, w, forward,
                                ThreadPoolExecutor(1, thread_name_prefix=f"strata-stage{k}")))
        self.pipeline = Pipeline(stages)
        self.mtp = speculative is not None and speculative.method == "mtp"  # MTP drafts: its K/V cells in the pools
        if self.mtp:
            self._set_up_mtp(stages[-1])
        self.layer_devices = {i: s.device for s in stages for i in s.layers}
        first, last = stages[0].weights, stages[-1].weights
        self.weights = first if len(stages) == 1 else StageWeights(
            layers={i: t for s in stages for i, t in s.weights.layers.items()},
            embed=first.embed, final_norm=last.final_norm, lm_head=last.lm_head, mtp=last.mtp)

    def _set_up_mtp(self, last: Stage) -> None:
        """`--spec mtp:K`: the last stage drafts with the checkpoint's MTP layer, or the head Strata ships for it."""
        from strata.model.loader import mtp_head_for
        from strata.model.weights import mtp_tensors

        flag = f"--spec {self.speculative}"
        if self.batch_groups > 1:
            raise StrataError(f"{flag} runs with one batch group: leave --batch-groups at 1, or use ngram drafts")
        if self.files is None:
            raise StrataError(f"{flag}: MTP drafts need a checkpoint (its mtp.* tensors)")
        raw, source = last.weights.mtp, str(self.files.checkpoint.path)
        if not raw and (head := mtp_head_for(self.files.checkpoint.path)) is not None:
            from safetensors.torch import load_file

            raw, source = load_file(str(head)), str(head)
        if not raw:
            raise StrataError(f"{flag}: {source} has no multi-token-prediction weights (mtp.* tensors) and Strata "
                              "ships no MTP head for it; use --spec ngram:K")
        tensors = mtp_tensors(raw, self.files.family, self.spec, last.device, self.dtype, source)
        if last.weights.embed is None:  # a later stage of a layer split: the MTP layer embeds its tokens there
            name = f"{self.files.family.prefix}embed_tokens.weight"
            last.weights.embed = self.files.checkpoint.load(name, self.dtype).to(last.device).contiguous()
        last.forward.set_mtp(tensors)

    @property
    def grammars(self) -> "Grammars":
        """The compiled-constraint cache of this model's tokenizer and logits width (structured output), built on
        first use (about 0.3 s for a 49K vocabulary)."""
        if self._grammars is None:
            from strata.grammar import GrammarVocab, Grammars

            if self.tokenizer is None:
                raise StrataError("a constrained answer (grammar) needs the model's tokenizer, and this model has none")
            self._grammars = Grammars(GrammarVocab.build(self.tokenizer, width=self.spec.vocab_size))
        return self._grammars

    @property
    def stages(self) -> list[Stage]:
        return self.pipeline.stages

    def refresh_experts(self) -> int:
        """With `--expert-residency hot`: each pooled layer's resident set moves toward its most routed experts
        (`strata.experts.hotness`); the number of experts swapped. Call it between windows."""
        if self.expert_residency_mode != "hot":
            return 0
        return sum(refresh_layer(stage.weights.layers[i], pool) for stage in self.stages
                   for i, pool in stage.forward.pools.items())

    def expert_residency(self) -> dict[str, float]:
        """Per device ("cuda:0", "cpu"): the share of its stages' routed experts held on it (1.0 when all are, and
        for a model or stage without routed experts); the rest are computed by the CPU pool."""
        return residency_by_device(self.spec, self.stages)

    def forward(self, window: Window) -> torch.Tensor:
        """One window through every stage; the logits of its logit rows."""
        return self.pipeline(window)

    def init_slots(self, num_slots: int, lookahead: int | None = None, batch_groups: int | None = None) -> "Slots":
        """Batch slots that decode several sequences together (see `strata.runtime.slots`); `lookahead` and
        `batch_groups` default to the engine's settings."""
        from strata.runtime.slots import Slots

        groups = self.batch_groups if batch_groups is None else batch_groups
        if groups > 1 and len(self.stages) == 1:
            raise StrataError(f"--batch-groups {groups} needs --layer-split: groups pipeline through stages")
        return Slots(self, num_slots, groups, lookahead)

    def new_state(self) -> SessionState:
        return SessionState(self.new_pool(1), 0)

    def new_pool(self, num_seqs: int) -> StatePool:
        return StatePool(self.spec, range(self.spec.num_layers), num_seqs, self.max_cells, self.device, self.dtype,
                         self.layer_devices, mtp=self.mtp, keep_states=self.keep_states(num_seqs))

    def keep_states(self, num_seqs: int) -> int:
        """Keep slots a pool of `num_seqs` sequences needs for drafts on the Triton decode kernels of a model with
        GDN layers: the states after each drafted row but the last of as many slots as may draft at once
        (`--spec-max-active`), which the window writes and a rejection returns to. 0 without drafts, GDN layers or
        Triton (the torch path copies them)."""
        spec = self.speculative
        if spec is None or self.kernels != "triton" or not self.spec.gdn_layers():
            return 0
        return min(num_seqs, spec.max_active) * spec.num_speculative_tokens

    def reuse(self, state: SessionState, prompt_ids: list[int], idle: list[SessionState] = ()) -> int:
        """Before reading `prompt_ids` into `state`: keep the longest reusable prefix of it that `state`, an `idle`
        sequence or a parked conversation holds (parking what `state` held otherwise); return its length."""
        return reuse_prefix(state, prompt_ids, idle, self.parking)

    def check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise StrataError("the prompt is empty: give at least one token")
        bad = [i for i in ids if not 0 <= i < self.spec.vocab_size]
        if bad:
            raise StrataError(f"token id {bad[0]} is outside the vocabulary (0..{self.spec.vocab_size - 1})")
        if len(ids) >= self.max_cells:
            raise PromptTooLong(
                f"the prompt has {len(ids)} tokens; max_cells={self.max_cells} leaves room for at most "
                f"{self.max_cells - 1}; shorten the prompt or raise --max-cells"
            )

    @torch.inference_mode()
    def run(self, state: SessionState, ids: list[int], *, all_logits: bool = False) -> torch.Tensor:
        """Feed `ids` to `state` in windows of its own of up to `max_window_tokens` rows (a forward pass for tests
        and benchmarks; requests go through slots); the logits of the last row, or of every row."""
        outs = []
        for start in range(0, len(ids), self.max_window_tokens):
            window = Window.build([(state, ids[start : start + self.max_window_tokens], all_logits)], self.device)
            outs.append(self.forward(window))
            window.commit()
        return torch.cat(outs) if all_logits else outs[-1]

    def solo_slots(self) -> "Slots":
        """The one slot that `stream` and `generate` run requests in (made at first use, kept: a GPU's decode
        graphs are captured once per slot pool)."""
        if self._solo is None:
            self._solo = self.init_slots(1, batch_groups=1)
        return self._solo

    @torch.inference_mode()
    def stream(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams = SamplingParams(),
               stop_ids: frozenset[int] | None = None) -> Iterator[tuple[int, str | None]]:
        """Yield (token, finish_reason) pairs; finish_reason is None until the last token. The request runs in a
        slot alone (`solo_slots`), through the windows every request takes; a prefix of the prompt that the slot
        still holds from the request before is not read again. Closing the iterator early stops the request."""
        slots = self.solo_slots()
        slots.admit(0, prompt_ids, max_new_tokens, params, stop_ids)
        try:
            while slots.slots[0].active or slots.in_flight:
                for event in slots.step():
                    yield event.token, event.finish_reason
        finally:
            slots.stop(0)
            slots.flush()

    def generate(self, prompt_ids: list[int], max_new_tokens: int, params: SamplingParams = SamplingParams(),
                 stop_ids: frozenset[int] | None = None) -> Generation:
        gen = Generation(list(prompt_ids))
        if max_new_tokens <= 0:
            self.check_prompt(prompt_ids)
            gen.finish_reason = "length"
            return gen
        for token, reason in self.stream(prompt_ids, max_new_tokens, params, stop_ids):
            gen.ids.append(token)
            gen.finish_reason = reason
        return gen


DEFAULT_WINDOW_TOKENS = {"cuda": 2048, "cpu": 256}


def default_window_tokens(device: torch.device) -> int:
    """`--max-window-tokens` when not given: measured per device kind (docs/PERFORMANCE.md, bench/serve.py)."""
    return DEFAULT_WINDOW_TOKENS.get(torch.device(device).type, DEFAULT_WINDOW_TOKENS["cpu"])


def packed_expert_bytes(files: ModelFiles, dtype: torch.dtype, dtype_bytes: int) -> int | None:
    """One routed expert's bytes as the Triton kernels keep it when its weights stay quantized (the loader's own
    plan, `ModelFiles.packed_plan`: gate/up and down each packed or plain), or None when no expert is packed."""
    from strata.quant.packed import packed_nbytes

    spec = files.spec
    if spec.moe is None:
        return None
    layers, _ = files.packed_plan(dtype)
    formats = next((f for layer, f in layers.items() if spec.layers[layer].mlp == "moe"), {})
    h, i = spec.hidden_size, spec.moe.expert_dim
    parts = (("experts_gate_up", 2 * i, h), ("experts_down", h, i))
    if not any(name in formats for name, _, _ in parts):
        return None
    return sum(packed_nbytes(formats[name], n, k) if name in formats else n * k * dtype_bytes for name, n, k in parts)
