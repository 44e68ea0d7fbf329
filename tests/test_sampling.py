import math

import pytest
import torch

from strata.errors import StrataError
from strata.runtime.sampling import (
    SamplingParams,
    apply_logit_bias,
    apply_penalties,
    philox4x32,
    philox_uniform,
    sample,
    token_counts,
)

M32 = 0xFFFFFFFF

# Random123 kat_vectors, "philox4x32 10" lines: counter[4] key[2] -> output[4].
PHILOX_KAT = [
    ((0, 0, 0, 0), (0, 0), (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
    ((M32, M32, M32, M32), (M32, M32), (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
    (
        (0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344),
        (0xA4093822, 0x299F31D0),
        (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    ),
]


def philox_reference(ctr, key, rounds=10):
    """Philox4x32 in plain Python integers, key bumped before rounds 2..R."""
    c, k = list(ctr), list(key)
    for r in range(rounds):
        if r:
            k = [(k[0] + 0x9E3779B9) & M32, (k[1] + 0xBB67AE85) & M32]
        p0, p1 = 0xD2511F53 * c[0], 0xCD9E8D57 * c[2]
        c = [(p1 >> 32) ^ c[1] ^ k[0], p1 & M32, (p0 >> 32) ^ c[3] ^ k[1], p0 & M32]
    return c


def sample_one(logits_row, params, position, **penalties):
    return int(sample(logits_row[None], [params], torch.tensor([position]), **penalties)[0])


def support(logits_row, params, num_draws=3000):
    """Set of tokens drawn for one row over many seeds, all in one window."""
    logits = logits_row.expand(num_draws, -1)
    rows = [SamplingParams(**{**params.__dict__, "seed": s}) for s in range(num_draws)]
    return set(sample(logits, rows, torch.full((num_draws,), 7)).tolist())


@pytest.mark.parametrize("ctr, key, expected", PHILOX_KAT)
def test_philox4x32_10_known_answers(ctr, key, expected):
    out = philox4x32(torch.tensor([ctr]), torch.tensor([key]))
    assert out[0].tolist() == list(expected)
    assert philox_reference(ctr, key) == list(expected)


def test_philox_matches_reference_on_random_words():
    gen = torch.Generator().manual_seed(0)
    ctr = torch.randint(0, 2**32, (64, 4), generator=gen)
    key = torch.randint(0, 2**32, (64, 2), generator=gen)
    out = philox4x32(ctr, key)
    for i in range(64):
        assert out[i].tolist() == philox_reference(ctr[i].tolist(), key[i].tolist())


def test_philox_uniform_uses_top_24_bits_of_word_0():
    seed = torch.tensor([0, 0xA4093822 | (0x299F31D0 << 32)])
    counter = torch.tensor([0, 0])
    u = philox_uniform(seed, counter)
    assert u.dtype == torch.float32
    # counter (0, 0, 0, 0) -> word 0 is 0x6627e8d5 for the zero key.
    assert u[0].item() == (0x6627E8D5 >> 8) * 2.0**-24
    expected = philox_reference((0, 0, 0, 0), (0xA4093822, 0x299F31D0))[0]
    assert u[1].item() == (expected >> 8) * 2.0**-24


def test_philox_uniform_is_deterministic_and_keyed():
    seed = torch.tensor([1, 1, 2, 2**40 + 1])
    counter = torch.tensor([5, 6, 5, 5])
    a, b = philox_uniform(seed, counter), philox_uniform(seed.clone(), counter.clone())
    assert torch.equal(a, b)
    assert len(set(a.tolist())) == 4  # seed, counter and the seed's high word all matter


def test_philox_uniform_histogram():
    num_draws, num_bins = 100_000, 100
    u = philox_uniform(torch.full((num_draws,), 1234), torch.arange(num_draws))
    assert u.min() >= 0.0 and u.max() < 1.0
    counts = torch.bincount((u * num_bins).long(), minlength=num_bins).double()
    expected = num_draws / num_bins
    # Each bin within 5 sigma; chi-square (99 dof: mean 99, sd 14) within 5 sd.
    assert (counts - expected).abs().max() < 5 * math.sqrt(expected)
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 99 + 5 * 14
    assert abs(u.double().mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / num_draws)


def test_greedy_is_argmax_with_ties_to_lowest_id():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 50, generator=gen)
    logits[2, [7, 30]] = 100.0  # a tie
    out = sample(logits, [SamplingParams()] * 6, torch.zeros(6, dtype=torch.int64))
    assert out.dtype == torch.int64
    assert torch.equal(out, logits.argmax(-1))
    assert out[2].item() == 7


def test_top_k_1_equals_greedy():
    gen = torch.Generator().manual_seed(2)
    logits = torch.randn(64, 100, generator=gen)
    rows = [SamplingParams(temperature=1.5, top_k=1, seed=s) for s in range(64)]
    assert torch.equal(sample(logits, rows, torch.arange(64)), logits.argmax(-1))


def test_row_gives_same_token_alone_or_batched():
    gen = torch.Generator().manual_seed(3)
    vocab_size = 257
    logits = torch.randn(8, vocab_size, generator=gen) * 3
    rows = [
        SamplingParams(),
        SamplingParams(temperature=0.7, seed=11),
        SamplingParams(temperature=1.0, top_k=20, seed=12),
        SamplingParams(temperature=1.3, top_p=0.9, seed=13),
        SamplingParams(temperature=0.9, min_p=0.05, seed=14),
        SamplingParams(temperature=1.1, top_k=50, top_p=0.8, min_p=0.01, seed=15),
        SamplingParams(temperature=0.8, repetition_penalty=1.3, presence_penalty=0.5, seed=16),
        SamplingParams(frequency_penalty=1.0, seed=17),
    ]
    seen_prompt = torch.rand(8, vocab_size, generator=gen) < 0.1
    counts = torch.randint(0, 3, (8, vocab_size), generator=gen, dtype=torch.int32)
    for step in range(20):
        positions = torch.arange(8) * 13 + step
        batched = sample(logits, rows, positions, seen_prompt=seen_prompt, generated_counts=counts)
        for i in range(8):
            alone = sample_one(
                logits[i], rows[i], positions[i].item(),
                seen_prompt=seen_prompt[i : i + 1], generated_counts=counts[i : i + 1],
            )
            assert alone == batched[i].item(), f"row {i} step {step}"


def test_sampled_row_is_reproducible_and_varies_with_position():
    logits = torch.zeros(1000)
    params = SamplingParams(temperature=1.0, seed=99)
    first = [sample_one(logits, params, p) for p in range(30)]
    assert first == [sample_one(logits, params, p) for p in range(30)]
    assert len(set(first)) > 20


# Probabilities 0.4 0.25 0.15 0.1 0.06 0.04, placed on shuffled ids so sorted order != id order.
PROBS = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
IDS = [3, 0, 5, 1, 4, 2]  # IDS[r] holds the r-th largest probability


def hand_logits():
    logits = torch.empty(6)
    logits[IDS] = PROBS.log()
    return logits


@pytest.mark.parametrize(
    "filters, kept_ranks",
    [
        ({}, 6),
        ({"top_k": 3}, 3),
        ({"top_k": 100}, 6),
        ({"top_p": 0.6}, 2),  # 0.4 < 0.6, 0.65 reaches it
        ({"top_p": 0.7}, 3),  # 0.65 < 0.7, 0.80 reaches it
        ({"top_p": 0.3}, 1),
        ({"min_p": 0.3}, 3),  # p >= 0.12
        ({"min_p": 0.5}, 2),  # p >= 0.2
        ({"min_p": 1.0}, 1),
        # top_p counts the mass that top_k kept (0.9): 0.444, 0.722, 0.889 < 0.9 -> 4 kept.
        ({"top_k": 4, "top_p": 0.9}, 4),
        ({"top_k": 4, "top_p": 0.85}, 3),
        ({"top_k": 5, "top_p": 0.95, "min_p": 0.3}, 3),  # top_p keeps all 5 (0.9375 < 0.95), min_p cuts p < 0.12
        ({"top_k": 5, "top_p": 0.95, "min_p": 0.2}, 4),  # min_p cuts p < 0.08
    ],
)
def test_filters_keep_exactly_the_expected_tokens(filters, kept_ranks):
    params = SamplingParams(temperature=1.0, **filters)
    assert support(hand_logits(), params) == set(IDS[:kept_ranks])


def test_empirical_distribution_matches_softmax():
    logits = torch.tensor([1.0, 0.5, -0.3, 2.0, 0.0])
    temperature, num_draws = 0.7, 40_000
    rows = [SamplingParams(temperature=temperature, seed=s % 97) for s in range(num_draws)]
    positions = torch.arange(num_draws) // 97
    tokens = sample(logits.expand(num_draws, -1), rows, positions)
    counts = torch.bincount(tokens, minlength=5).double()
    expected = torch.softmax(logits.double() / temperature, -1) * num_draws
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 25  # 4 dof: p < 1e-4


PEN_LOGITS = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0]])
PEN_PROMPT = torch.tensor([[True, True, False, False, False, True]])
PEN_COUNTS = torch.tensor([[0, 1, 2, 0, 0, 0]], dtype=torch.int32)


@pytest.mark.parametrize(
    "params, expected",
    [
        # seen = prompt {0, 1, 5} + output {1, 2}: divide positives, multiply negatives (0 stays 0).
        (SamplingParams(repetition_penalty=2.0), [1.0, -2.0, 0.25, -0.5, 3.0, 0.0]),
        (SamplingParams(presence_penalty=0.5), [2.0, -1.5, 0.0, -0.5, 3.0, 0.0]),
        (SamplingParams(frequency_penalty=0.25), [2.0, -1.25, 0.0, -0.5, 3.0, 0.0]),
        (
            SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
            [1.0, -2.75, -0.75, -0.5, 3.0, 0.0],
        ),
        (SamplingParams(presence_penalty=-1.0), [2.0, 0.0, 1.5, -0.5, 3.0, 0.0]),
    ],
)
def test_penalties_hand_computed(params, expected):
    out = apply_penalties(PEN_LOGITS, [params], PEN_PROMPT, PEN_COUNTS)
    assert out.tolist() == [expected]


def test_repetition_penalty_without_prompt_mask_uses_output_only():
    out = apply_penalties(PEN_LOGITS, [SamplingParams(repetition_penalty=2.0)], None, PEN_COUNTS)
    assert out.tolist() == [[2.0, -2.0, 0.25, -0.5, 3.0, 0.0]]


def test_neutral_rows_are_bitwise_untouched():
    logits = torch.tensor(
        [[1.5, -0.0, float("-inf"), float("nan"), 1e-30, -7.25], [1.5, -0.0, float("-inf"), 2.0, 1e-30, -7.25]]
    )
    prompt = torch.ones(2, 6, dtype=torch.bool)
    counts = torch.full((2, 6), 3, dtype=torch.int32)
    rows = [SamplingParams(temperature=1.0), SamplingParams(repetition_penalty=1.5, frequency_penalty=0.1)]
    out = apply_penalties(logits, rows, prompt, counts)
    assert torch.equal(out[0].view(torch.int32), logits[0].view(torch.int32))
    assert not torch.equal(out[1], logits[1])
    # With no penalised row at all, the input comes back as is.
    assert apply_penalties(logits, [SamplingParams()] * 2, prompt, counts) is logits


def test_penalties_steer_greedy_choice():
    logits = torch.tensor([[5.0, 4.0, 1.0]])
    counts = torch.tensor([[3, 0, 0]], dtype=torch.int32)
    rows = [SamplingParams(frequency_penalty=1.0)]
    assert sample(logits, rows, torch.tensor([0]), generated_counts=counts).item() == 1


def test_logit_bias_moves_only_its_rows_tokens_and_comes_before_penalties():
    logits = torch.tensor([[5.0, 4.0, 1.0, -2.0], [5.0, 4.0, 1.0, -2.0], [0.5, 0.25, 3.0, 1.0]])
    rows = [SamplingParams(logit_bias=((0, -100.0),)), SamplingParams(),
            SamplingParams(logit_bias=((1, 2.5), (3, 100.0)))]
    out = apply_logit_bias(logits, rows)
    assert out.tolist() == [[-95.0, 4.0, 1.0, -2.0], [5.0, 4.0, 1.0, -2.0], [0.5, 2.75, 3.0, 101.0]]
    assert torch.equal(out[1].view(torch.int32), logits[1].view(torch.int32)) and logits[0, 0] == 5.0  # no change in place
    assert apply_logit_bias(logits, [SamplingParams()] * 3) is logits
    # greedy: the banned argmax gives way to the next; a +100 forces a token; a row's token is the same alone
    assert sample(logits, rows, torch.tensor([0, 0, 0])).tolist() == [1, 0, 3]
    assert sample(logits[2:], rows[2:], torch.tensor([0])).tolist() == [3]
    # sampled rows draw among the biased logits: a +100 token all but always, whatever the seed
    hot = [SamplingParams(temperature=1.0, seed=s, logit_bias=((2, 100.0),)) for s in range(16)]
    assert sample(logits[:1].expand(16, 4), hot, torch.arange(16)).tolist() == [2] * 16
    # the bias first, then the penalties: a repetition penalty divides the biased (positive) logit
    both = [SamplingParams(logit_bias=((2, 9.0),), repetition_penalty=2.0)]
    assert apply_penalties(apply_logit_bias(logits[:1], both), both, torch.tensor([[False, False, True, False]])
                           ).tolist() == [[5.0, 4.0, 5.0, -2.0]]
    assert sample(logits[:1], both, torch.tensor([0]), torch.tensor([[False, False, True, False]])).item() == 0


@pytest.mark.parametrize("bias, words", [(((3, 1.0), (1, 1.0)), "ascending"), (((1, 1.0), (1, 2.0)), "each once"),
                                         (((-1, 1.0),), ">= 0"), (((1, 100.5),), "bias 100.5"),
                                         (((1, float("nan")),), "bias nan")])
def test_logit_bias_validation_names_what_is_wrong(bias, words):
    with pytest.raises(StrataError, match=words):
        SamplingParams(logit_bias=bias).validate()


def test_token_counts_from_padded_ids():
    ids = torch.tensor([[2, 2, 0, -1], [-1, -1, -1, -1], [3, 1, 3, 3]])
    assert token_counts(ids, 4).tolist() == [[1, 0, 2, 0], [0, 0, 0, 0], [0, 1, 0, 3]]


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("min_p", -0.1),
        ("min_p", 1.01),
        ("seed", -1),
        ("seed", 2**63),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 2.5),
        ("frequency_penalty", -3.0),
    ],
)
def test_validate_names_the_bad_field(field, value):
    with pytest.raises(StrataError, match=f"{field}={value!r}"):
        SamplingParams(**{field: value}).validate()


def test_validate_accepts_defaults_and_edges():
    SamplingParams().validate()
    SamplingParams(temperature=2.0, top_p=1.0, top_k=1, min_p=1.0, seed=2**63 - 1).validate()
    assert SamplingParams().is_greedy and not SamplingParams(temperature=0.5).is_greedy


@pytest.mark.parametrize("spec", [None, "ngram:3"])
def test_logprobs_are_the_reference_log_softmax(tmp_path_factory, spec):
    """A slot asking for logprobs gets, with each token, the raw log-softmax of the model's logits there (as
    transformers computes it for the same tokens) and the top ones, most likely first; with or without drafts,
    sampled, and beside a slot that asks for none (its events carry none)."""
    from strata.model.loader import ModelFiles
    from strata.runtime.drafts import parse_spec
    from strata.runtime.generate import Engine
    from tests.tiny_models import build

    folder = tmp_path_factory.mktemp("logprobs")
    model = build("llama-gqa-tied", folder)
    engine = Engine(ModelFiles.open(str(folder)), max_cells=64,
                    speculative=parse_spec(spec, max_active=8) if spec else None)
    slots = engine.init_slots(2)
    prompt = [3, 17, 5, 9, 3, 17, 5]
    slots.admit(0, prompt, 8, SamplingParams(temperature=0.8, seed=5), stop_ids=frozenset(), logprobs=4)
    slots.admit(1, prompt[:4], 8, stop_ids=frozenset())
    events = []
    while slots.active or slots.in_flight:
        events += slots.step()
    assert all(e.logprobs is None for e in events if e.slot == 1)
    mine = [e for e in events if e.slot == 0]
    tokens = [e.token for e in mine]
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1].float(), -1)
    for e, row in zip(mine, ref):
        chosen, top = e.logprobs
        assert chosen == pytest.approx(float(row[e.token]), abs=1e-4)
        values, ids = row.topk(4)
        assert [t for t, _ in top] == ids.tolist()
        assert [v for _, v in top] == pytest.approx(values.tolist(), abs=1e-4)
