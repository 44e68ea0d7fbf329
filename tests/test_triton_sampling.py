"""The sampler's pick on the GPU (`pick_triton`: fixed-order running sums, the uniform number drawn in the same
program) against the torch version the CPU uses (`pick_reference` with `philox_uniform`), under the Triton
interpreter: rows longer than one block and shorter, every filter. Cuts are placed between two tokens' running
sums and positions chosen where u lands well inside a token's share (both in float64), so both versions must
land on the same rank whatever their float32 rounding."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton or strata.kernels are imported

import pytest  # noqa: E402
import torch  # noqa: E402

from strata.kernels.sampling import BLOCK, pick_triton, uniform_triton  # noqa: E402
from strata.runtime.sampling import SamplingParams, philox_uniform, pick_reference, sample  # noqa: E402


def _rows(n_rows, vocab, seed):
    """Sorted probabilities [R, V] (float32), peaked to different degrees, and their float64 running sums."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(n_rows, vocab, generator=g, dtype=torch.float64) * torch.linspace(0.5, 4.0, n_rows)[:, None]
    probs = logits.softmax(-1).sort(-1, descending=True).values.float()
    return probs, probs.double().cumsum(-1)


def _between(cum, rank):
    """A value halfway between the running sums before and at `rank` (the mass before it, and with it)."""
    lo = cum[rank - 1] if rank > 0 else torch.zeros((), dtype=cum.dtype)
    return float((lo + cum[rank]) / 2)


def _well_inside(cum_kept, seed):
    """A position whose uniform number lands at least 1e-4 of the kept mass inside a token's share, and that
    token's rank (float64)."""
    mass = cum_kept[-1]
    bounds = torch.cat([torch.zeros(1, dtype=cum_kept.dtype), cum_kept]) / mass
    for position in range(10_000):
        u = float(philox_uniform(torch.tensor([seed]), torch.tensor([position]))[0])
        j = int(torch.searchsorted(bounds[1:], torch.tensor([u], dtype=bounds.dtype), right=True)[0])
        if min(u - float(bounds[j]), float(bounds[j + 1]) - u) > 1e-4:
            return position, j
    raise AssertionError("no well-conditioned position")


def test_uniform_matches_the_torch_generator():
    seeds = torch.tensor([0, 11, 2**32 - 1, 2**32, 2**63 - 1, 123456789012345])
    counters = torch.tensor([0, 129, 2**32 + 5, 7, 2**40, 1])
    assert torch.equal(uniform_triton(seeds, counters), philox_uniform(seeds, counters))


@pytest.mark.parametrize("vocab", [37, BLOCK, 2 * BLOCK + 905], ids=lambda v: f"V={v}")
def test_pick_lands_on_the_rank_the_float64_sums_give(vocab):
    """Per row: a top_k (or none), a top-p cut between two tokens, a min-p floor (or none): both versions keep
    the same prefix and pick the rank the float64 sums give."""
    n_rows = 6
    probs, cum = _rows(n_rows, vocab, seed=vocab)
    g = torch.Generator().manual_seed(1)
    top_k, top_p, min_p, seeds, positions, want = [], [], [], [], [], []
    for r in range(n_rows):
        k = [vocab, max(2, vocab // 3), 5, vocab, vocab, 1][r]
        kept_by_k = min(k, vocab)
        mass_k = cum[r, kept_by_k - 1]
        wide = int((probs[r, :kept_by_k].double() > 1e-4 * mass_k).sum())  # shares far above float32 rounding
        cut = int(torch.randint(1, wide + 1, (1,), generator=g))  # tokens the top-p cut keeps
        p = 1.0 if r == 3 else _between(cum[r] / mass_k, cut - 1) if cut > 1 else 1e-6
        kept = kept_by_k if r == 3 else cut
        floor = 0.0
        if r == 4 and kept > 2:  # min-p keeps fewer still: a floor between two probabilities
            kept -= 1
            floor = float((probs[r, kept - 1].double() + probs[r, kept].double()) / 2 / probs[r, 0].double())
        position, j = _well_inside(cum[r, :kept], seed=100 + r)
        top_k.append(k)
        top_p.append(p)
        min_p.append(floor)
        seeds.append(100 + r)
        positions.append(position)
        want.append(j)
    top_k, seeds, positions = torch.tensor(top_k), torch.tensor(seeds), torch.tensor(positions)
    top_p, min_p = torch.tensor(top_p, dtype=torch.float32), torch.tensor(min_p, dtype=torch.float32)
    want = torch.tensor(want)
    assert torch.equal(pick_reference(probs, top_k, top_p, min_p, philox_uniform(seeds, positions)), want)
    assert torch.equal(pick_triton(probs, top_k, top_p, min_p, seeds, positions), want)


def test_a_row_that_keeps_one_token_picks_it():
    probs, _ = _rows(2, 300, seed=7)
    top_k, top_p, min_p = torch.tensor([1, 300]), torch.tensor([1.0, 1e-6]), torch.zeros(2)
    seeds, positions = torch.tensor([3, 4]), torch.tensor([10, 20])
    assert torch.equal(pick_triton(probs, top_k, top_p, min_p, seeds, positions), torch.zeros(2, dtype=torch.int64))


def test_a_rows_pick_does_not_depend_on_the_other_rows_and_takes_strided_settings():
    """Alone or among five rows, and with its settings as columns of one tensor (as `sample` packs them)."""
    probs, _ = _rows(5, 3000, seed=3)
    ints = torch.tensor([[3000, 1, 5], [40, 2, 6], [3000, 3, 7], [7, 4, 8], [3000, 5, 9]])  # top_k, seed, position
    floats = torch.tensor([[0.9, 0.0], [1.0, 0.0], [0.5, 0.01], [0.8, 0.0], [1.0, 0.2]])  # top_p, min_p
    together = pick_triton(probs, ints[:, 0], floats[:, 0], floats[:, 1], ints[:, 1], ints[:, 2])
    for r in range(5):
        one = slice(r, r + 1)
        alone = pick_triton(probs[one].clone(), ints[one, 0].clone(), floats[one, 0].clone(), floats[one, 1].clone(),
                            ints[one, 1].clone(), ints[one, 2].clone())
        assert alone[0] == together[r]


def test_sample_packs_each_rows_settings():
    """`sample` (CPU path) with rows of different settings: each row's token is the one it gets alone."""
    g = torch.Generator().manual_seed(5)
    logits = torch.randn(4, 500, generator=g)
    params = [SamplingParams(temperature=0.7, top_p=0.9, seed=1), SamplingParams(),
              SamplingParams(temperature=1.3, top_k=20, min_p=0.05, seed=2), SamplingParams(temperature=0.5, seed=3)]
    together = sample(logits, params, [3, 4, 5, 6])
    for r in range(4):
        assert sample(logits[r : r + 1], params[r : r + 1], [3 + r])[0] == together[r]
    assert together[1] == logits[1].argmax()


def test_nan_probabilities_pick_rank_0_not_an_index_out_of_range():
    """NaN logits (a broken checkpoint) make every comparison false, so no rank is kept: both versions pick rank
    0 instead of -1, which would index out of range on the device."""
    probs = torch.full((2, 50), float("nan"))
    args = torch.tensor([50, 50]), torch.tensor([0.9, 1.0]), torch.zeros(2)
    assert torch.equal(pick_reference(probs, *args, torch.tensor([0.5, 0.5])), torch.zeros(2, dtype=torch.int64))
    assert torch.equal(pick_triton(probs, *args, torch.tensor([1, 2]), torch.tensor([3, 4])),
                       torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize("scale", [1.0, 1000.0], ids=["probabilities", "weights x 1000"])
def test_picks_deep_in_a_long_row_land_on_the_float64_rank(scale):
    """A flat row four blocks long, everything kept: picks land in every block (the kernel scans only the block
    where the running sums pass the target again); a row's weights may be any positive multiple of its
    probabilities, as `sample` gives them (the softmax unnormalised)."""
    vocab = 3 * BLOCK + 17
    w = (1.0 - torch.arange(vocab, dtype=torch.float64) / (2 * vocab)) * scale  # descending, no ties
    cum = w.cumsum(0) / w.sum()
    seed = 9
    positions, want, blocks = [], [], set()
    for position in range(400):
        u = float(philox_uniform(torch.tensor([seed]), torch.tensor([position]))[0])
        j = int(torch.searchsorted(cum, torch.tensor([u], dtype=cum.dtype), right=True)[0])
        lo = float(cum[j - 1]) if j else 0.0
        if min(u - lo, float(cum[j]) - u) > 1e-3 / vocab:  # well inside the token's share
            positions.append(position)
            want.append(j)
            blocks.add(j // BLOCK)
    assert blocks == {0, 1, 2, 3}
    n = len(positions)
    probs = w.float()[None].expand(n, vocab).contiguous()
    top_k, top_p, min_p = torch.full((n,), vocab), torch.ones(n), torch.zeros(n)
    seeds, pos = torch.full((n,), seed), torch.tensor(positions)
    assert torch.equal(pick_triton(probs, top_k, top_p, min_p, seeds, pos), torch.tensor(want))
    assert torch.equal(pick_reference(probs, top_k, top_p, min_p, philox_uniform(seeds, pos)), torch.tensor(want))
