"""CPU runs of Triton kernels for the survey: TRITON_INTERPRET=1 makes Triton execute @triton.jit kernels in its
numpy interpreter (grid cell by grid cell, on CPU tensors). Two gaps of that interpreter (triton 3.8) are closed here:
  * CUDA's libdevice externs (triton.language.extra.libdevice.log1p, tanh, ...) are stubs that return None there;
    CCE's kernels call log1p and tanh, Liger's rsqrt and tanh (imported by name: install() must run before
    the library is imported). Mapped to numpy's.
  * numpy has no bf16, so the interpreter holds bf16 as its raw uint16 bits, and its tl.dot and elementwise float
    arithmetic then compute on those bits (garbage). Here bf16 operands are widened to fp32 exactly (bf16 is the top
    half of an fp32), the op runs in fp32, and a floating result is rounded back to bf16 (round to nearest even):
    what a GPU does for bf16 elementwise math, and for tl.dot (fp32 accumulation of exact bf16 products).
  * a Python float passed to a kernel stays a Python float there (ints and bools become tl tensors), so kernels that
    call eps.to(tl.float32) on a float argument (Liger's RMSNorm) fail; compiled Triton passes it as an fp32
    scalar, and so does this.
Call install() before the first kernel runs; without TRITON_INTERPRET=1 it does nothing and returns False."""
import os

import numpy as np


def install():
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    import triton.language as tl
    from triton.language.extra import libdevice
    from triton.runtime import interpreter
    from triton.runtime.interpreter import TensorHandle, _convert_float

    def unary(np_fn):
        def fn(x, _semantic=None):
            h = x.handle
            if h.dtype.scalar == tl.bfloat16:
                y = _convert_float(np_fn(to_f32(h)), tl.float32, tl.bfloat16, None).view(np.uint16)
            else:
                y = np_fn(h.data).astype(h.data.dtype)
            return tl.core.tensor(TensorHandle(y, h.dtype.scalar), x.type)
        return fn

    for name, np_fn in (("log1p", np.log1p), ("tanh", np.tanh), ("exp", np.exp), ("log", np.log),
                        ("rsqrt", lambda x: 1 / np.sqrt(x))):
        setattr(libdevice, name, unary(np_fn))

    def is_bf16(h):
        return h.dtype.scalar == tl.bfloat16

    def to_f32(h):
        return _convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32)

    def from_f32(x):
        return _convert_float(np.asarray(x, dtype=np.float32), tl.float32, tl.bfloat16, None).view(np.uint16)

    B = interpreter.InterpreterBuilder
    original_dot, original_binary, original_unary = B.create_dot, B.binary_op, B.unary_op

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        if is_bf16(a) or is_bf16(b):
            a_data = to_f32(a) if is_bf16(a) else a.data
            b_data = to_f32(b) if is_bf16(b) else b.data
            return TensorHandle(np.matmul(a_data, b_data, dtype=d.data.dtype) + d.data, d.dtype.scalar)
        return original_dot(self, a, b, d, input_precision, max_num_imprecise_acc)

    def binary_op(self, lhs, rhs, op):
        if is_bf16(lhs) and is_bf16(rhs):
            out = op(to_f32(lhs), to_f32(rhs))
            if out.dtype == np.bool_:
                return TensorHandle(out, tl.int1)
            return TensorHandle(from_f32(out), tl.bfloat16)
        return original_binary(self, lhs, rhs, op)

    def unary_op(self, arg, op):
        if is_bf16(arg):
            return TensorHandle(from_f32(op(to_f32(arg))), tl.bfloat16)
        return original_unary(self, arg, op)

    B.create_dot, B.binary_op, B.unary_op = create_dot, binary_op, unary_op

    original_cvt = interpreter._implicit_cvt

    def implicit_cvt(arg):
        if isinstance(arg, float):
            return tl.tensor(TensorHandle(np.array([arg], dtype=np.float32), tl.float32), tl.float32)
        return original_cvt(arg)

    interpreter._implicit_cvt = implicit_cvt
    return True
