"""The Triton decode path (run here under Triton's interpreter): the same tokens as the torch path, and rows
bitwise the same alone or batched."""

from __future__ import annotations

import pytest
import torch

from strata.model.loader import ModelFiles
from strata.runtime.generate import Engine
from tests.slot_helpers import decode_logits, decode_rows_alone_and_beside
from tests.tiny_models import VOCAB, build

NEW = 6


# "qwen3_next-shared-as-expert": a shared expert of the routed experts' size, which decode windows run as one more
# pair of each row inside the experts' kernels (moe_triton's shared_pair)
VARIANTS = {"qwen3_next-shared-as-expert": ("qwen3_next", dict(shared_expert_intermediate_size=32))}


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_next-shared-as-expert", "qwen3_moe-mixed-dense",
                                        "llama-gqa-tied"])
def engines(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    case, overrides = VARIANTS.get(request.param, (request.param, {}))
    build(case, folder, **overrides)
    files = ModelFiles.open(folder)
    return (Engine(files, max_cells=128, kernels="torch"), Engine(files, max_cells=128, kernels="triton"))


# The mixed-window, short-chunk and two-stage tests exercise the windows' machinery, which differs by family only in
# whether GDN layers are there: one hybrid (the variant that runs its shared expert as a pair, the longer path),
# one MoE and one dense model keep every branch, and CI's time (qwen3_next itself runs the tests above)
MACHINERY = ["qwen3_next-shared-as-expert", "qwen3_moe-mixed-dense", "llama-gqa-tied"]


def prompt(i: int) -> list[int]:
    return [(i * 29 + j * 5 + 1) % VOCAB for j in range(4 + 3 * i)]


def test_triton_decode_gives_the_torch_tokens_and_logits(engines):
    reference, fast = engines
    ids = prompt(2)
    assert fast.generate(ids, NEW, stop_ids=frozenset()).ids == reference.generate(ids, NEW, stop_ids=frozenset()).ids
    states = reference.new_state(), fast.new_state()
    for engine, state in zip(engines, states):
        engine.run(state, ids)
    for token in (5, 17, 99):
        a, b = (engine.run(state, [token]) for engine, state in zip(engines, states))
        assert float((a - b).abs().max() / a.abs().max()) < 1e-4


def test_triton_rows_are_bitwise_the_same_alone_or_batched(engines):
    _, fast = engines
    solo = decode_logits(fast.init_slots(1), {0: prompt(1)})[0]
    batch = decode_logits(fast.init_slots(3), {0: prompt(0), 1: prompt(1), 2: prompt(3)})
    assert torch.equal(batch[1], solo)


@pytest.mark.parametrize("engines", MACHINERY, indirect=True)
def test_triton_decode_rows_are_bitwise_the_same_beside_prompt_rows(engines):
    """A mixed window on the Triton path: its decode rows (a decode window of their own, then the prompt chunk on
    the prompt kernels) give bitwise the logits they give without the prompt rows; and slots decoding while a
    prompt is read beside them in chunks give the torch path's tokens."""
    reference, fast = engines
    slots = fast.init_slots(3)
    for i in (0, 1):
        slots.admit_now(i, prompt(i + 1), 4)
    alone, mixed = decode_rows_alone_and_beside(fast, slots, [0, 1], 2, prompt(3))
    assert mixed.shape[0] == 3 and torch.equal(mixed[:2], alone)
    chunked = Engine(reference.files, max_cells=128, kernels="triton", max_window_tokens=6)
    slots = chunked.init_slots(2)
    slots.admit(0, prompt(0), NEW, stop_ids=frozenset())
    slots.commit_slots(slots.run_slots())
    slots.admit(1, prompt(4), NEW, stop_ids=frozenset())  # 16 tokens: read in chunks beside slot 0's rows
    got: dict[int, list[int]] = {}
    while slots.active:
        sw = slots.run_slots()
        for e in slots.commit_slots(sw):
            got.setdefault(e.slot, []).append(e.token)
    assert got[1] == reference.generate(prompt(4), NEW, stop_ids=frozenset()).ids
    assert got[0] == reference.generate(prompt(0), NEW, stop_ids=frozenset()).ids[1:]


@pytest.mark.parametrize("engines", MACHINERY, indirect=True)
def test_a_short_prompt_chunk_runs_with_the_decode_rows(engines):
    """On the Triton path a prompt chunk of 2 to `SHORT_CHUNK_ROWS` rows runs in its window's decode part, a row per
    position (a graph replay on a GPU instead of a prompt window's launches; GDN layers step the chunk's rows in
    order): the decoding rows beside it stay bitwise what they are alone, and its slot's tokens are the torch
    path's."""
    from strata.runtime.slots import SHORT_CHUNK_ROWS
    from strata.runtime.window import Window

    reference, fast = engines
    slots = fast.init_slots(2)
    assert slots.short_chunk_rows == 0  # on a GPU only (where the decode part is a graph replay): turned on here
    slots.short_chunk_rows = SHORT_CHUNK_ROWS
    slots.admit_now(0, prompt(1), 4)  # few tokens: the interpreter is slow
    state, chunk = slots.slots[1].state, prompt(3)  # 13 tokens
    assert len(chunk) <= SHORT_CHUNK_ROWS
    parts = [(slots.slots[0].state, [slots.slots[0].next_token], False)]
    decoding = slots.slots[0].state
    before = {i: (decoding.conv[i].clone(), decoding.recurrent[i].clone()) for i in decoding.conv}
    alone = fast.forward(Window.build(parts, fast.device))
    decoding.set_gdn(before)  # the GDN states that row advanced, as they were
    window = Window.build(parts + [(state, chunk, False, True)], fast.device)
    assert window.is_decode and window.num_rows == 1 + len(chunk)
    mixed = fast.forward(window)
    assert mixed.shape[0] == 2 and torch.equal(mixed[:1], alone)
    state.reset()
    slots.admit(1, chunk, 4, stop_ids=frozenset())
    sw = slots.run_slots()
    assert sw.window.is_decode  # the chunk beside slot 0's row: in the decode part
    got = [e.token for e in slots.commit_slots(sw) if e.slot == 1]
    while slots.active:
        got += [e.token for e in slots.commit_slots(slots.run_slots()) if e.slot == 1]
    assert got == reference.generate(chunk, 4, stop_ids=frozenset()).ids


@pytest.mark.parametrize("engines", MACHINERY, indirect=True)
def test_triton_decode_through_two_stages(engines):
    reference, fast = engines
    split = Engine(reference.files, max_cells=128, kernels="triton", layer_split="2,2", batch_groups=2)
    ids = prompt(3)
    assert split.generate(ids, NEW, stop_ids=frozenset()).ids == fast.generate(ids, NEW, stop_ids=frozenset()).ids


# the shared-as-expert variant differs from qwen3_next in its MoE only, which this attention test does not reach;
# qwen3_next (the output gate applied by the merge) and the dense model (the bitwise part) cover the kernel
@pytest.mark.parametrize("engines", ["qwen3_next", "llama-gqa-tied"], indirect=True)
def test_rows_past_the_first_chunk_decode_with_split_attention(engines, monkeypatch):
    """Rows past the first chunk of the split attention (cells in fixed chunks, merged by the last chunk to finish;
    Qwen3-Next's output gate applied by the merge): the torch path's tokens and logits, and (on the attention-only
    model: the kernel is the same for every family, and the interpreter is slow) rows bitwise the same alone or
    batched. The chunk is lowered so a short prompt crosses chunks."""
    from strata.kernels import attention

    monkeypatch.setattr(attention, "SPLIT_CELLS", 64)
    reference, fast = engines
    ids = [(j * 7 + 3) % VOCAB for j in range(70)]  # past the first chunk of 64 cells
    assert fast.generate(ids, 3, stop_ids=frozenset()).ids == reference.generate(ids, 3, stop_ids=frozenset()).ids
    states = reference.new_state(), fast.new_state()
    for engine, state in zip(engines, states):
        engine.run(state, ids)
    a, b = (engine.run(state, [5]) for engine, state in zip(engines, states))
    assert float((a - b).abs().max() / a.abs().max()) < 1e-4
    if fast.spec.gdn_layers() or fast.spec.moe is not None:
        return
    solo = decode_logits(fast.init_slots(1), {0: ids}, 2)[0]
    batch = decode_logits(fast.init_slots(3), {0: prompt(0), 1: ids, 2: prompt(3)}, 2)
    assert torch.equal(batch[1], solo)


def test_warm_up_runs_every_window_shape_and_leaves_the_engine_as_new(tmp_path):
    """The warm-up before READY (decode windows of every row count, prompt chunks of every size, requests through
    the slots) on the Triton path: it reports its progress to the end, leaves every slot empty and nothing parked,
    and requests afterwards get the torch path's tokens; its shares (what compile workers run) split it exactly."""
    from strata.runtime.warmup import warm_up

    build("llama-gqa-tied", tmp_path)
    files = ModelFiles.open(tmp_path)
    reference = Engine(files, max_cells=64, kernels="torch")
    fast = Engine(files, max_cells=64, kernels="triton", max_window_tokens=6)
    slots = fast.init_slots(2)
    seen: list[tuple[int, str]] = []
    assert warm_up(slots, progress=lambda done, what: seen.append((done, what))) > 0
    assert [d for d, _ in seen] == list(range(1, len(seen) + 1))
    kinds = {what.split(" ")[0] for _, what in seen}
    assert {"decode", "prompt", "sampler", "2"} <= kinds  # decode windows, prompt chunks, sampler, request rounds
    assert all(not s.active and s.state.length == 0 and s.state.tokens == [] for s in slots.slots)
    assert fast.parking.conversations == 0 and not slots.in_flight
    # compile workers run shares of it (`share=(k, n)`): together each item exactly once, the prompt chunks a
    # share skips still advancing its reading position; a share too leaves the slots empty
    whole = [what for _, what in seen]
    for k in (0, 1):
        share: list[str] = []
        warm_up(slots, progress=lambda done, what: share.append(what), share=(k, 2))
        assert share == whole[k::2]
        assert all(not s.active and s.state.length == 0 for s in slots.slots) and not slots.in_flight
    for i in (0, 1):
        slots.admit(i, prompt(i + 2), NEW, stop_ids=frozenset())
    got: dict[int, list[int]] = {}
    while slots.active:
        for e in slots.commit_slots(slots.run_slots()):
            got.setdefault(e.slot, []).append(e.token)
    for i in (0, 1):
        assert got[i] == reference.generate(prompt(i + 2), NEW, stop_ids=frozenset()).ids


def test_compile_workers_run_the_warm_up_on_a_model_cut_to_one_layer_of_each_kind(tmp_path):
    """The workers `strata engine` starts while it loads (`strata.runtime.precompile`): each builds the model cut
    to one layer of each (mixer, MLP) kind with random weights and runs its share of the warm-up, in a process of
    its own; here on the CPU under Triton's interpreter, where they end cleanly. On the CPU the engine starts
    none."""
    from strata.runtime.precompile import CompileWorkers, Job, layer_kinds, start_compile_workers

    build("qwen3_next", tmp_path)
    spec = ModelFiles.open(tmp_path).spec
    cut = layer_kinds(spec)
    assert {(layer.mixer, layer.mlp) for layer in cut.layers} == {(layer.mixer, layer.mlp) for layer in spec.layers}
    assert len(cut.layers) == len({(layer.mixer, layer.mlp) for layer in spec.layers}) < spec.num_layers
    workers = CompileWorkers(Job(spec, "cpu", torch.float32, 16, 4, 2, 0, kernels="triton"), 2)
    assert workers.wait() > 0
    assert [p.exitcode for p in workers.procs] == [0, 0]
    assert start_compile_workers(spec, device=torch.device("cpu"), dtype=torch.float32, kernels="triton", max_cells=16,
                                 max_window_tokens=4, num_slots=2, lookahead=0, single_stage=True) is None
