"""Triton 3.6's interpreter under numpy >= 2.4: a kernel's scalar used as a Python int (a `range` bound) fails.

The interpreter holds a scalar as a 1-element array and its `__index__` is `int(data)`, which numpy 2.4 refuses
for an array of 1 dimension ("only 0-dimensional arrays can be converted to Python scalars"); Triton 3.9 squeezes
first. `patch()` makes the older interpreter squeeze too, and only where the feature test shows it fails: tests
only (the GPU never runs the interpreter).
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


def patch() -> bool:
    """Make the interpreter's `__index__` squeeze where it must; True when it was patched."""
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    if not hasattr(interpreter, "_LangPatchScope") or not _index_fails(interpreter):
        return False  # (an interpreter older than 3.6, e.g. 3.0's, is another code: see README "Versions")
    original = interpreter._patch_lang_tensor

    def patch_lang_tensor(tensor, scope) -> None:
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    interpreter._patch_lang_tensor = patch_lang_tensor
    return True
