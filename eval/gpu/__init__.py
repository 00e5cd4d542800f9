"""GPU tooling: is hfkv ready on a GPU, and does every kernel configuration compile for one.

* ``check.py``: ``python -m eval.gpu.check --out DIR`` (``make gpu-check``): the compiled kernel tests, decode-kernel
  bandwidth and end-to-end figures within one time budget on a lent GPU; ``--dry-run`` rehearses every part on a
  CPU in Triton's interpreter. Its parts: ``e2e.py`` (end to end) and ``report.py`` (JSON, summary, figure).
* ``aot.py``: ``python -m eval.gpu.aot`` (``make aot-compat``): every kernel configuration the cache launches,
  compiled for sm_90 without a GPU.

The kernel tests reach the GPU through the pytest plugin ``tests/gpu_offload.py``. Run from the repository root
(docs/kernels.md, "Validating on a GPU").
"""
