"""The jitted kernel of ``triton_checksum`` (imported only where triton is: see that module)."""
import triton
import triton.language as tl


@triton.jit
def _widen(x, BF16: tl.constexpr):
    """The bucket's type -> float32, exactly (bfloat16 by its bits: the interpreter flushes its
    subnormals)."""
    if BF16:
        out = (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        out = x.to(tl.float32)
    return out


@triton.jit
def _narrow(y, ty: tl.constexpr, BF16: tl.constexpr):
    """float32 -> the bucket's type, rounded to nearest even as torch rounds (spelled out for
    bfloat16: Triton's interpreter truncates there, and the tests run the interpreter)."""
    if BF16:
        u = y.to(tl.uint32, bitcast=True)
        r = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
        r = tl.where(y != y, 0x7FC0, r)  # NaN: a quiet NaN (its payload is the device's own)
        out = r.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = y.to(ty)
    return out


@triton.jit
def fold_kernel(x_ptr, p_ptr, q_ptr, cols, scale, SCALE: tl.constexpr, BF16: tl.constexpr,
                BLOCK: tl.constexpr):
    j = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = j < cols
    # Row k of column j is element k * cols + j: loaded once, widened exactly to float32.
    r0 = _widen(tl.load(x_ptr + 0 * cols + j, mask=mask, other=0), BF16)
    r1 = _widen(tl.load(x_ptr + 1 * cols + j, mask=mask, other=0), BF16)
    r2 = _widen(tl.load(x_ptr + 2 * cols + j, mask=mask, other=0), BF16)
    r3 = _widen(tl.load(x_ptr + 3 * cols + j, mask=mask, other=0), BF16)
    r4 = _widen(tl.load(x_ptr + 4 * cols + j, mask=mask, other=0), BF16)
    r5 = _widen(tl.load(x_ptr + 5 * cols + j, mask=mask, other=0), BF16)
    r6 = _widen(tl.load(x_ptr + 6 * cols + j, mask=mask, other=0), BF16)
    r7 = _widen(tl.load(x_ptr + 7 * cols + j, mask=mask, other=0), BF16)
    r8 = _widen(tl.load(x_ptr + 8 * cols + j, mask=mask, other=0), BF16)
    r9 = _widen(tl.load(x_ptr + 9 * cols + j, mask=mask, other=0), BF16)
    r10 = _widen(tl.load(x_ptr + 10 * cols + j, mask=mask, other=0), BF16)
    r11 = _widen(tl.load(x_ptr + 11 * cols + j, mask=mask, other=0), BF16)
    r12 = _widen(tl.load(x_ptr + 12 * cols + j, mask=mask, other=0), BF16)
    r13 = _widen(tl.load(x_ptr + 13 * cols + j, mask=mask, other=0), BF16)
    r14 = _widen(tl.load(x_ptr + 14 * cols + j, mask=mask, other=0), BF16)
    r15 = _widen(tl.load(x_ptr + 15 * cols + j, mask=mask, other=0), BF16)
    # The fold's tree (reduce_checksum._fold, halves): k + 8, then + 4, + 2, + 1.
    a0, a1, a2, a3 = r0 + r8, r1 + r9, r2 + r10, r3 + r11
    a4, a5, a6, a7 = r4 + r12, r5 + r13, r6 + r14, r7 + r15
    b0, b1, b2, b3 = a0 + a4, a1 + a5, a2 + a6, a3 + a7
    tl.store(p_ptr + j, (b0 + b2) + (b1 + b3), mask=mask)
    s0, s1, s2, s3 = r0 * r0, r1 * r1, r2 * r2, r3 * r3
    s4, s5, s6, s7 = r4 * r4, r5 * r5, r6 * r6, r7 * r7
    s8, s9, s10, s11 = r8 * r8, r9 * r9, r10 * r10, r11 * r11
    s12, s13, s14, s15 = r12 * r12, r13 * r13, r14 * r14, r15 * r15
    c0, c1, c2, c3 = s0 + s8, s1 + s9, s2 + s10, s3 + s11
    c4, c5, c6, c7 = s4 + s12, s5 + s13, s6 + s14, s7 + s15
    d0, d1, d2, d3 = c0 + c4, c1 + c5, c2 + c6, c3 + c7
    tl.store(q_ptr + j, (d0 + d2) + (d1 + d3), mask=mask)
    if SCALE:  # DDP's 1/W, in the pass that already holds the bucket
        ty = x_ptr.dtype.element_ty
        tl.store(x_ptr + 0 * cols + j, _narrow(r0 * scale, ty, BF16), mask=mask)
        tl.store(x_ptr + 1 * cols + j, _narrow(r1 * scale, ty, BF16), mask=mask)
        tl.store(x_ptr + 2 * cols + j, _narrow(r2 * scale, ty, BF16), mask=mask)
        tl.store(x_ptr + 3 * cols + j, _narrow(r3 * scale, ty, BF16), mask=mask)
        tl.store(x_ptr + 4 * cols + j, _narrow(r4 * scale, ty, BF16), mask=mask)
        tl.store(x_ptr + 5 * cols + j, _narrow(r5 * scale, ty, BF16), mask=mask)
        tl.store(x_ptr + 6 * cols + j, _narrow(r6 * scale, ty, BF16), mask=mask)
        tl.store(x_ptr + 7 * cols + j, _narrow(r7 * scale, ty, BF16), mask=mask)
        tl.store(x_ptr + 8 * cols + j, _narrow(r8 * scale, ty, BF16), mask=mask)
        tl.store(x_ptr + 9 * cols + j, _narrow(r9 * scale, ty, BF16), mask=mask)
        tl.store(x_ptr + 10 * cols + j, _narrow(r10 * scale, ty, BF16), mask=mask)
        tl.store(x_ptr + 11 * cols + j, _narrow(r11 * scale, ty, BF16), mask=mask)
        tl.store(x_ptr + 12 * cols + j, _narrow(r12 * scale, ty, BF16), mask=mask)
        tl.store(x_ptr + 13 * cols + j, _narrow(r13 * scale, ty, BF16), mask=mask)
        tl.store(x_ptr + 14 * cols + j, _narrow(r14 * scale, ty, BF16), mask=mask)
        tl.store(x_ptr + 15 * cols + j, _narrow(r15 * scale, ty, BF16), mask=mask)
