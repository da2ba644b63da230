"""4-bit NormalFloat (NF4) storage for frozen Linear weights, the base of QLoRA (kiln.model.lora, ``quantize: nf4``).

``w4 = to_nf4_weight(linear.weight, "blocks.0.mlp.c_fc")`` stores the weight as torchao's NF4Tensor (blocks of 64
values, each block's absmax scale itself quantised to 8 bits in blocks of 256, as torchtune's QLoRA; a weight whose
block count 256 does not divide, SmolLM2's 576 x 576 attention projections say, takes the largest divisor below it:
scaler_block); ``nf4_linear`` multiplies by it, dequantising on the fly in the activations' dtype. torchao is imported
only when asked for.
"""

from __future__ import annotations

import torch

NF4_BLOCK = 64  # weights sharing one absmax scale
NF4_SCALER_BLOCK = 256  # block scales sharing one 8-bit quantisation factor (double quantisation), at most
NF4_LEVELS = 16  # the 4-bit codebook: quantiles of N(0, 1) scaled to [-1, 1]
NF4_MAX_GAP = 1.0 - 0.6962  # widest gap between neighbouring codebook levels (-1.0 .. -0.6962)


def _nf4():
    import logging

    # torchao's import warns about its CUDA-only kernels on a CPU build; they are not used here
    log = logging.getLogger("torchao")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor
    except ImportError as e:
        raise ImportError("lora.quantize: nf4 needs torchao (pip install torchao==0.18.0, pinned in pyproject.toml)") from e
    finally:
        log.setLevel(level)
    return nf4_tensor


def check_nf4_shape(name: str, weight: torch.Tensor) -> None:
    """Refuse a weight NF4 cannot hold, naming the layer: in_features must be a multiple of the block size."""
    out_f, in_f = weight.shape
    if in_f % NF4_BLOCK:
        raise ValueError(f"lora.quantize nf4: layer {name!r} has in_features {in_f}, not a multiple of the NF4 block "
                         f"size {NF4_BLOCK}; choose a model width that is, leave {name.rsplit('.', 1)[-1]!r} out of "
                         "lora.targets (it then stays unquantised), or set lora.quantize: none")


def scaler_block(n_blocks: int) -> int:
    """Block scales per 8-bit quantisation factor for a weight of ``n_blocks`` NF4 blocks: 256 (QLoRA's) where it
    divides them, else the largest divisor below 256 (torchao needs a whole number of scaler blocks; a smaller one
    stores a few more factors, 4 bytes each, and the same or finer scales). Fixed by the shape alone, so a resumed
    run quantises its base to the same bits."""
    return max(d for d in range(1, min(NF4_SCALER_BLOCK, n_blocks) + 1) if n_blocks % d == 0)


def to_nf4_weight(weight: torch.Tensor, name: str) -> torch.Tensor:
    """(out, in) weight -> NF4Tensor of the same shape and dtype (its dtype is what it dequantises to)."""
    check_nf4_shape(name, weight)
    return _nf4().to_nf4(weight.detach().contiguous(), NF4_BLOCK, scaler_block(weight.numel() // NF4_BLOCK))


def is_nf4(t: torch.Tensor) -> bool:
    return type(t).__name__ == "NF4Tensor"


def dequantize(weight: torch.Tensor) -> torch.Tensor:
    """The weight as a plain tensor in its own dtype (an NF4Tensor dequantised; anything else as it is)."""
    return weight.get_original_weight() if is_nf4(weight) else weight


def nf4_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """(..., in) @ NF4 (out, in)^T -> (..., out) in x's dtype; the weight is dequantised for the matmul only."""
    out = _nf4().linear_nf4(x, weight)  # (..., out); the backward dequantises again rather than keeping a copy
    return out if bias is None else out + bias.to(out.dtype)


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds in memory: an NF4Tensor's packed codes, block scales and factors; else numel x size."""
    if is_nf4(t):
        parts = (t.quantized_data, t.quantized_scalers, t.quantization_factor, t.scaler_mean, t.nf4)
        return sum(p.numel() * p.element_size() for p in parts)
    return t.numel() * t.element_size()
