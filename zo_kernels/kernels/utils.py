"""Device helpers shared by the Triton kernels: exact fp32 <-> 16-bit conversions.

bf16 is converted with integer operations, not `.to(tl.bfloat16)`: torch rounds to nearest even and maps
NaN to 0x7fc0; Triton's interpreter truncates (and rounds ties up under "rtne"), so a plain `.to()` would
make the CPU-interpreted kernels disagree with the GPU ones and with torch. The integer form is exact on
both. A bf16 tensor therefore reaches the kernels as its int16 bit pattern (`t.view(torch.int16)`).
"""

import triton
import triton.language as tl

# dtype codes in the tables of the multi-tensor kernels; KIND_* are the matching constexpr flags.
F32, F16, BF16 = 0, 1, 2


@triton.jit
def bf16_bits_to_f32(bits):
    """int16 bit patterns of bf16 values -> fp32 (exact)."""
    return (bits.to(tl.uint16).to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def f32_to_bf16_bits(x):
    """fp32 -> int16 bit patterns of bf16, round to nearest even, NaN -> 0x7fc0 (torch's rule)."""
    u = x.to(tl.uint32, bitcast=True)
    r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    r = tl.where(x != x, 0x7FC0, r)
    return r.to(tl.uint16).to(tl.int16, bitcast=True)


@triton.jit
def load_f32(ptr, offs, mask, KIND: tl.constexpr):
    """Load elements of a KIND (F32/F16/BF16) tensor as fp32; masked lanes read 0."""
    if KIND == 2:
        return bf16_bits_to_f32(tl.load(ptr + offs, mask=mask, other=0))
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def store_f32(ptr, offs, x, mask, KIND: tl.constexpr):
    """Store fp32 values into a KIND tensor (rounded to nearest even); returns them as stored, in fp32."""
    if KIND == 2:
        bits = f32_to_bf16_bits(x)
        tl.store(ptr + offs, bits, mask=mask)
        return bf16_bits_to_f32(bits)
    else:
        y = x.to(ptr.dtype.element_ty)
        tl.store(ptr + offs, y, mask=mask)
        return y.to(tl.float32)
