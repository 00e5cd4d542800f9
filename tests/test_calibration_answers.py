"""Final-answer extraction (last \\boxed{}) and math equivalence, on hand-written cases."""

from __future__ import annotations

import pytest

from hfkv.calibration.answers import answers_match, last_boxed, solution_answer
from hfkv.calibration.data import load_jsonl
from tests.calibration_support import FIXTURE


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (r"so $x = \boxed{5}$.", "5"),
        (r"first \boxed{1}, corrected: \boxed{2}", "2"),  # the last box wins
        (r"$\boxed{\frac{1}{2}}$", r"\frac{1}{2}"),  # nested braces
        (r"\boxed{\left(2, \frac{\pi}{3}\right)}", r"\left(2, \frac{\pi}{3}\right)"),
        (r"\boxed{\{1, 2\}}", r"\{1, 2\}"),  # escaped braces do not close the box
        (r"\boxed{5 \text{ cm}}", r"5 \text{ cm}"),
        (r"the answer is $\boxed 7$.", "7"),
        (r"\fbox{42}", "42"),
        (r"\boxed{ 3 }", "3"),
        ("no box at all", None),
        (r"unterminated \boxed{\frac{1}{2}", None),
        (r"\boxed", None),
    ],
)
def test_last_boxed(text, expected):
    assert last_boxed(text) == expected


@pytest.mark.parametrize(
    ("pred", "gold"),
    [
        (r"\dfrac{1}{2}", r"\frac{1}{2}"),
        (r"\frac12", "0.5"),
        ("0.5", r"\frac{1}{2}"),
        (r"5\text{ cm}", "5"),
        (r"5 \text{ cm}", "5"),
        ("B", r"\text{(B)}"),
        (r"\sqrt{18}", r"3\sqrt{2}"),
        ("1+x^2", "x^2+1"),
        (r"\frac{\pi}{2}", r"\pi/2"),
        ("1000", "1,000"),
        (r"60", r"60^\circ"),
        (r"\left(2, \frac{\pi}{3}\right)", r"(2,\pi/3)"),
    ],
)
def test_equivalent_answers_match(pred, gold):
    assert answers_match(pred, gold)


@pytest.mark.parametrize(
    ("pred", "gold"),
    [
        ("3", "2"),
        (r"\frac{1}{3}", r"\frac{1}{2}"),
        ("0.51", "0.5"),
        (None, "5"),
        ("", "5"),
        (r"2\sqrt{2}", r"3\sqrt{2}"),
    ],
)
def test_different_answers_do_not_match(pred, gold):
    assert not answers_match(pred, gold)


def test_every_fixture_solution_has_a_parseable_answer():
    rows = load_jsonl(FIXTURE)
    for r in rows:
        ans = solution_answer(r.solution)
        assert answers_match(ans, ans), ans


def test_solution_without_box_is_an_error():
    with pytest.raises(ValueError, match="boxed"):
        solution_answer("The answer is 5.")
