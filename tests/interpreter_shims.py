"""Shims that let SGLang 0.5.14's FLA Triton kernels run under the CPU interpreter
(``TRITON_INTERPRET=1``): used as a context manager by the tests that call them (a no-op elsewhere)."""

import contextlib
import os

import numpy as np
import pytest
import triton.language as tl
from sglang.srt.layers.attention.fla import utils as fla_utils

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _forward_to(module, name):
    def call(*args, **kwargs):  # looked up at call time: the interpreter's patched builtin
        return getattr(module, name)(*args, **kwargs)

    call.__name__ = name
    return call


@contextlib.contextmanager
def sglang_fla_on_cpu():
    """Patch (and restore) what the interpreter cannot run of SGLang's FLA kernels as they are."""
    if not INTERPRET:
        yield
        return
    import sys

    from triton.runtime import autotuner as triton_autotuner
    from triton.runtime import interpreter as ti

    with pytest.MonkeyPatch.context() as mp:
        # 1. FLA binds ``exp = tl.exp`` (and exp2, log, log2, gather, ...) as module globals; the
        #    interpreter patches builtins on ``tl`` / ``tl.math`` only, so such aliases stay unpatched.
        #    Forward them to the same builtin, resolved at call time.
        builtins = {}
        for mod in (tl, tl.math):
            for name in dir(mod):
                value = getattr(mod, name)
                if tl.core.is_builtin(value):
                    builtins.setdefault(id(value), (mod, name))
        for mod_name, module in list(sys.modules.items()):
            if module is None or not mod_name.startswith("sglang.srt.layers.attention."):
                continue
            for global_name, value in list(vars(module).items()):
                if id(value) in builtins:
                    mp.setattr(module, global_name, _forward_to(*builtins[id(value)]))
        # 2. ``input_guard`` enters ``torch.<device>.device(index)``; torch.cpu has no such context.
        mp.setattr(fla_utils, "custom_device_ctx", lambda index: contextlib.nullcontext())
        # 3. Autotuning benchmarks through the GPU driver; without one, take the first config (the
        #    configs of these kernels compute the same function; tiling and summation order differ).
        mp.setattr(triton_autotuner.Autotuner, "do_bench",
                   property(lambda self: (lambda fn, quantiles=None: [0.0, 0.0, 0.0])))
        # 4. ``tl.dot`` with bf16 operands: the interpreter stores bf16 as uint16 and np.matmul's the raw
        #    bits. Widen bf16 operands to float32 exactly (a GPU multiplies bf16 exactly, accumulates fp32).
        create_dot = ti.InterpreterBuilder.create_dot

        def widen(h):
            if h.dtype == tl.bfloat16:
                return ti.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
            return h

        mp.setattr(ti.InterpreterBuilder, "create_dot",
                   lambda self, a, b, d, *args: create_dot(self, widen(a), widen(b), d, *args))
        # 5. Guard: bf16 elementwise arithmetic would run on raw bits; make it fail loudly instead.
        binary_op, unary_op = ti.InterpreterBuilder.binary_op, ti.InterpreterBuilder.unary_op

        def guarded_binary(self, lhs, rhs, op):
            if tl.bfloat16 in (lhs.dtype.scalar, rhs.dtype.scalar):
                raise RuntimeError(f"bf16 {op.__name__} in an interpreted kernel: unsupported by the interpreter")
            return binary_op(self, lhs, rhs, op)

        def guarded_unary(self, arg, op):
            if arg.dtype.scalar == tl.bfloat16:
                raise RuntimeError(f"bf16 {op.__name__} in an interpreted kernel: unsupported by the interpreter")
            return unary_op(self, arg, op)

        mp.setattr(ti.InterpreterBuilder, "binary_op", guarded_binary)
        mp.setattr(ti.InterpreterBuilder, "unary_op", guarded_unary)
        yield
