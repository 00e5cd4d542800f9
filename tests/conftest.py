import os

# Tests never reach the network: the testbed model and tokenizer are local files.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

# Triton kernels run on the CPU through Triton's interpreter when there is no GPU. The variable is read
# when a kernel is decorated, so it is set before any hfkv.kernels module is imported.
try:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:  # pragma: no cover
    pass


import gc  # noqa: E402

import pytest  # noqa: E402


@pytest.fixture(scope="module")
def frozen_heap():
    """For code that collects garbage before what it times (``hfkv bench``, ``gpu_check``): in a test process that
    has run hundreds of tests each collection walks their leftovers (seconds each, most of a minute a module).
    Frozen for the module, they are not walked; unfrozen after it, they are collectable again."""
    gc.freeze()
    yield
    gc.unfreeze()


def _faster_interpreter() -> None:
    """Two costs out of Triton's interpreter, neither changing what it computes. (1) It patches ``triton.language``
    for a kernel's launch, and again at every call of a ``@triton.jit`` helper inside it (``InterpretedFunction.
    __call__``: an ``inspect.getmembers`` of five modules, ~1 ms, whose replacements are the ones already in place,
    and never restored); hfkv's kernels make tens of thousands of helper calls in the suite. Inside a launch whose
    patch already covers a helper's language modules, the helper's patch is skipped; anything else goes to Triton's
    own. (2) The numpy dtype of a Triton type, a dict of 19 entries built at each of ~10^6 calls, is remembered per
    scalar type."""
    try:
        import triton.language as tl
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover
        return
    original = getattr(interpreter, "_patch_lang", None)
    scope_class = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_class is None or getattr(original, "_hfkv_tests", False):
        return
    import inspect

    running: list[set[int]] = []  # the language modules the running launch has patched (launches never nest)
    langs_by_fn: dict = {}

    def langs_of(fn) -> frozenset[int]:
        try:
            return langs_by_fn[fn]
        except KeyError:
            found = frozenset(id(v) for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))
            return langs_by_fn.setdefault(fn, found)

    def patch_lang(fn):
        langs = langs_of(fn)
        if running and langs <= running[0]:
            return scope_class()  # a helper inside a launch: already patched, nothing to restore
        scope = original(fn)
        if running:  # a helper that reads a module the launch did not patch: Triton patched it, kept for the launch
            running[0] |= langs
            return scope
        running.append(set(langs))
        restore = scope.restore

        def restore_and_end() -> None:
            try:
                restore()
            finally:
                running.clear()

        scope.restore = restore_and_end
        return scope

    patch_lang._hfkv_tests = True
    interpreter._patch_lang = patch_lang
    np_dtype, known = interpreter._get_np_dtype, {}

    def get_np_dtype(tt_dtype):
        scalar = tt_dtype.element_ty if isinstance(tt_dtype, tl.block_type) else tt_dtype
        try:
            return known[scalar]
        except KeyError:
            known[scalar] = found = np_dtype(scalar)
            return found
        except TypeError:  # an unhashable type: Triton's own lookup
            return np_dtype(tt_dtype)

    interpreter._get_np_dtype = get_np_dtype


if os.environ.get("TRITON_INTERPRET") == "1":
    _faster_interpreter()
