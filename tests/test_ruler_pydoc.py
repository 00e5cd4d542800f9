"""RULER's essay-haystack tasks rebuilt on the Python reference (eval/tasks/ruler_pydoc): the haystack is the
reference's prose and nothing else, the documents are RULER's (needles, template, scoring), and lm-eval's own
sentence splitter is left as it was."""

from __future__ import annotations

import hashlib
import re
from pathlib import Path

import pytest

pytest.importorskip("wonderwords")
TASKS_DIR = Path(__file__).resolve().parents[1] / "eval" / "tasks"
LENGTH = 4096  # the testbed's byte-level tokenizer needs ~2.5k tokens for RULER's first 500 haystack words
NEEDLE = re.compile(r"One of the special magic (?:number|uuid)s? for [\w-]+ is: [\w-]+\.")


def test_prose_paragraphs_keep_running_text_only():
    from hfkv.evaluation.ruler_pydoc import prose_paragraphs

    topic = (
        "Heading of a topic\n******************\n\n"
        "A paragraph of prose that says what\nthe statement does, in two lines.\n\n"
        "   indented_code = example(of, the, statement, that, is, long)\n\n"
        'assert_stmt ::= "assert" expression ["," expression] and more words.\n\n'
        "Too short to count.\n\n"
        "This one introduces an example and ends with a colon, so it goes:\n\n"
        "* a list item that is indented on its\n  second line of the item.\n\n"
        "The last paragraph is also prose and long enough to be kept here."
    )
    assert prose_paragraphs(topic) == [
        "A paragraph of prose that says what the statement does, in two lines.",
        "The last paragraph is also prose and long enough to be kept here.",
    ]


def test_haystack_is_the_reference_prose_with_its_digest():
    from pydoc_data.topics import topics

    from hfkv.evaluation.ruler_pydoc import haystack_text, prose_paragraphs

    text, digest = haystack_text()
    assert digest == hashlib.sha256(text.encode("utf-8")).hexdigest()
    assert "::=" not in text and "  " not in text and "\n" not in text
    first = next(p for body in topics.values() for p in prose_paragraphs(body))
    assert text.startswith(" ".join(first.split()))
    assert len(text.split(" ")) > 20_000  # room for 16k-token prompts


def _context(doc: dict) -> str:
    """The text between RULER's template head and the question."""
    return doc["input"].split("\n", 1)[1].rsplit("\nWhat ", 1)[0]


@pytest.mark.parametrize(
    ("task", "n_needles", "n_refs"),
    [("niah_single_2_pydoc", 1, 1), ("niah_multivalue_pydoc", 4, 4)],
)
def test_documents_are_rulers_needles_in_the_reference_prose(task, n_needles, n_refs):
    from lm_eval.tasks.ruler import prepare_niah

    from hfkv.evaluation.ruler import load_examples, tokenizer_path
    from hfkv.evaluation.ruler_pydoc import haystack_text

    splitter = prepare_niah.cached_sent_tokenize
    examples = load_examples(task, LENGTH, tokenizer_path("testbed"), 2, TASKS_DIR)
    assert prepare_niah.cached_sent_tokenize is splitter  # lm-eval's own tasks split sentences as before
    text, digest = haystack_text()
    inputs = set()
    for ex in examples:
        doc = ex.instance.doc
        assert doc["haystack_sha256"] == digest and doc["max_length"] == LENGTH and doc["length"] <= LENGTH
        context = _context(doc)
        needles = NEEDLE.findall(context)
        assert len(needles) == n_needles and len(ex.refs) == n_refs
        assert all(any(r in n for n in needles) for r in ex.refs)
        # without its needles the context is the haystack's first words, in order
        rest = " ".join(NEEDLE.sub(" ", context).split())
        assert len(rest.split(" ")) >= 500 and text.startswith(rest)  # RULER grows a haystack by 500 words
        assert ex.score(" ".join(ex.refs)) == 1.0 and ex.score("no number here") == 0.0
        inputs.add(doc["input"])
    assert len(inputs) == 2  # each document hides its own needles


def test_pydoc_tasks_need_the_task_folder():
    from hfkv.evaluation.ruler import load_examples

    with pytest.raises(ValueError, match="include_path"):
        load_examples("niah_single_2_pydoc", LENGTH, "testbed", 1)
    with pytest.raises(ValueError, match="pydoc-haystack tasks"):
        from hfkv.evaluation.ruler_pydoc import task_dataset

        task_dataset("niah_single_1", max_seq_lengths=[LENGTH], tokenizer="testbed")
