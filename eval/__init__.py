"""hfkv's evaluation: the scripts that make the committed results under ``eval/results/``, and their tooling.

Not part of the installed ``hfkv`` package (nothing in ``hfkv/`` imports it): a package of this checkout, so the
scripts import each other as ``from eval import kernel_bench`` and the tests import them the same way. Run a script
from the repository root as a module::

    python -m eval.sweep_testbed --help
    python -m eval.gpu.check --dry-run          # the GPU check (eval/gpu/), rehearsed on a CPU

``python eval/<script>.py`` works too. A script that imports another module of this package (``eval.kernel_bench``,
``eval.gpu.e2e``, ...) re-runs itself as ``python -m eval.<script>`` when started as a plain file and ``eval`` is not
importable, with this checkout on ``PYTHONPATH``: a plain file's import path holds its own folder, not the
repository root. No module here edits ``sys.path``.

``eval/gpu/``: validating a GPU (``check.py`` with ``e2e.py`` and ``report.py``) and compiling every kernel
configuration for sm_90 on a CPU (``aot.py``); ``eval/archive/``: finished experiments and superseded result
snapshots, each mapped to the docs section that records its answer (``eval/archive/README.md``). The generated
tables of the current results: ``eval/README.md`` (``python -m eval.make_tables``).
"""
