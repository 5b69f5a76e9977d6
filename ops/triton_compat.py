"""What the Triton kernels share about their environment: the CPU interpreter.

Importing this module patches Triton 3.6's interpreter for NumPy >= 2.4 when
TRITON_INTERPRET=1 (the CI tests run the kernels that way on CPU).
"""
import os


def interpreting() -> bool:
    """True when Triton kernels run under the CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _patch_interpreter_numpy2():
    """Triton 3.6's interpreter turns a loaded scalar into a Python int with
    `int(ndarray of shape (1,))`, which NumPy >= 2.4 rejects (`range(n)` with n loaded
    from memory fails). Patch its tensor.__index__ to take the single element."""
    try:
        from triton.runtime import interpreter as _interp
    except ImportError:
        return
    original = getattr(_interp, "_patch_lang_tensor", None)
    if original is None or getattr(original, "_flexsparse_compat", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._flexsparse_compat = True
    _interp._patch_lang_tensor = patched


if interpreting():
    _patch_interpreter_numpy2()
