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
