"""A checkpoint's `quantization_config`: understood (FP8 with block scales) or refused naming its method.

FP8 block-scaled checkpoints (`quant_method: fp8`, e.g. Qwen3-30B-A3B-FP8; DeepSeek's layout): each quantized
linear weight `W` [O, I] is stored as float8 e4m3 beside `W_scale_inv` [ceil(O / bo), ceil(I / bi)] float32, one
scale per block of `weight_block_size` = [bo, bi]; its value is `W * scale` over each block (the name says
"inverse" because the quantizer divided by it). They are dequantized as they are read, in float32 then rounded
to the model's dtype, as `transformers` dequantizes them; tensors without a scale (norms, the router, the
embedding, a head left unquantized) are read as they are. Activations are not quantized: windows compute in the
model's dtype, so answers are those of the dequantized weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from strata.errors import CheckpointError

SUPPORTED = ("fp8",)
FP8_DTYPES = (torch.float8_e4m3fn,)


@dataclass(frozen=True)
class Fp8Blocks:
    block: tuple[int, int]  # (rows, columns) of a weight that share one scale

    def dequantize(self, weight: torch.Tensor, scale_inv: torch.Tensor, name: str = "") -> torch.Tensor:
        """[O, I] float8 and its [ceil(O / bo), ceil(I / bi)] scales -> [O, I] float32."""
        if weight.dtype not in FP8_DTYPES:
            raise CheckpointError(f"{name}: has a scale but its dtype is {weight.dtype}, not float8_e4m3fn")
        if weight.dim() != 2:
            raise CheckpointError(f"{name}: an FP8 weight of shape {tuple(weight.shape)}; expected [out, in]")
        bi = self.block[1]
        cols = weight.shape[1]
        scale = self.row_scales(weight, scale_inv, name).repeat_interleave(bi, 1)[:, :cols]
        return weight.float() * scale

    def row_scales(self, weight: torch.Tensor, scale_inv: torch.Tensor, name: str = "") -> torch.Tensor:
        """The block scales repeated for each row of their blocks: [O, ceil(I / bi)] float32."""
        bo, bi = self.block
        rows, cols = weight.shape
        want = (-(-rows // bo), -(-cols // bi))
        if tuple(scale_inv.shape) != want:
            raise CheckpointError(f"{name}_scale_inv: shape {tuple(scale_inv.shape)}, expected {want} for a "
                                  f"{rows} x {cols} weight in blocks of {bo} x {bi}")
        return scale_inv.float().repeat_interleave(bo, 0)[:rows].contiguous()


def read_quantization(config: dict, where: str) -> Fp8Blocks | None:
    """The checkpoint's quantization (None when its weights are plain), or a `CheckpointError` naming what is not
    supported."""
    q = config.get("quantization_config")
    if q is None:
        text = config.get("text_config") or {}
        q = text.get("quantization_config")
    if not q:
        return None
    method = q.get("quant_method")
    if method not in SUPPORTED:
        raise CheckpointError(f"{where}: quantization_config quant_method {method!r} is not supported (Strata reads "
                              f"{', '.join(SUPPORTED)} checkpoints, GGUF files, and plain float weights)")
    if q.get("fmt", "e4m3") != "e4m3":
        raise CheckpointError(f"{where}: FP8 format {q.get('fmt')!r} is not supported (e4m3 is)")
    block = q.get("weight_block_size")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(f"{where}: FP8 without weight_block_size (per-tensor or per-channel scales, got "
                              f"{block!r}) is not supported; block-scaled FP8 (e.g. [128, 128]) is")
    return Fp8Blocks((block[0], block[1]))
