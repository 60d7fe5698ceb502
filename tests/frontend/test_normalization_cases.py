"""Table-driven normalization cases: input -> what a listener should hear.

The expected outputs in ``normalization_cases.tsv`` were written by hand from how the
text is read aloud, not copied from the normalizer; each row says what it checks.
"""

from pathlib import Path
from typing import NamedTuple

import pytest

from cosyserve.frontend import TextNormalizer


class Case(NamedTuple):
    language: str
    text: str
    expected: str
    checks: str


def _load_cases() -> list[Case]:
    lines = (Path(__file__).parent / "normalization_cases.tsv").read_text(encoding="utf-8").splitlines()
    return [Case(*line.split("\t")) for line in lines if line and not line.startswith("#")]


CASES = _load_cases()


@pytest.fixture(scope="module")
def normalizer() -> TextNormalizer:
    return TextNormalizer()


def test_the_table_has_enough_cases_per_language() -> None:
    assert sum(case.language == "zh" for case in CASES) >= 40
    assert sum(case.language == "en" for case in CASES) >= 20


@pytest.mark.parametrize("case", CASES, ids=[case.text for case in CASES])
def test_normalization_case(normalizer: TextNormalizer, case: Case) -> None:
    assert normalizer.language(case.text) == case.language
    assert normalizer.normalize(case.text) == case.expected, case.checks
