"""Compiled Triton refuses a kernel that reads a module-level number unless it is a `tl.constexpr`, but the
interpreter CI runs accepts it, so such a kernel passes every CPU test and fails on the first GPU call (it
happened: the sampler's 32-bit mask). This checks every jit function of `strata.kernels` for names it reads from
its module that are plain Python numbers, strings or booleans."""

import importlib
import pkgutil

import pytest
import triton
import triton.language as tl
from triton.runtime.interpreter import InterpretedFunction

import strata.kernels

MODULES = [info.name for info in pkgutil.iter_modules(strata.kernels.__path__, "strata.kernels.")]
JIT_TYPES = (triton.runtime.JITFunction, InterpretedFunction)  # what @triton.jit gives, compiled or interpreted


def _jit_functions(module):
    return [(name, f) for name, f in vars(module).items()
            if isinstance(f, JIT_TYPES) and f.fn.__module__ == module.__name__]


def _plain_globals(jit) -> list[str]:
    """The names a jit function reads from its module whose values compiled Triton refuses."""
    found = []
    for ref in jit.fn.__code__.co_names:
        value = jit.fn.__globals__.get(ref)
        if isinstance(value, (bool, int, float, str)) and not isinstance(value, tl.constexpr):
            found.append(f"{ref} = {value!r}")
    return found


@pytest.mark.parametrize("module_name", [m for m in MODULES if _jit_functions(importlib.import_module(m))])
def test_kernels_read_no_plain_module_numbers(module_name):
    bad = [f"{name} reads {ref}" for name, jit in _jit_functions(importlib.import_module(module_name))
           for ref in _plain_globals(jit)]
    assert not bad, "make these tl.constexpr (or pass them as arguments): " + "; ".join(bad)


def test_the_check_finds_the_kernels_and_a_plain_number():
    """Not vacuous: the kernel modules' jit functions are found, and a kernel reading a plain number is reported
    while one reading a constexpr is not."""
    assert len(_jit_functions(importlib.import_module("strata.kernels.sampling"))) >= 4
    assert sum(len(_jit_functions(importlib.import_module(m))) for m in MODULES) >= 30
    namespace = {"tl": tl, "triton": triton, "LIMIT": 7, "FIXED": tl.constexpr(7), "__name__": "probe"}
    exec("@triton.jit\ndef plain(p):\n    tl.store(p, LIMIT)\n\n"  # noqa: S102 - throwaway kernels
         "@triton.jit\ndef fixed(p):\n    tl.store(p, FIXED)\n", namespace)
    assert _plain_globals(namespace["plain"]) == ["LIMIT = 7"]
    assert _plain_globals(namespace["fixed"]) == []
