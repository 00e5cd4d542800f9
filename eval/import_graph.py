"""The import graph of hfkv's parts, drawn from the code by grimp, as the Mermaid block of docs/architecture.md.

``make architecture-graph`` (``python -m eval.import_graph --write``) regenerates the block between the
``import-graph`` markers; tests/test_import_graph.py checks it is current. grimp (the graph library under
import-linter, which ``make lint`` runs on the same graph) parses every ``import`` statement of the package,
in functions too, without importing it; each module is collapsed to its part (``hfkv.kernels.cpu.meta`` ->
``kernels``) and an edge drawn wherever one part imports another. pydeps draws the same graph but runs
modulefinder over every dependency (minutes on 2 cores, against a second here).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import grimp

DOC = Path(__file__).resolve().parents[1] / "docs" / "architecture.md"
START, END = "<!-- import-graph:start (make architecture-graph) -->", "<!-- import-graph:end -->"


def part_edges(package: str = "hfkv") -> dict[str, set[str]]:
    """``{part: parts it imports}``, modules collapsed to ``<package>.<part>``."""
    graph = grimp.build_graph(package, cache_dir=None)

    def part(name: str) -> str | None:
        bits = name.split(".")
        return bits[1] if len(bits) > 1 else None

    edges: dict[str, set[str]] = {}
    for module in graph.modules:
        src = part(module)
        if src is None:
            continue
        edges.setdefault(src, set())
        for imported in graph.find_modules_directly_imported_by(module):
            dst = part(imported)
            if dst is not None and dst != src:
                edges[src].add(dst)
    return edges


def mermaid(edges: dict[str, set[str]]) -> str:
    lines = ["```mermaid", "flowchart TD"]
    for src in sorted(edges):
        for dst in sorted(edges[src]):
            lines.append(f"  {src} --> {dst}")
    lines.append("```")
    return "\n".join(lines)


def block(edges: dict[str, set[str]]) -> str:
    return f"{START}\n{mermaid(edges)}\n{END}"


def current_doc_block(text: str) -> str:
    if START not in text or END not in text:
        raise ValueError(f"{DOC}: no import-graph markers ({START} ... {END})")
    return text[text.index(START) : text.index(END) + len(END)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write", action="store_true", help="rewrite the block in docs/architecture.md")
    args = parser.parse_args(argv)
    new = block(part_edges())
    if not args.write:
        print(new)
        return 0
    from hfkv.atomic import write_atomic

    text = DOC.read_text()
    write_atomic(DOC, text.replace(current_doc_block(text), new))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
