"""Causal GQA attention reference against transformers' eager attention, on odd sizes: a prompt, a decode
row, and a window of rows starting mid-sequence; cells past the last position must not matter."""

from types import SimpleNamespace

import pytest
import torch
from transformers.models.llama.modeling_llama import eager_attention_forward

from strata.kernels.attention import attention

TOL = dict(rtol=1e-5, atol=1e-5)
HEADS = [(6, 6), (6, 2), (6, 1), (9, 3)]  # (H, Hkv): MHA, groups of 3, MQA, groups of 3 with odd H
DIMS = [20, 13]


def make_inputs(t, n_cells, h, hkv, d, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(t, h, d, generator=gen)
    k = torch.randn(n_cells, hkv, d, generator=gen)
    v = torch.randn(n_cells, hkv, d, generator=gen)
    return q, k, v


def run_hf(q, k, v, positions, scale):
    """q: [T, H, D] at positions [T]; k, v: [L, Hkv, D] -> [T, H, D] through eager_attention_forward."""
    h, hkv = q.shape[1], k.shape[1]
    module = SimpleNamespace(num_key_value_groups=h // hkv, training=False)
    visible = torch.arange(k.shape[0])[None, :] <= positions[:, None]  # [T, L]
    mask = torch.zeros(visible.shape).masked_fill(~visible, torch.finfo(torch.float32).min)
    out, _ = eager_attention_forward(
        module,
        q.transpose(0, 1)[None],  # [1, H, T, D]
        k.transpose(0, 1)[None],  # [1, Hkv, L, D]
        v.transpose(0, 1)[None],
        mask[None, None],  # [1, 1, T, L]
        scaling=scale,
    )
    return out[0]  # [T, H, D]


def check(t, p0, n_cells, h, hkv, d):
    q, k, v = make_inputs(t, n_cells, h, hkv, d)
    positions = torch.arange(p0, p0 + t)
    scale = d**-0.5
    torch.testing.assert_close(attention(q, k, v, positions, scale), run_hf(q, k, v, positions, scale), **TOL)


def _cases(lengths):
    return [(t, h, hkv, d) for t in lengths for h, hkv in HEADS for d in DIMS]


def _id(case):
    t, h, hkv, d = case
    return f"T={t}-H={h}-Hkv={hkv}-D={d}"


@pytest.mark.parametrize("case", _cases([1, 7, 33]), ids=_id)
def test_prompt_matches_transformers(case):
    t, h, hkv, d = case
    check(t, 0, t, h, hkv, d)


@pytest.mark.parametrize("case", _cases([1, 7, 65]), ids=lambda c: _id(c).replace("T=", "L=", 1))
def test_decode_row_matches_transformers(case):
    n_cells, h, hkv, d = case
    check(1, n_cells - 1, n_cells, h, hkv, d)


WINDOWS = [(t, p0, h, hkv, d) for t, p0 in [(3, 5), (7, 31), (5, 1)] for h, hkv in HEADS for d in DIMS]


def _window_id(case):
    t, p0, h, hkv, d = case
    return f"T={t}-p0={p0}-H={h}-Hkv={hkv}-D={d}"


@pytest.mark.parametrize("case", WINDOWS, ids=_window_id)
def test_window_mid_sequence_matches_transformers(case):
    t, p0, h, hkv, d = case
    check(t, p0, p0 + t, h, hkv, d)


@pytest.mark.parametrize("case", WINDOWS, ids=_window_id)
def test_cells_past_last_position_are_ignored(case):
    t, p0, h, hkv, d = case
    n_used, n_extra = p0 + t, 11
    q, k, v = make_inputs(t, n_used, h, hkv, d)
    positions = torch.arange(p0, n_used)
    expected = attention(q, k, v, positions, d**-0.5)
    gen = torch.Generator().manual_seed(1)
    # Large but finite: a leaked cell would score far above the real ones and dominate the output.
    k_junk, v_junk = 1e3 * torch.randn(2, n_extra, hkv, d, generator=gen)
    actual = attention(q, torch.cat([k, k_junk]), torch.cat([v, v_junk]), positions, d**-0.5)
    torch.testing.assert_close(actual, expected, **TOL)


def test_a_long_window_mid_sequence_matches_transformers():
    """A prompt chunk of 48 rows after 300 cells, over 400 cells (the CPU's fused attention with each row's mask)."""
    check(48, 300, 400, 9, 3, 64)
