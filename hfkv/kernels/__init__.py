"""Triton kernels over hfkv's paged storage, each beside the torch twin it is tested against.

The kernels run on CUDA; on a CPU they run only under Triton's interpreter (``TRITON_INTERPRET=1``,
slow, for tests at toy sizes). ``hfkv.kernels.backend`` decides which path a layer takes.
"""
