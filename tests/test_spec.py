"""Drafts (`--spec ngram:K`): a drafting slot's last token and its drafted tokens run as decode rows of one window,
and the slot keeps the drafts the model agrees with. Greedy output equals decoding without drafts, token for
token, alone and beside other slots' prompt chunks; a rejected draft leaves the state as if it was never drafted."""

from __future__ import annotations

import pytest
import torch

from strata import protocol
from strata.runtime.drafts import SpeculativeConfig, parse_spec
from strata.runtime.drafts import propose
from strata.errors import StrataError
from strata.model.loader import ModelFiles
from strata.runtime.generate import Engine
from strata.runtime.sampling import SamplingParams
from strata.runtime.scheduler import Scheduler
from tests.tiny_models import VOCAB, add_mtp_layer, build
from strata.runtime.slots import Slots

NO_STOP = frozenset()
# qwen3_next-dense: rejections inside Gated DeltaNet layers (dense MLPs: on the CPU a row's MoE output may round
# differently by where the row sits among the rows sharing its expert, which would blur the bitwise state check)
CASES = ["llama-gqa-tied", "qwen3_moe-gqa4", "qwen3_next-dense"]


def repetitive(i: int, size: int = 40) -> list[int]:
    """A prompt that repeats a short phrase with variations: the lookup finds earlier matches, the model agrees
    with some and not with others."""
    phrase = [(i * 13 + j * 5 + 1) % VOCAB for j in range(6 + i % 3)]
    out = []
    while len(out) < size:
        out += phrase + [(len(out) * 7 + i) % VOCAB]
    return out[:size]


def test_ngram_proposes_what_followed_the_latest_earlier_match():
    assert propose([1, 2, 3, 4, 5, 1, 2, 3], 3) == [4, 5, 1]
    assert propose([1, 2, 3, 9, 2, 3], 2) == [9, 2]  # the longest run found ([2, 3]), the latest place
    assert propose([5, 6, 7], 2) == []
    assert propose([1, 2, 1, 3, 1], 2) == [3, 1]  # [1] occurred last at index 2: what followed it there
    assert propose([4, 4], 3, max_n=4) == [4]
    assert propose([1, 2, 3, 4], 4) == []  # 4 never occurred before
    assert propose([7, 8, 9, 1, 8, 9], 4, max_n=1) == [1, 8, 9]  # only the last token looked up


@pytest.mark.parametrize("value, words", [
    ("ngram:0", "between 1 and 8"), ("ngram:9", "between 1 and 8"), ("ngram:x", "whole number"),
    ("eagle:3", "unknown method .eagle."), ("mtp:x", "whole number"),
])
def test_bad_spec_values_are_refused_with_what_is_wrong(value, words):
    with pytest.raises(StrataError, match=words):
        parse_spec(value)
    assert parse_spec("ngram:3") == SpeculativeConfig("ngram", 3) and parse_spec(None) is None


@pytest.fixture(scope="module", params=CASES)
def engines(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    if request.param == "qwen3_next-dense":
        build("qwen3_next", folder, mlp_only_layers=[0, 1, 2, 3])
    else:
        build(request.param, folder)
    files = ModelFiles.open(folder)
    plain = Engine(files, max_cells=256, max_window_tokens=32)
    # one-token lookups too, so that drafts are rejected as well as kept
    drafting = Engine(files, max_cells=256, max_window_tokens=32,
                      speculative=SpeculativeConfig("ngram", 4, prompt_lookup_min=1, max_active=64,
                                                  within_row_block=False))
    return plain, drafting


def test_greedy_with_drafts_equals_greedy_without_alone(engines):
    plain, drafting = engines
    for i in range(2):
        ids = repetitive(i)
        assert drafting.generate(ids, 40, stop_ids=NO_STOP).ids == plain.generate(ids, 40, stop_ids=NO_STOP).ids
    counts = drafting.solo_slots().spec_counts
    assert counts["draft_tokens"] > counts["accepted"] > 0, counts  # drafts were kept and rejected both
    per_pos = drafting.solo_slots().spec_accepted_per_pos
    assert sum(per_pos) == counts["accepted"] and per_pos == sorted(per_pos, reverse=True)


def test_a_rejected_draft_leaves_the_state_as_if_never_drafted(engines):
    """After the same answer, with drafts (some rejected) and without, the state holds the same tokens and the
    same K/V cells below its length, bit for bit."""
    plain, drafting = engines
    ids = repetitive(5)
    states = []
    for engine in (plain, drafting):
        slots = engine.init_slots(1)
        slots.admit(0, ids, 30, stop_ids=NO_STOP)
        while slots.slots[0].active or slots.in_flight:
            slots.step()
        states.append(slots.slots[0].state)
    assert drafting.init_slots(1).spec_counts is not None
    a, b = states
    assert a.tokens == b.tokens and a.length == b.length
    for layer in a.k:
        assert torch.equal(a.k[layer][: a.length], b.k[layer][: b.length])
        assert torch.equal(a.v[layer][: a.length], b.v[layer][: b.length])
    for layer in a.conv:  # Gated DeltaNet layers: rolled back to the state after the last kept row
        assert torch.equal(a.conv[layer], b.conv[layer]) and torch.equal(a.recurrent[layer], b.recurrent[layer])
    assert b.kept == {}


def test_drafting_slots_beside_prompt_chunks_give_their_solo_tokens(engines):
    """Five conversations, some drafting while others' prompts are read in chunks in the same windows (32 rows):
    each answer equals its solo answer without drafts, greedy, sampled and with penalties (a sampled row keeps a
    draft iff its seeded pick is the draft, so a seeded answer is the one without drafts); no window exceeds the
    budget."""
    plain, drafting = engines
    prompts = [repetitive(i, 20 + 9 * i) for i in range(5)]
    params = [SamplingParams(temperature=0.8, seed=7), SamplingParams(), SamplingParams(),
              SamplingParams(temperature=0.6, top_k=5, seed=3, frequency_penalty=0.5, repetition_penalty=1.3),
              SamplingParams(temperature=0.3, seed=11)]
    solo = [plain.generate(p, 30, params=q, stop_ids=NO_STOP).ids for p, q in zip(prompts, params)]
    slots = drafting.init_slots(5)
    before = dict(slots.spec_counts)
    out: dict[int, list[int]] = {}
    rows = []
    for i in range(3):
        slots.admit(i, prompts[i], 30, params[i], stop_ids=NO_STOP)
    admitted = 3
    while slots.active or slots.in_flight or admitted < 5:
        if admitted < 5 and len(out.get(1, [])) >= 6 * (admitted - 2):  # later prompts arrive mid-answer
            slots.admit(admitted, prompts[admitted], 30, params[admitted], stop_ids=NO_STOP)
            admitted += 1
        for e in slots.step():
            out.setdefault(e.slot, []).append(e.token)
        rows += [d + p for d, p in slots.take_read_log()]
    for i in range(5):
        assert out[i] == solo[i], f"conversation {i} drifted from its solo run"
    assert max(rows) <= 32
    assert slots.spec_counts["draft_tokens"] > before["draft_tokens"], (slots.spec_counts, before)


def test_the_scheduler_reports_drafts_in_spec_events(engines):
    _, drafting = engines
    lines: list[str] = []
    scheduler = Scheduler(drafting, 2, lines.append)
    scheduler.handle(f"ADD a 30 ignore_eos=1 {' '.join(map(str, repetitive(1)))}")
    while scheduler.busy:
        scheduler.step()
    spec = [line for line in lines if line.startswith("SPEC ")]
    assert spec, lines[-5:]
    drafts, drafted, accepted, *per_pos = map(int, spec[-1].split()[1:])
    assert drafted >= accepted == sum(per_pos) and drafts > 0 and len(per_pos) == 4
    tokens = [int(t) for line in lines if line.startswith("TOK ") for t in line.split()[2::2]]
    assert len(tokens) == 30
    assert spec[-1] == protocol.spec_decode(drafts, drafted, accepted, per_pos)


def test_spec_refuses_lookahead_one(tmp_path):
    with pytest.raises(StrataError, match="--lookahead 0"):
        build("llama-mha-untied", tmp_path / "llama")
        Engine(ModelFiles.open(tmp_path / "llama"), max_cells=128, lookahead=1, speculative=SpeculativeConfig("ngram", 2))


@pytest.mark.parametrize("case", ["llama-gqa-tied", "qwen3_next-dense"])
def test_drafts_on_the_triton_decode_path_give_the_same_tokens_and_state(tmp_path, monkeypatch, case):
    """The Triton decode kernels (here under Triton's interpreter) with a slot's rows at consecutive positions of
    one sequence in one decode window: each row reads the K/V its rows before wrote in the same launch sequence,
    and the GDN layers step the rows in order, leaving the states after each drafted row in the pool's keep slots.
    Drafts that are the model's own answer with one token changed, at a place that moves from window to window, are
    kept 0 to K at a time: the tokens equal those without drafts, and the state after the answer (K/V cells, GDN states)
    is bitwise the same; every keep slot is free again."""
    from strata.runtime import slots as slots_module

    if case == "qwen3_next-dense":
        build("qwen3_next", tmp_path, mlp_only_layers=[0, 1, 2, 3])
    else:
        build(case, tmp_path)
    files = ModelFiles.open(tmp_path)
    ids, n = repetitive(2, 12), 14
    plain = Engine(files, max_cells=64, kernels="triton", cuda_graphs=False)
    drafting = Engine(files, max_cells=64, kernels="triton", cuda_graphs=False,
                      speculative=SpeculativeConfig("ngram", 3, adaptive=False, within_row_block=False))
    states, answers = [], []
    for engine in (plain, drafting):
        slots = engine.init_slots(1)
        slots.admit(0, ids, n, stop_ids=NO_STOP)
        out = []
        while slots.slots[0].active or slots.in_flight:
            out += [e.token for e in slots.step()]
            if engine is plain:
                truth = ids + out
                monkeypatch.setattr(slots_module, "propose", lambda tokens, k, *_: [
                    t if j != len(tokens) // 2 % (k + 1) else (t + 1) % VOCAB for j, t in enumerate(truth[len(tokens):][:k])])
        states.append(slots.slots[0].state)
        answers.append(out)
        pool = slots.pool
    assert answers[1] == answers[0]
    counts, per_pos = slots.spec_counts, slots.spec_accepted_per_pos
    assert counts["drafts"] > per_pos[0] > per_pos[1] > 0, (counts, per_pos)  # windows that kept 0, 1 and 2 or more
    a, b = states
    assert a.tokens == b.tokens and a.length == b.length
    for layer in a.k:
        assert torch.equal(a.k[layer][: a.length], b.k[layer][: b.length])
    for layer in a.conv:
        assert torch.equal(a.conv[layer], b.conv[layer]) and torch.equal(a.recurrent[layer], b.recurrent[layer])
    assert bool(pool.keep_conv) == (case == "qwen3_next-dense") and len(pool.keep_free) == (3 if pool.keep_conv else 0)
    assert b.kept == {} and b.keep_slots == []


def test_the_warm_up_covers_the_rows_drafting_slots_add(tmp_path):
    """With --spec ngram:K the warm-up runs decode windows of up to (1 + K) rows a slot (within the budget), so a
    window of drafts finds its kernels compiled and its graph captured; the slots are left empty."""
    from strata.runtime.warmup import warm_up

    build("llama-gqa-tied", tmp_path)
    engine = Engine(ModelFiles.open(tmp_path), max_cells=64, max_window_tokens=8, kernels="triton", cuda_graphs=False,
                    speculative=SpeculativeConfig("ngram", 2))
    slots = engine.init_slots(2)
    said: list[str] = []
    warm_up(slots, progress=lambda done, what: said.append(what))
    decode = [w for w in said if w.startswith("decode window")]
    assert len(decode) == 6, decode  # 1..6 rows: two slots of 1 + 2 rows (short prompt chunks join on a GPU only)
    assert not slots.active and all(s.state.length == 0 for s in slots.slots)


def _filtered_probs(logits: torch.Tensor, temperature: float, top_k: int) -> torch.Tensor:
    """The distribution a sampled row draws from: softmax(logits / T) over the top_k tokens (ties to the lowest id)."""
    x = logits.double() / temperature
    keep = torch.sort(x, descending=True, stable=True).indices[:top_k]
    probs = torch.zeros_like(x)
    probs[keep] = torch.softmax(x[keep], dim=-1)
    return probs


def _chi_square_sf(observed: list[int], expected: list[float]) -> tuple[float, int, float]:
    """Pearson's statistic over the bins expecting 5 or more (the rest pooled into one), its degrees of freedom and
    the probability of a statistic at least as large if the samples follow `expected`."""
    big = [(o, e) for o, e in zip(observed, expected) if e >= 5]
    rest = (sum(observed) - sum(o for o, _ in big), sum(expected) - sum(e for _, e in big))
    bins = big + ([rest] if rest[1] >= 1 else [])
    stat = sum((o - e) ** 2 / e for o, e in bins)
    dof = len(bins) - 1
    sf = torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64), torch.tensor(stat / 2, dtype=torch.float64))
    return stat, dof, float(sf)


@pytest.mark.parametrize("engines", ["llama-gqa-tied"], indirect=True)
def test_sampled_rows_with_drafts_follow_the_models_distribution(engines):
    """Speculative sampling with n-gram drafts, checked against the model itself: 1,200 seeded answers of 3 tokens
    (temperature 1.5, top_k 3: 27 possible answers) with drafts. The first token comes from the prompt's window,
    the second and third from windows where drafts were proposed, kept and rejected; the answers' counts match
    the probabilities the model's logits give each answer (chi-square), and a seeded answer is the one decoding
    without drafts gives."""
    plain, drafting = engines
    prompt = [5, 9, 14, 5, 9, 14, 5, 9, 14, 5, 9, 22, 5, 9]
    temperature, top_k, n = 1.5, 3, 1200

    def answers(engine: Engine, seeds: range) -> list[tuple[int, ...]]:
        slots: Slots = engine.init_slots(16)
        out: list[tuple[int, ...]] = []
        for first in range(seeds.start, seeds.stop, 16):
            got: dict[int, list[int]] = {}
            for i, seed in enumerate(range(first, min(first + 16, seeds.stop))):
                slots.admit(i, prompt, 3, SamplingParams(temperature=temperature, top_k=top_k, seed=seed),
                            stop_ids=NO_STOP)
            while slots.active or slots.in_flight:
                for e in slots.step():
                    got.setdefault(e.slot, []).append(e.token)
            out += [tuple(got[i]) for i in sorted(got)]
        if engine is drafting:
            counts = slots.spec_counts
            assert counts["draft_tokens"] > counts["accepted"] > n // 8, counts  # kept and rejected both
        return out

    with_drafts = answers(drafting, range(n))
    assert with_drafts[:320] == answers(plain, range(320))

    # each answer's probability from the model's logits, read one sequence at a time
    def dist(ids: list[int]) -> torch.Tensor:
        return _filtered_probs(plain.run(plain.new_state(), ids)[-1], temperature, top_k)

    expected: dict[tuple[int, ...], float] = {}
    p1 = dist(prompt)
    for t1 in p1.nonzero().flatten().tolist():
        p2 = dist(prompt + [t1])
        for t2 in p2.nonzero().flatten().tolist():
            p3 = dist(prompt + [t1, t2])
            for t3 in p3.nonzero().flatten().tolist():
                expected[(t1, t2, t3)] = float(p1[t1] * p2[t2] * p3[t3]) * n
    assert set(with_drafts) <= set(expected)
    keys = sorted(expected)
    observed = [with_drafts.count(k) for k in keys]
    stat, dof, sf = _chi_square_sf(observed, [expected[k] for k in keys])
    print(f"chi-square {stat:.1f} over {dof} degrees of freedom: p = {sf:.3f}")
    assert dof >= 10 and sf > 1e-3, (stat, dof, sf)


# MTP drafts (`--spec mtp:K`): the checkpoint's multi-token-prediction layer, chained K times


class ReferenceMTP(torch.nn.Module):
    """The MTP layer written with `transformers`' own pieces of the model's family, over whole sequences: row t reads
    the model's final hidden state at t and the token at t + 1, [norm(embed) | norm(hidden)] -> fc -> the family's
    full-attention decoder layer (causal over the rows, rotary at position t) -> norm -> the head over the draft
    vocabulary."""

    def __init__(self, model, tensors: dict[str, torch.Tensor]):
        super().__init__()
        cfg = model.config
        cfg._attn_implementation = "eager"
        inner = model.model
        kinds = getattr(cfg, "layer_types", None) or ["full_attention"] * cfg.num_hidden_layers
        index = max(i for i, kind in enumerate(kinds) if kind == "full_attention")
        self.model, self.vocab = model, tensors.get("mtp.draft_vocab")
        self.layer = type(inner.layers[index])(cfg, layer_idx=index)
        self.layer.load_state_dict({k[len("mtp.layers.0."):]: v for k, v in tensors.items() if k.startswith("mtp.layers.0.")})
        self.rotary = type(inner.rotary_emb)(cfg)
        self.norms = {name: type(inner.norm)(cfg.hidden_size, eps=cfg.rms_norm_eps) for name in
                      ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm")}
        for name, norm in self.norms.items():
            norm.weight.data = tensors[f"mtp.{name}.weight"].clone()
        self.fc = tensors["mtp.fc.weight"]

    @torch.no_grad()
    def __call__(self, hidden: torch.Tensor, next_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """hidden [T, H], next_ids [T] (the token after each row) -> (normed outputs [T, H], draft ids [T])."""
        e = self.norms["pre_fc_norm_embedding"](self.model.model.embed_tokens(next_ids))
        x = torch.nn.functional.linear(torch.cat([e, self.norms["pre_fc_norm_hidden"](hidden)], -1), self.fc)[None]
        t = x.shape[1]
        positions = torch.arange(t)[None]
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        out = self.layer(x, attention_mask=mask, position_ids=positions, position_embeddings=self.rotary(x, positions))
        out = self.norms["norm"](out[0] if isinstance(out, tuple) else out)[0]
        head = self.model.lm_head.weight if self.vocab is None else self.model.lm_head.weight[self.vocab]
        picks = (out @ head.T).argmax(-1)
        return out, picks if self.vocab is None else self.vocab[picks]

    def drafts(self, ids: list[int], k: int) -> list[int]:
        """The k chained drafts after `ids` (its last token is the next to decode)."""
        seq = torch.tensor(ids)
        hidden = self.model(seq[None], output_hidden_states=True).hidden_states[-1][0]  # after the final norm
        h, nxt = hidden[:-1], seq[1:]
        out, picks = self(h, nxt)
        drafts = [int(picks[-1])]
        for _ in range(k - 1):  # a chained row: the previous step's output and draft, one position on
            h = torch.cat([h, out[-1:]])
            nxt = torch.cat([nxt, torch.tensor([drafts[-1]])])
            out, picks = self(h, nxt)
            drafts.append(int(picks[-1]))
        return drafts


@pytest.fixture(scope="module", params=CASES)
def mtp_model(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"{request.param}-mtp")
    if request.param == "qwen3_next-dense":  # the Qwen3-Next layout, its drafts rolled back in the GDN layers
        model = build("qwen3_next", folder, mlp_only_layers=[0, 1, 2, 3])
    else:
        model = build(request.param, folder)
    tensors = add_mtp_layer(folder, model, draft_vocab=list(range(0, VOCAB, 2)) + [1, 3, 5])
    return folder, model, tensors


def test_mtp_drafts_are_the_reference_layers_chained_and_greedy_is_unchanged(mtp_model):
    """Two conversations with MTP drafts (K=2 every window), prompts read in chunks of 8 rows beside the other's
    decoding: every window's drafts equal `transformers`' decoder layer run over the whole sequence and chained
    (so the MTP cells made window by window, across prompt chunks and after rejections, are right), and the
    greedy answers equal those without drafts."""
    check_mtp_drafts(mtp_model, "torch", [repetitive(3, 19), repetitive(4, 11)], 12)


@pytest.mark.parametrize("mtp_model", ["qwen3_next-dense", "qwen3_moe-gqa4"], indirect=True)
def test_mtp_drafts_on_the_triton_decode_path(mtp_model):
    """The same on the Triton kernels (under Triton's interpreter): the decode windows return their rows' final
    hidden states for the MTP layer, the GDN layers step each drafting slot's rows in order and roll back from the
    keep slots, and an MTP layer with experts runs them on the Triton MoE kernels."""
    check_mtp_drafts(mtp_model, "triton", [repetitive(3, 9), repetitive(4, 5)], 6)  # the interpreter is slow


def check_mtp_drafts(mtp_model, kernels: str, prompts: list[list[int]], n: int) -> None:
    folder, model, tensors = mtp_model
    files = ModelFiles.open(folder)
    graphs = dict(cuda_graphs=False) if kernels == "triton" else {}
    plain = Engine(files, max_cells=128, kernels=kernels, **graphs)
    engine = Engine(files, max_cells=128, max_window_tokens=8, kernels=kernels, **graphs,
                    speculative=SpeculativeConfig("mtp", 2, adaptive=False, within_row_block=False))
    reference = ReferenceMTP(model.eval(), tensors)
    slots = engine.init_slots(2)
    seen: list[tuple[list[int], list[int]]] = []
    out: dict[int, list[int]] = {}
    slots.admit(0, prompts[0], n, stop_ids=NO_STOP)
    slots.admit(1, prompts[1], n, stop_ids=NO_STOP)
    while slots.active or slots.in_flight:
        for e in slots.step():
            out.setdefault(e.slot, []).append(e.token)
        seen += [(s.state.tokens + [s.next_token], list(s.mtp_drafts)) for s in slots.slots if s.active and s.mtp_drafts]
    for i, p in enumerate(prompts):
        assert out[i] == plain.generate(p, n, stop_ids=NO_STOP).ids
    assert len(seen) >= n and any(len(d) == 2 for _, d in seen)
    for ids, drafts in seen:
        assert drafts == reference.drafts(ids, len(drafts)), f"after {len(ids)} tokens"
    assert slots.spec_counts["drafts"] >= n - 2


@pytest.mark.parametrize("mtp_model", ["llama-gqa-tied"], indirect=True)
@pytest.mark.parametrize("cap", [512, 5])
def test_a_paused_mtp_layer_catches_up_when_drafting_resumes(mtp_model, cap, monkeypatch):
    """--spec-max-active 1: while two conversations decode, no draft fits, so the MTP layer does not run at all
    (its rows wait in the slots; with a cap of 5 rows a slot, they are read whenever more would wait); once one
    has ended, the other drafts again from cells that read every row it held: its drafts equal the reference's
    over the whole sequence, and the answers are unchanged."""
    from strata.runtime import slots as slots_module

    monkeypatch.setattr(slots_module, "MTP_PENDING_ROWS", cap)
    folder, model, tensors = mtp_model
    files = ModelFiles.open(folder)
    plain = Engine(files, max_cells=128)
    engine = Engine(files, max_cells=128, max_window_tokens=16,
                    speculative=SpeculativeConfig("mtp", 2, adaptive=False, max_active=1, within_row_block=False))
    reference = ReferenceMTP(model.eval(), tensors)
    prompts = [repetitive(5, 13), repetitive(6, 17)]
    slots = engine.init_slots(2)
    calls = []
    run_mtp = engine.stages[-1].forward.run_mtp
    engine.stages[-1].forward.run_mtp = lambda *a: calls.append(len(slots.active)) or run_mtp(*a)
    slots.admit(0, prompts[0], 6, stop_ids=NO_STOP)
    slots.admit(1, prompts[1], 24, stop_ids=NO_STOP)
    out: dict[int, list[int]] = {}
    seen = []
    waiting = []
    while slots.active or slots.in_flight:
        for e in slots.step():
            out.setdefault(e.slot, []).append(e.token)
        waiting += [sum(len(p[2]) for p in s.mtp_pending) for s in slots.slots]
        s = slots.slots[1]
        if s.active and s.mtp_drafts:
            seen.append((s.state.tokens + [s.next_token], list(s.mtp_drafts)))
    assert [out[0], out[1]] == [plain.generate(p, n, stop_ids=NO_STOP).ids for p, n in zip(prompts, (6, 24))]
    assert max(waiting) <= cap
    if cap > 20:
        assert calls and calls[0] == 1, calls  # no MTP pass while both were active
    else:
        assert 2 in calls  # the capped rows were read while both were active
    assert len(seen) >= 5 and all(d == reference.drafts(ids, len(d)) for ids, d in seen)
    assert slots.spec_counts["drafts"] >= 5


@pytest.mark.parametrize("mtp_model", ["llama-gqa-tied", "qwen3_next-dense"], indirect=True)
def test_mtp_cells_come_back_with_a_reused_or_parked_prefix(mtp_model):
    """A follow-up that reuses a parked conversation's prefix (and one that reuses an idle slot's) drafts from MTP
    cells that were parked and restored (copied) with the rest: its drafts equal the reference's. The hybrid model
    keeps GDN checkpoints as `strata serve` does by default."""
    folder, model, tensors = mtp_model
    engine = Engine(ModelFiles.open(folder), max_cells=128, checkpoint_every=0,
                    speculative=SpeculativeConfig("mtp", 2, adaptive=False, within_row_block=False))
    reference = ReferenceMTP(model.eval(), tensors)
    slots = engine.init_slots(2)

    def run(slot: int, ids: list[int], n: int) -> tuple[int, list[int], list[tuple[list[int], list[int]]]]:
        reused = slots.admit(slot, ids, n, stop_ids=NO_STOP)
        out, seen = [], []
        while slots.active or slots.in_flight:
            out += [e.token for e in slots.step()]
            s = slots.slots[slot]
            if s.active and s.mtp_drafts:
                seen.append((s.state.tokens + [s.next_token], list(s.mtp_drafts)))
        return reused, out, seen

    first = repetitive(8, 21)
    _, answer, _ = run(0, first, 8)
    run(0, repetitive(9, 14), 4)  # another conversation in the slot: the first is parked
    assert engine.parking.conversations >= 1
    # from parking into slot 0; then slot 1 copies slot 0's idle state (not a hybrid model's: its GDN state cannot
    # be cut back to the shorter prompt, no checkpoint was kept for 2 tokens read)
    for slot in (0,) if engine.spec.gdn_layers() else (0, 1):
        reused, _, seen = run(slot, first + answer + [7, 8], 6)
        assert reused >= len(first), (slot, reused)
        assert seen and all(d == reference.drafts(ids, len(d)) for ids, d in seen)


def test_mtp_refusals_name_what_is_wrong(tmp_path):
    build("llama-mha-untied", tmp_path)
    files = ModelFiles.open(tmp_path)
    with pytest.raises(StrataError, match="no multi-token-prediction weights"):
        Engine(files, max_cells=64, speculative=SpeculativeConfig("mtp", 2))


@pytest.mark.parametrize("engines", ["llama-gqa-tied"], indirect=True)
def test_no_slot_drafts_while_more_than_spec_max_active_slots_are_active(engines):
    """--spec-max-active 1: two conversations decode without drafts (and give their solo answers); once one has
    ended, the other drafts again."""
    plain, _ = engines
    engine = Engine(plain.files, max_cells=256, max_window_tokens=32,
                    speculative=SpeculativeConfig("ngram", 4, prompt_lookup_min=1, max_active=1,
                                                  within_row_block=False))
    slots = engine.init_slots(2)
    prompts = [repetitive(1), repetitive(2)]
    slots.admit(0, prompts[0], 6, stop_ids=NO_STOP)
    slots.admit(1, prompts[1], 30, stop_ids=NO_STOP)
    out: dict[int, list[int]] = {}
    drafted_while_both = 0
    while slots.active or slots.in_flight:
        both = len(slots.active) == 2
        before = slots.spec_counts["draft_tokens"]
        for e in slots.step():
            out.setdefault(e.slot, []).append(e.token)
        drafted_while_both += both * (slots.spec_counts["draft_tokens"] - before)
    assert drafted_while_both == 0 and slots.spec_counts["draft_tokens"] > 0
    assert [out[0], out[1]] == [plain.generate(p, n, stop_ids=NO_STOP).ids for p, n in zip(prompts, (6, 30))]


@pytest.mark.parametrize("engines", ["llama-gqa-tied"], indirect=True)
def test_on_the_cpu_drafts_take_only_the_rows_free_in_the_last_row_block(engines, monkeypatch):
    """A decode window's products run in blocks of rows (here 4): drafts kept to the free rows (MTP's by default)
    fill the rows the decoding slots leave free in their last block and never start a block of their own; four
    decoding slots fill theirs, so none drafts while four are active. The answers stay the solo ones."""
    assert parse_spec("mtp:2").keeps_to_free_rows and not parse_spec("ngram:2").keeps_to_free_rows
    from strata.kernels import invariant

    monkeypatch.setattr(invariant, "_blocks", {})
    monkeypatch.setenv("STRATA_ROW_BLOCK", "4")
    plain, _ = engines
    engine = Engine(plain.files, max_cells=256, max_window_tokens=32,
                    speculative=SpeculativeConfig("ngram", 4, prompt_lookup_min=1, max_active=64,
                                                  within_row_block=True))
    slots = engine.init_slots(4)
    assert slots.row_block == 4
    prompts = [repetitive(i, 24) for i in range(4)]
    lengths = (6, 14, 22, 30)
    for i, (p, n) in enumerate(zip(prompts, lengths)):
        slots.admit(i, p, n, stop_ids=NO_STOP)
    out: dict[int, list[int]] = {}
    windows = []  # (slots decoding when the window was built, its decode rows with drafts)
    while slots.active or slots.in_flight:
        decoding = sum(s.active and not s.unread for s in slots.slots)
        for e in slots.step():
            out.setdefault(e.slot, []).append(e.token)
        windows += [(decoding, d) for d, _ in slots.take_read_log() if d]
    assert [out[i] for i in range(4)] == [plain.generate(p, n, stop_ids=NO_STOP).ids for p, n in zip(prompts, lengths)]
    assert all(rows <= 4 for _, rows in windows), windows
    assert all(rows == 4 for n, rows in windows if n == 4)  # no drafts beside four decoding slots
    assert any(rows > n for n, rows in windows if n < 4) and slots.spec_counts["draft_tokens"] > 0, windows


@pytest.mark.parametrize("mtp_model", ["qwen3_next-dense"], indirect=True)
@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_drafts_through_a_two_stage_split_give_the_one_stage_tokens(mtp_model, method):
    """A layer split over two stages: drafting slots beside each other give the tokens of the one-stage engine
    without drafts; MTP drafts run on the last stage (its cells and the token embedding there)."""
    folder, _, _ = mtp_model
    files = ModelFiles.open(folder)
    plain = Engine(files, max_cells=128)
    split = Engine(files, max_cells=128, layer_split="2,2", max_window_tokens=16,
                   speculative=SpeculativeConfig(method, 3, prompt_lookup_min=1, max_active=8,
                                                 within_row_block=False))
    prompts = [repetitive(6, 18), repetitive(7, 9)]
    slots = split.init_slots(2)
    out: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        slots.admit(i, p, 16, stop_ids=NO_STOP)
    while slots.active or slots.in_flight:
        for e in slots.step():
            out.setdefault(e.slot, []).append(e.token)
    assert [out[0], out[1]] == [plain.generate(p, 16, stop_ids=NO_STOP).ids for p in prompts]
    assert slots.spec_counts["drafts"] > 0


def test_the_default_models_mtp_head_drafts_what_the_model_writes(default_engine):
    """`--model default --spec mtp:3` loads the head Strata ships (train/mtp_head.py): a chat answer with its drafts
    equals the one without, and the head's first drafts are right far above chance (8,192 draft tokens)."""
    engine = Engine(default_engine.files, max_cells=1024,
                    speculative=SpeculativeConfig("mtp", 3, within_row_block=False))
    tok = engine.tokenizer
    ids = tok.encode_chat([{"role": "user", "content": "Explain in a few sentences why the sky is blue."}])
    plain = default_engine.generate(ids, 36, stop_ids=NO_STOP).ids
    assert engine.generate(ids, 36, stop_ids=NO_STOP).ids == plain
    counts = engine.solo_slots().spec_counts
    first = engine.solo_slots().spec_accepted_per_pos[0] / counts["drafts"]
    assert counts["drafts"] >= 10 and first >= 0.1, (counts, first)
    # on the CPU's torch kernels the MTP layer's float matrices run on oneDNN's products, as the model's do, also
    # where the model's head is packed for the CPU's own kernel (its draft rows kept packed)
    mtp = engine.stages[-1].forward.mtp
    assert all(mtp[k].is_mkldnn for k in ("fc", "qkv", "o", "gate_up", "down")), {k: type(v) for k, v in mtp.items()}
    head = engine.weights.lm_head
    assert getattr(head, "host_kernel", False) == (getattr(mtp["head"], "host_kernel", False))
    assert tuple(mtp["head"].shape) == (8192, head.shape[1])


def test_on_the_packed_cpu_kernel_no_row_comes_free_and_mtp_drafts_are_not_proposed(caplog):
    """The embedded default's products run on the CPU's packed kernel, each row unpadded: its block is one row, so
    MTP drafts (kept to free rows) are not proposed, and the log says why; n-gram drafts still are."""
    import logging

    from strata.model.loader import ModelFiles

    with caplog.at_level(logging.WARNING, logger="strata.engine"):
        engine = Engine(ModelFiles.open("default"), max_cells=256, speculative=parse_spec("mtp:2"))
        slots = engine.init_slots(1)
    assert slots.row_block == 1
    assert any("are not proposed" in r.getMessage() for r in caplog.records)
    ids = engine.tokenizer.encode("Repeat: one two three one two three one two three")
    slots.admit(0, ids, 12, stop_ids=NO_STOP)
    while slots.active or slots.in_flight:
        slots.step()
    assert slots.spec_counts["draft_tokens"] == 0
    ngram = Engine(ModelFiles.open("default"), max_cells=256,
                   speculative=SpeculativeConfig("ngram", 3, prompt_lookup_min=1)).init_slots(1)
    assert ngram.row_block == 1 and not ngram.speculative.keeps_to_free_rows
    ngram.admit(0, ids, 12, stop_ids=NO_STOP)
    while ngram.active or ngram.in_flight:
        ngram.step()
    assert ngram.spec_counts["draft_tokens"] > 0
