"""Notebooks: committed without outputs, and executed end to end on the testbed with their figures saved."""

from __future__ import annotations

import glob
import os

import nbformat
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = sorted(glob.glob(os.path.join(ROOT, "notebooks", "*.ipynb")))
EXPLORE = os.path.join(ROOT, "notebooks", "explore.ipynb")
# Every figure explore.ipynb saves (docs/notebooks.md describes each).
EXPLORE_FIGURES = ("layers", "state_map", "heads", "memory_trace", "pareto")


def stored_outputs(nb) -> list[str]:
    """Where a notebook stores results: code cells with outputs or an execution count."""
    found = []
    for i, cell in enumerate(nb.cells):
        if cell.cell_type != "code":
            continue
        if cell.get("outputs"):
            found.append(f"cell {i}: {len(cell.outputs)} output(s)")
        if cell.get("execution_count") is not None:
            found.append(f"cell {i}: execution_count={cell.execution_count}")
    return found


def test_the_explore_notebook_exists():
    assert EXPLORE in NOTEBOOKS


@pytest.mark.parametrize("path", NOTEBOOKS, ids=os.path.basename)
def test_committed_notebooks_have_no_outputs(path):
    nb = nbformat.read(path, as_version=4)
    nbformat.validate(nb)
    found = stored_outputs(nb)
    assert not found, f"{os.path.relpath(path, ROOT)} stores outputs ({found}); strip them: nbstripout {path}"


def test_the_output_check_sees_outputs():
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("x"), nbformat.v4.new_code_cell("1 + 1")]
    assert stored_outputs(nb) == []
    nb.cells[1].execution_count = 3
    nb.cells[1].outputs = [nbformat.v4.new_output("execute_result", {"text/plain": "2"}, execution_count=3)]
    assert stored_outputs(nb) == ["cell 1: 1 output(s)", "cell 1: execution_count=3"]


@pytest.mark.slow
def test_explore_notebook_runs_on_the_testbed_and_saves_its_figures(tmp_path, monkeypatch):
    from matplotlib.image import imread
    from nbclient import NotebookClient

    figures = tmp_path / "figures"
    # The kernel inherits this environment: figures folder, offline hub, one thread per process.
    monkeypatch.setenv("HFKV_FIGURES_DIR", str(figures))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    nb = nbformat.read(EXPLORE, as_version=4)
    # "python3" is the kernel ipykernel installs into the venv (share/jupyter/kernels); jupyter_client
    # starts it with this interpreter (its argv[0] "python" is replaced by sys.executable).
    client = NotebookClient(
        nb, kernel_name="python3", timeout=300, resources={"metadata": {"path": os.path.dirname(EXPLORE)}}
    )
    client.execute()  # raises CellExecutionError, with the cell and traceback, if any cell fails

    texts = [
        out.get("text", "") + str(out.get("data", {}).get("text/html", ""))
        for cell in nb.cells
        if cell.cell_type == "code"
        for out in cell.outputs
    ]
    joined = "\n".join(texts)
    assert "TriStateCache" in joined and "compression" in joined  # the cache's HTML summary was shown
    assert sorted(p.name for p in figures.iterdir()) == sorted(f"{name}.png" for name in EXPLORE_FIGURES)
    for name in EXPLORE_FIGURES:
        path = figures / f"{name}.png"
        assert path.stat().st_size > 15_000, name
        img = imread(path)[..., :3]
        h, w = img.shape[:2]
        assert h >= 300 and w >= 600, (name, img.shape)
        # Drawn data, not empty axes: every figure colours its data (states, presets, bars); axes, text
        # and grid lines are black/grey, so an empty figure has no saturated pixel at all.
        saturated = (img.max(axis=-1) - img.min(axis=-1)) > 0.25
        assert saturated.mean() > 0.003, (name, saturated.mean())
