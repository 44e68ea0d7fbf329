"""Shared fixtures, each made once per session: the embedded default model, its `transformers` reference, and a
real `strata serve` on it."""

from __future__ import annotations

import os

# CI has no GPU: Triton kernels run under Triton's interpreter, on CPU tensors. This must be set before
# anything imports triton (the kernel modules do at import time).
os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from strata.model.loader import default_model_path  # noqa: E402


def _row_stable_interpreter_dot():
    """The interpreter's `tl.dot` as a GPU computes it: each output row's bits from that row's inputs alone.

    The interpreter runs `tl.dot` as `np.matmul`, and for float32 numpy calls OpenBLAS, whose sgemm kernels on
    some CPUs (AMD Zen here) sum a row differently by its position inside their register tile: the same row at
    tile row 0 and at tile row 5 comes out a few bits apart. A GPU's matrix instructions sum every row the same
    way, which is what the kernels' row-independence tests assert. `np.einsum` (no BLAS) sums each element in
    one fixed order, so the interpreter keeps the property the hardware has. einsum's order also follows its
    operands' memory layout, and a tile transposed in registers (`tl.trans`) is a transposed numpy view: the
    operands are made contiguous first, since a GPU's dot does not see how a tile came to be.

    bfloat16 operands: the interpreter holds bfloat16 as their uint16 bits and its `tl.dot` multiplied those bits
    as integers (values near 1e10: triton-lang/triton#11584, "not supported yet"), so every bfloat16 product of a
    kernel under the interpreter was garbage, equal on both sides of a comparison between two such runs. They are
    widened to the float32 values they are (exact: a bfloat16 is the top half of a float32), as the tensor cores
    take them, and summed in float32."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "InterpreterBuilder", None)
    if builder is None or not hasattr(builder, "create_dot"):
        return
    blas_dot = builder.create_dot

    def values(h):
        if h.dtype.is_bf16() and h.data.dtype == np.uint16:
            return (h.data.astype(np.uint32) << 16).view(np.float32)
        return h.data

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        a_data, b_data = values(a), values(b)
        if a_data.dtype != np.float32 or b_data.dtype != np.float32 or a_data.ndim != 2:
            if a_data is a.data and b_data is b.data:
                return blas_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
            product = np.matmul(a_data, b_data, dtype=d.data.dtype)  # bfloat16 widened, not 2-D
            return interpreter.TensorHandle(product + d.data, d.dtype.scalar)
        a_, b_ = np.ascontiguousarray(a_data), np.ascontiguousarray(b_data)
        product = np.einsum("mk,kn->mn", a_, b_, dtype=d.data.dtype)
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    builder.create_dot = create_dot


if os.environ.get("TRITON_INTERPRET") == "1":
    _row_stable_interpreter_dot()


@pytest.fixture(scope="session")
def default_gguf():
    return default_model_path()


@pytest.fixture(scope="session")
def hf_default_model(default_gguf):
    """transformers loading the same GGUF file into float32 (slow: load it once)."""
    import transformers  # GGUF loading also needs `accelerate`

    model = transformers.AutoModelForCausalLM.from_pretrained(
        default_gguf.parent, gguf_file=default_gguf.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def hf_default_tokenizer(default_gguf):
    import transformers

    return transformers.AutoTokenizer.from_pretrained(default_gguf.parent, gguf_file=default_gguf.name)


@pytest.fixture(scope="session")
def default_engine():
    from strata.model.loader import ModelFiles
    from strata.runtime.generate import Engine

    return Engine(ModelFiles.open("default"), max_cells=1024)


@pytest.fixture(scope="session")
def server():
    """One `strata serve --batch 4` on the embedded default, shared by the server's tests (test_server.py,
    test_reliability.py): a start costs about 10 s on two cores."""
    from tests.server_process import Server

    srv = Server("--batch", "4")
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def kube(tmp_path_factory):
    """A real Kubernetes control plane (tests/kube_cluster.py), started by the first test that needs it."""
    from tests.kube_cluster import ControlPlane

    plane = ControlPlane(tmp_path_factory.mktemp("kube"))
    try:
        plane.start()
        yield plane
    finally:
        plane.stop()
