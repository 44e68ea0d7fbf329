"""What the operator knows about a model without reading it.

The model's files live on a volume that the workloads mount and the operator does not, so it cannot call
`autoconfig.read_model`. Its facts come, in order, from `spec.modelFacts` (the JSON that `read_model` makes,
written where the model is: docs/OPERATOR.md shows the one-liner), else from the table below, which knows only the
model embedded in the image (`default`). Anything else has no facts: the operator then chooses nothing that
depends on the model's size, and says so."""

from __future__ import annotations

from pydantic import ValidationError

from autoconfig.facts import ModelFacts
from strata_operator.spec import Spec

SMOLLM2_LAYERS = 30


def smollm2_135m() -> ModelFacts:
    """The embedded default, SmolLM2-135M-Instruct, as `read_model("default")` reads its GGUF file (the tests check
    that the two agree)."""
    n = SMOLLM2_LAYERS
    return ModelFacts(
        name="default", num_layers=n, layer_kinds=["attention"] * n, mlp_kinds=["dense"] * n,
        expert_bytes=[0] * n, dense_bytes=[7_080_192] * n, embed_bytes=56_623_104, head_bytes=56_624_256,
        tie_embeddings=True, kv_bytes_per_token=768, recurrent_bytes_per_sequence=0, hidden_size=576,
        vocab_size=49_152, max_positions=8192,
    )


BUILT_IN = {"default": smollm2_135m}


class BadModelFacts(ValueError):
    """`spec.modelFacts` is not what `autoconfig.read_model` writes."""


def model_facts(spec: Spec) -> tuple[ModelFacts | None, str]:
    """The model's facts and where they came from (or, with None, why there are none)."""
    if spec.model_facts is not None:
        try:
            facts = ModelFacts.model_validate({"name": spec.model, **spec.model_facts})
        except ValidationError as e:
            raise BadModelFacts(f"spec.modelFacts is not a model's facts: {_first_error(e)}") from None
        return facts, "spec.modelFacts"
    if spec.model in BUILT_IN:
        return BUILT_IN[spec.model](), f"the operator's table ({spec.model}: the model embedded in the image)"
    return None, (f"the operator cannot read {spec.model_path} (it does not mount the model volume) and "
                  "spec.modelFacts is not given")


def _first_error(e: ValidationError) -> str:
    err = e.errors()[0]
    return f"{'.'.join(map(str, err['loc']))}: {err['msg']}"
