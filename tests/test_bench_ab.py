"""bench/ab.py's variants: parsed from the command line, swapped in for a block and put back after it, and a
malformed or misspelled one refused with its text."""

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

import strata.kernels.gdn as gdn
import strata.kernels.moe as moe

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def ab():
    spec = importlib.util.spec_from_file_location("bench_ab_under_test", BENCH / "ab.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    yield module
    del sys.modules[spec.name]


def test_a_variant_is_applied_inside_the_block_and_undone_after(ab):
    name, assignments = ab.parse_variant(
        "two=strata.kernels.moe:moe_triton.__defaults__=tuple(replace(d, handoff=False) if isinstance(d, ExpertTiles) "
        "else d for d in moe_triton.__defaults__); strata.kernels.gdn:STATE_WARPS=STATE_WARPS * 2")
    assert name == "two" and [a.attr for a in assignments] == ["moe_triton.__defaults__", "STATE_WARPS"]
    defaults, warps = moe.moe_triton.__defaults__, gdn.STATE_WARPS
    with ab.applied(assignments):
        tiles = [d for d in moe.moe_triton.__defaults__ if isinstance(d, moe.ExpertTiles)]
        assert tiles == [dataclasses.replace(moe.DECODE_TILES, handoff=False)]
        assert gdn.STATE_WARPS == 2 * warps
    assert moe.moe_triton.__defaults__ is defaults and gdn.STATE_WARPS == warps


def test_values_are_put_back_when_the_block_raises(ab):
    _, assignments = ab.parse_variant("x=strata.kernels.gdn:STATE_WARPS=1")
    warps = gdn.STATE_WARPS
    with pytest.raises(RuntimeError), ab.applied(assignments):
        raise RuntimeError("timing failed")
    assert gdn.STATE_WARPS == warps


@pytest.mark.parametrize("text", ["noname", "=strata.kernels.gdn:STATE_WARPS=1", "a=strata.kernels.gdn STATE_WARPS=1",
                                  "a=strata.kernels.gdn:STATE_WARPS=", "a=strata.kernels.gdn:STATE_WARPS=1;oops"])
def test_malformed_variants_are_refused_with_their_text(ab, text):
    with pytest.raises(ValueError, match="variant"):
        ab.parse_variant(text)


def test_a_misspelled_attribute_is_refused(ab):
    _, assignments = ab.parse_variant("a=strata.kernels.gdn:STATE_WRAPS=8")
    with pytest.raises(ValueError, match="STATE_WRAPS does not exist"):
        ab._owner(assignments[0])
