"""Triton attention kernels against the torch references, under the Triton interpreter, on odd sizes:
decode rows over a pool of sequences (plain and split in chunks), prompt windows mid-sequence, cells
past a row's position holding junk, and a decode row computed alone equal to the same row in a batch."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton compiles anything: the kernels run on the CPU

import pytest
import torch
import triton.language as tl

from strata.kernels import attention as attention_kernels
from strata.kernels.attention import (
    attention,
    decode_attention_reference,
    decode_attention_split_triton,
    decode_attention_triton,
    prefill_attention_triton,
)

if type(tl.max).__name__ == "JITFunction":  # triton's own helpers were built for the GPU
    pytest.skip(
        "triton was imported before TRITON_INTERPRET was set (by an earlier test module): "
        "set it at the top of tests/conftest.py",
        allow_module_level=True,
    )

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2)}
DTYPES = [torch.float32, torch.float16]
HEADS = [(3, 3), (6, 2), (8, 1)]  # (H, Hkv): groups of 1, 3, 8
N_SEQS = 4


def _dtype_id(dtype):
    return str(dtype).removeprefix("torch.")


def make_pool(n_cells, h, hkv, d, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    k_pool = torch.randn(N_SEQS, n_cells, hkv, d, generator=gen).to(dtype)  # [S, L, Hkv, D]
    v_pool = torch.randn(N_SEQS, n_cells, hkv, d, generator=gen).to(dtype)  # [S, L, Hkv, D]
    return k_pool, v_pool


def make_rows(rows, h, d, n_cells, dtype, seed=1, max_position=None):
    gen = torch.Generator().manual_seed(seed)
    top = n_cells if max_position is None else max_position + 1
    q = torch.randn(rows, h, d, generator=gen).to(dtype)  # [R, H, D]
    seq_ids = torch.randint(0, N_SEQS, (rows,), generator=gen, dtype=torch.int32)  # [R]
    positions = torch.randint(0, top, (rows,), generator=gen, dtype=torch.int32)  # [R]
    positions[0] = top - 1  # one row at the last usable cell
    if rows > 1:
        positions[1] = 0
    return q, seq_ids, positions


DECODE = [(r, h, hkv, d) for r, d in [(1, 24), (3, 40), (7, 24)] for h, hkv in HEADS]


def _decode_id(case):
    r, h, hkv, d = case
    return f"R={r}-H={h}-Hkv={hkv}-D={d}"


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("case", DECODE, ids=_decode_id)
def test_decode_matches_reference(case, dtype):
    r, h, hkv, d = case
    n_cells = 70  # two blocks of 64 cells
    k_pool, v_pool = make_pool(n_cells, h, hkv, d, dtype)
    q, seq_ids, positions = make_rows(r, h, d, n_cells, dtype)
    expected = decode_attention_reference(q, k_pool, v_pool, seq_ids, positions, d**-0.5)
    actual = decode_attention_triton(q, k_pool, v_pool, seq_ids, positions, d**-0.5)
    assert actual.dtype == dtype and actual.shape == (r, h, d)
    torch.testing.assert_close(actual, expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("case", [(1, 6, 2, 24), (3, 8, 1, 40)], ids=_decode_id)
def test_decode_applies_the_output_gate(case, dtype):
    """The output gate (Qwen3-Next) applied as the heads are stored: what `out * torch.sigmoid(gate)` gives after
    the kernel, with the gate a strided view of the projection (each head's rows are [q | gate])."""
    r, h, hkv, d = case
    k_pool, v_pool = make_pool(70, h, hkv, d, dtype)
    q, seq_ids, positions = make_rows(r, h, d, 70, dtype)
    q_gate = torch.cat([q, torch.randn(r, h, d, generator=torch.Generator().manual_seed(5)).to(dtype)], dim=-1)
    q, gate = q_gate.chunk(2, dim=-1)  # [R, H, D] views with a row stride of 2 * H * D
    plain = decode_attention_triton(q, k_pool, v_pool, seq_ids, positions, d**-0.5)
    gated = decode_attention_triton(q, k_pool, v_pool, seq_ids, positions, d**-0.5, gate)
    atol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(gated, plain * torch.sigmoid(gate), rtol=0, atol=atol)
    want = decode_attention_reference(q, k_pool, v_pool, seq_ids, positions, d**-0.5) * torch.sigmoid(gate)
    torch.testing.assert_close(gated, want, **TOL[dtype])


SPLIT = [(r, h, hkv, d) for r in [1, 5] for h, hkv in HEADS for d in [24]]


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("case", SPLIT, ids=_decode_id)
def test_split_decode_matches_reference(case, dtype):
    r, h, hkv, d = case
    n_cells = 200  # chunks of 64 cells: 4 chunks, the last partial
    k_pool, v_pool = make_pool(n_cells, h, hkv, d, dtype)
    q, seq_ids, positions = make_rows(r, h, d, n_cells, dtype)
    if r > 2:
        positions[2:5] = torch.tensor([63, 64, 130], dtype=torch.int32)  # chunk edges
    expected = decode_attention_reference(q, k_pool, v_pool, seq_ids, positions, d**-0.5)
    actual = decode_attention_split_triton(q, k_pool, v_pool, seq_ids, positions, d**-0.5, chunk_cells=64)
    torch.testing.assert_close(actual, expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_split_decode_merges_more_chunks_than_one_round_of_loads(dtype):
    """Rows spread over more chunks than the merge loads at a time (8 for these heads): every chunk is counted, the
    last partial round masked; the arrival counters are back at zero after the launch, so a second launch (a
    graph's next replay) gives the same bits."""
    r, h, hkv, d, n_cells = 4, 4, 2, 24, 700  # chunks of 64: 11 in the pool
    k_pool, v_pool = make_pool(n_cells, h, hkv, d, dtype)
    q, seq_ids, positions = make_rows(r, h, d, n_cells, dtype)
    positions[:] = torch.tensor([511, 512, 600, 699], dtype=torch.int32)  # 8, 9, 10 and 11 chunks
    expected = decode_attention_reference(q, k_pool, v_pool, seq_ids, positions, d**-0.5)
    first = decode_attention_split_triton(q, k_pool, v_pool, seq_ids, positions, d**-0.5, chunk_cells=64)
    torch.testing.assert_close(first, expected, **TOL[dtype])
    assert not attention_kernels._arrival_counters(q.device, r * hkv).any()
    again = decode_attention_split_triton(q, k_pool, v_pool, seq_ids, positions, d**-0.5, chunk_cells=64)
    assert torch.equal(again, first)


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_split_decode_merges_more_chunks_than_one_load_of_maxima(dtype):
    """A row over 70 chunks: the merge's largest max is taken over two loads of at most 64 chunks' maxima."""
    r, h, hkv, d, n_cells = 2, 4, 2, 16, 64 * 70
    k_pool, v_pool = make_pool(n_cells, h, hkv, d, dtype)
    q, seq_ids, positions = make_rows(r, h, d, n_cells, dtype)
    positions[:] = torch.tensor([n_cells - 1, 64 * 65 + 3], dtype=torch.int32)  # 70 and 66 chunks
    group = h // hkv  # the largest scores (2^230 and more as exp2 weights) in a chunk past the first 64
    k_pool[seq_ids[0], 64 * 66 + 5] = 40 * q[0, ::group].float().to(dtype)
    expected = decode_attention_reference(q, k_pool, v_pool, seq_ids, positions, d**-0.5)
    actual = decode_attention_split_triton(q, k_pool, v_pool, seq_ids, positions, d**-0.5, chunk_cells=64)
    torch.testing.assert_close(actual, expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
def test_split_decode_applies_the_output_gate_and_matches_one_chunk_bitwise(dtype):
    """The split variant with Qwen3-Next's output gate (applied by whichever program finishes the row): the
    reference times sigmoid(gate); rows whose cells fit the first chunk get bitwise what the one-program kernel
    gives (that chunk finishes them alone, with the same loop and roundings)."""
    r, h, hkv, d, n_cells = 5, 6, 2, 24, 200
    k_pool, v_pool = make_pool(n_cells, h, hkv, d, dtype)
    q, seq_ids, positions = make_rows(r, h, d, n_cells, dtype)
    positions[:3] = torch.tensor([0, 40, 63], dtype=torch.int32)  # within the first chunk of 64
    positions[3:] = torch.tensor([64, 190], dtype=torch.int32)
    q_gate = torch.cat([q, torch.randn(r, h, d, generator=torch.Generator().manual_seed(5)).to(dtype)], dim=-1)
    q, gate = q_gate.chunk(2, dim=-1)  # strided views, as the projection gives them
    split = decode_attention_split_triton(q, k_pool, v_pool, seq_ids, positions, d**-0.5, gate, chunk_cells=64)
    want = decode_attention_reference(q, k_pool, v_pool, seq_ids, positions, d**-0.5) * torch.sigmoid(gate)
    torch.testing.assert_close(split, want, **TOL[dtype])
    whole = decode_attention_triton(q, k_pool, v_pool, seq_ids, positions, d**-0.5, gate)
    assert torch.equal(split[:3], whole[:3])


def _with_junk_past(pool, last_positions, seq_ids, seed=2):
    """pool with every cell past the last position read in each sequence set to large values."""
    gen = torch.Generator().manual_seed(seed)
    junk = (1e4 * torch.randn(pool.shape, generator=gen)).to(pool.dtype)
    pool = pool.clone()
    for s in range(pool.shape[0]):
        mine = last_positions[seq_ids == s]
        first = int(mine.max()) + 1 if len(mine) else 0
        pool[s, first:] = junk[s, first:]
    return pool


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("split", [False, True], ids=["plain", "split"])
def test_decode_ignores_cells_past_position(split, dtype):
    r, h, hkv, d, n_cells = 5, 6, 2, 40, 300  # positions stay below 45: most of the pool is junk
    k_pool, v_pool = make_pool(n_cells, h, hkv, d, dtype)
    q, seq_ids, positions = make_rows(r, h, d, n_cells, dtype, max_position=44)
    expected = decode_attention_reference(q, k_pool[:, :45], v_pool[:, :45], seq_ids, positions, d**-0.5)
    k_junk, v_junk = _with_junk_past(k_pool, positions, seq_ids), _with_junk_past(v_pool, positions, seq_ids, seed=3)
    if split:
        actual = decode_attention_split_triton(q, k_junk, v_junk, seq_ids, positions, d**-0.5, chunk_cells=64)
    else:
        actual = decode_attention_triton(q, k_junk, v_junk, seq_ids, positions, d**-0.5)
    torch.testing.assert_close(actual, expected, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("split", [False, True], ids=["plain", "split"])
def test_decode_row_alone_equals_row_in_batch(split, dtype):
    h, hkv, d, n_cells = 8, 1, 40, 150
    k_pool, v_pool = make_pool(n_cells, h, hkv, d, dtype)
    q, seq_ids, positions = make_rows(7, h, d, n_cells, dtype, seed=4)

    def run(rows):
        if split:
            return decode_attention_split_triton(
                q[rows], k_pool, v_pool, seq_ids[rows], positions[rows], d**-0.5, chunk_cells=64
            )
        return decode_attention_triton(q[rows], k_pool, v_pool, seq_ids[rows], positions[rows], d**-0.5)

    batch = run(slice(None))
    for i in [0, 3, 6]:
        assert torch.equal(run(slice(i, i + 1))[0], batch[i])
    assert torch.equal(run(slice(2, 5)), batch[2:5])


PREFILL = [(t, p0, h, hkv, d) for t, p0, d in [(1, 0, 24), (7, 31, 40), (33, 0, 24), (70, 5, 40)] for h, hkv in HEADS]


def _prefill_id(case):
    t, p0, h, hkv, d = case
    return f"T={t}-p0={p0}-H={h}-Hkv={hkv}-D={d}"


@pytest.mark.parametrize("dtype", DTYPES, ids=_dtype_id)
@pytest.mark.parametrize("case", PREFILL, ids=_prefill_id)
def test_prefill_matches_reference(case, dtype):
    t, p0, h, hkv, d = case
    n_used = p0 + t
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(t, h, d, generator=gen).to(dtype)  # [T, H, D]
    k = torch.randn(n_used + 9, hkv, d, generator=gen)  # [L, Hkv, D]; 9 cells past the window
    v = torch.randn(n_used + 9, hkv, d, generator=gen)
    k[n_used:], v[n_used:] = 1e4, -1e4  # junk a leaked cell would show
    k, v = k.to(dtype), v.to(dtype)
    positions = torch.arange(p0, n_used, dtype=torch.int32)  # [T]
    expected = attention(q, k[:n_used], v[:n_used], positions, d**-0.5)
    actual = prefill_attention_triton(q, k, v, positions, d**-0.5)
    assert actual.dtype == dtype and actual.shape == (t, h, d)
    torch.testing.assert_close(actual, expected, **TOL[dtype])


@pytest.mark.parametrize("tiles", [(16, 16, 4, 2), (32, 16, 2, 1), (64, 32, 8, 3)], ids=str)
def test_prefill_tiles_match_reference(tiles):
    """Other block shapes: rows whose blocks of cells are all seen whole (the unmasked steps), then the ones the
    causal mask cuts, after 37 cells of earlier context."""
    t, p0, h, hkv, d = 70, 37, 4, 2, 40
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(t, h, d, generator=gen)
    k, v = torch.randn(p0 + t, hkv, d, generator=gen), torch.randn(p0 + t, hkv, d, generator=gen)
    positions = torch.arange(p0, p0 + t, dtype=torch.int32)
    expected = attention(q, k, v, positions, d**-0.5)
    actual = prefill_attention_triton(q, k, v, positions, d**-0.5, tiles)
    torch.testing.assert_close(actual, expected, **TOL[torch.float32])
