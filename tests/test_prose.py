"""The held-out prose set: real text, deterministic, and disjoint from what calibration may use."""

import math

import pytest

from edge.errors import DataError
from export.prose import bits_per_byte, prose_texts


def test_splits_are_disjoint_deterministic_and_real_prose() -> None:
    held_out, train = prose_texts("eval"), prose_texts("train")
    assert not set(held_out) & set(train)
    assert held_out == prose_texts("eval")
    assert len(held_out) >= 50 and len(train) >= 250
    assert sum(len(d) for d in held_out) > 50_000          # enough for a KL figure over >10k tokens
    words = " ".join(held_out).split()
    assert sum(w.lower() in {"the", "of", "and", "to"} for w in words) / len(words) > 0.08   # English


def test_unknown_split_names_the_choices() -> None:
    with pytest.raises(DataError, match="eval.*train"):
        prose_texts("test")


def test_bits_per_byte() -> None:
    assert bits_per_byte(100 * math.log(2), 50) == pytest.approx(2.0)
    with pytest.raises(ValueError):
        bits_per_byte(1.0, 0)
