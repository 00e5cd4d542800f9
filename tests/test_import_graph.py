"""docs/architecture.md's import graph is the code's (eval/import_graph.py, `make architecture-graph`)."""

from __future__ import annotations

from eval import import_graph


def test_the_documented_graph_is_current():
    text = import_graph.DOC.read_text()
    assert import_graph.current_doc_block(text) == import_graph.block(import_graph.part_edges()), (
        "docs/architecture.md's import graph is stale: run `make architecture-graph`"
    )


def test_parts_are_collapsed_and_self_imports_dropped():
    edges = import_graph.part_edges()
    assert "kernels" in edges and "cpu" not in edges  # hfkv.kernels.cpu.* is part of kernels
    assert all(src not in dsts for src, dsts in edges.items())
    assert "cache" not in edges["kernels"]  # a lower floor never imports a higher one (lint-imports checks all)
