"""Results name the code they came from by its content too (``source_digest``), since git metadata can be stale
where a checkout was copied (a lent GPU named the previous call's commit while running the new files)."""

from __future__ import annotations

from hfkv.evaluation.results import provenance, source_digest


def test_the_digest_follows_the_sources_content_and_paths(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("x = 1\n")
    (tmp_path / "pkg" / "k.cpp").write_text("int f();\n")
    (tmp_path / "pkg" / "notes.txt").write_text("not a source")
    first = source_digest(tmp_path / "pkg")
    assert len(first) == 16 and source_digest(tmp_path / "pkg") == first
    (tmp_path / "pkg" / "notes.txt").write_text("changed")  # not a source: same digest
    source_digest.cache_clear()
    assert source_digest(tmp_path / "pkg") == first
    (tmp_path / "pkg" / "k.cpp").write_text("int f(int);\n")
    source_digest.cache_clear()
    second = source_digest(tmp_path / "pkg")
    assert second != first
    (tmp_path / "pkg" / "k.cpp").rename(tmp_path / "pkg" / "k2.cpp")  # same content, another path
    source_digest.cache_clear()
    assert source_digest(tmp_path / "pkg") not in (first, second)


def test_every_result_carries_the_digest_of_the_imported_package():
    assert provenance()["source_digest"] == source_digest()
