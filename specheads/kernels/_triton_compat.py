"""Work-around for triton's CPU interpreter (``TRITON_INTERPRET=1``) under numpy >= 2.4.

The interpreter turns a tensor into a Python int with ``int(array_of_size_1)``, which
numpy 2.4 refuses ("only 0-dimensional arrays can be converted to Python scalars"),
so ``for i in range(0, n)`` with a runtime ``n`` fails there (triton-lang/triton#9171,
fixed upstream by the same ``.item()`` conversion used here). Compiled kernels are
unaffected. Imported only by the Triton modules; a no-op when numpy accepts the
conversion or the interpreter internals look different.
"""

from __future__ import annotations


def patch_interpreter() -> None:
    try:
        import numpy as np

        try:
            int(np.zeros(1, dtype=np.int64))
            return  # old numpy: nothing to fix
        except TypeError:
            pass
        from triton.runtime import interpreter as _interp
    except Exception:  # pragma: no cover - no numpy / no interpreter module
        return
    if getattr(_interp, "_specheads_index_patch", False) or not hasattr(_interp, "_patch_lang_tensor"):
        return
    original = _interp._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.item()))

    _interp._patch_lang_tensor = _patch_lang_tensor
    _interp._specheads_index_patch = True
