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
