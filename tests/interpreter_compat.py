"""Triton 3.6's interpreter (the GPU machine's Triton) against the compiled kernels' semantics, two shims, each applied
only where its feature test shows the fault: tests only (the GPU never runs the interpreter).

- Under numpy >= 2.4 a kernel's scalar used as a Python int (a `range` bound) fails: the interpreter holds a scalar
  as a 1-element array and its `__index__` is `int(data)`, which numpy 2.4 refuses for an array of 1 dimension ("only
  0-dimensional arrays can be converted to Python scalars"); Triton 3.9 squeezes first.
- `tl.fma` rounds twice there (a * b + c in fp32) where the GPU's fma.rn.f32, and Triton 3.9's interpreter, round
  once: zo_kernels/kernels/adam.py uses it to be CPU Adam's arithmetic bit for bit. The shim computes an fp32 fma
  exactly: the product in fp64 (exact), the sum rounded to odd in fp64 (TwoSum's error moves an even result one
  step towards it), then rounded to fp32 (53 bits >= 24 + 2: no double rounding).
"""

from __future__ import annotations

from types import SimpleNamespace


def _index_fails(interpreter) -> bool:
    """True when the interpreter's tensor `__index__` cannot read a 1-element array."""
    import numpy as np

    class Probe:
        pass

    scope = interpreter._LangPatchScope()
    interpreter._patch_lang_tensor(Probe, scope)
    try:
        probe = Probe()
        probe.handle = SimpleNamespace(data=np.array([3], dtype=np.int32))
        Probe.__index__(probe)
    except TypeError:
        return True
    finally:
        scope.restore()
    return False


def fma_f32(x, y, z):
    """fp32 a * b + c rounded once (numpy arrays of one shape)."""
    import numpy as np

    with np.errstate(all="ignore"):
        p = x.astype(np.float64) * y.astype(np.float64)  # exact: 24 + 24 bits
        s = p + z.astype(np.float64)
        bb = s - p
        err = (p - (s - bb)) + (z - bb)  # TwoSum: p + z == s + err exactly
        even = (s.view(np.int64) & 1) == 0
        odd = np.where(np.isfinite(err) & (err != 0) & even, np.nextafter(s, np.where(err > 0, np.inf, -np.inf)), s)
        return odd.astype(np.float32)


def _fma_rounds_twice(interpreter) -> bool:
    """True when the interpreter's fp32 fma gives (1 + 2^-12)^2 - 1 as 2^-11 (rounded twice), not 2^-11 + 2^-24."""
    import numpy as np
    import triton.language as tl

    h = lambda v: interpreter.TensorHandle(np.array([v], dtype=np.float32), tl.float32)  # noqa: E731
    try:
        out = interpreter.InterpreterBuilder().create_fma(h(1 + 2**-12), h(1 + 2**-12), h(-1.0))
    except Exception:  # noqa: BLE001 - another interpreter's builder: leave it alone
        return False
    return float(out.data[0]) != 2**-11 + 2**-24


def patch() -> bool:
    """Apply the shims where they are needed; True when one was applied."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    patched = False
    if hasattr(interpreter, "InterpreterBuilder") and _fma_rounds_twice(interpreter):
        import numpy as np

        original_fma = interpreter.InterpreterBuilder.create_fma

        def create_fma(self, x, y, z):
            if z.data.dtype != np.float32:
                return original_fma(self, x, y, z)
            return interpreter.TensorHandle(fma_f32(*np.broadcast_arrays(x.data, y.data, z.data)), z.dtype.scalar)

        interpreter.InterpreterBuilder.create_fma = create_fma
        patched = True
    if not hasattr(interpreter, "_LangPatchScope") or not _index_fails(interpreter):
        return patched  # (an interpreter older than 3.6, e.g. 3.0's, is another code: see README "Versions")
    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_lang_tensor
    return True
