"""A Finalize built on a wrong draft, judged differently (spec/emulator.md "Structure the fit may
need", docs/decisions.md E10): the model files' `draft_blame`, its neutral default, the mixture it
makes, both engines agreeing exactly with it on, and that it reaches only those reviews."""

from __future__ import annotations

import dataclasses
import tomllib

import numpy as np
import polars as pl
import pytest
from test_difficulty import HARD, spec
from test_engine import PROTOCOL, assert_equal_to_reference  # the differential check, record by record

from meshheal_jax import engine
from meshheal_jax.errors import MeshHealError
from meshheal_jax.params import (
    AUTHOR_ROLES,
    JUDGED_RIGHT,
    JUDGED_RIGHT_ON_WRONG_DRAFT,
    JUDGED_WRONG,
    Pair,
    dump_model,
    load_pair,
    parse_model,
    threshold_table,
)
from meshheal_jax.streams import DIFFICULTY_BINS

PAIR = load_pair("default")


def with_blame(pair: Pair, blame: float) -> Pair:
    def one(m):
        return dataclasses.replace(m, scalars={**m.scalars, "draft_blame": blame})

    return Pair(pair.name, one(pair.strong), one(pair.weak))


def test_neutral_default_judges_the_own_part_alone_bit_for_bit():
    """draft_blame 0 (a file without it): a right part on a wrong draft is judged as a right part.
    (The shipped Llama-1B file has 0.24 since 2026-12-06, so the neutral pair is built here.)"""
    neutral = with_blame(PAIR, 0.0)
    assert neutral.strong == PAIR.strong  # gpt-oss ships with no draft_blame
    for section in ("review", "round2"):
        table = threshold_table(neutral, section)
        assert table.shape == (2, len(AUTHOR_ROLES), 3, DIFFICULTY_BINS, 4)
        np.testing.assert_array_equal(table[:, :, JUDGED_RIGHT_ON_WRONG_DRAFT], table[:, :, JUDGED_RIGHT])


@pytest.mark.parametrize("blame", [0.3, 1.0])
def test_a_right_part_on_a_wrong_draft_is_the_mixture_of_right_and_wrong(blame):
    pair = with_blame(HARD, blame)  # with difficulty too: the mixture is taken bin by bin
    for section in ("review", "round2"):
        table = threshold_table(pair, section)
        right, wrong = table[:, :, JUDGED_RIGHT], table[:, :, JUDGED_WRONG]
        np.testing.assert_allclose(table[:, :, JUDGED_RIGHT_ON_WRONG_DRAFT], (1 - blame) * right + blame * wrong,
                                   rtol=0, atol=1e-15)  # fmt: skip
        assert np.all(table[..., -1] == 1.0)
        assert np.all(np.diff(table, axis=-1) >= 0)  # still cumulative
    m = pair.strong
    # a wrong part is judged wrong whatever its draft
    assert m.review_thresholds("weak_author", False, 3, True) == m.review_thresholds("weak_author", False, 3)


def test_file_value_parses_validates_and_round_trips():
    text = dump_model(with_blame(PAIR, 0.25).weak)
    doc = tomllib.loads(text)
    assert doc["draft_blame"] == 0.25
    assert parse_model(doc, "w", "w").draft_blame == 0.25
    del doc["draft_blame"]
    assert parse_model(doc, "w", "w").draft_blame == 0.0
    doc["draft_blame"] = 1.5
    with pytest.raises(MeshHealError, match="draft_blame must be a probability"):
        parse_model(doc, "w", "file.toml")


def test_engines_agree_exactly_with_draft_blame_on():
    """The differential backbone with the structure on (alone on BBH, with difficulty on MATH)."""
    assert_equal_to_reference(
        [spec("bbh", 2, 504, with_blame(PAIR, 0.8)), spec("math", 1, 504, with_blame(HARD, 0.5))]
    )


def test_draft_blame_reaches_only_finalize_reviews():
    """The same stream with draft_blame 0 and 1: every record agrees up to the first review whose
    scores differ, and that review judges a Finalize; its first sample cannot rise (every such
    output is judged as a wrong one)."""
    base = spec("mmlu_pro", 0, 504, PAIR)
    runs = engine.run_streams([base, dataclasses.replace(base, pair=with_blame(PAIR, 1.0))], PROTOCOL)
    neutral, blamed = (r["reviews"] for r in runs)
    n = min(neutral.height, blamed.height)
    neutral, blamed = neutral.head(n), blamed.head(n)
    scores = ("u1", "u2", "u3", "v_a1", "v_b1", "v_a", "v_b")
    differs = np.logical_or.reduce(
        [neutral[c].ne_missing(blamed[c]).to_numpy() for c in ("t", "visit", *scores)]
    )
    assert differs.any(), "draft_blame = 1 changed no review: the structure is never exercised"
    first = int(np.argmax(differs))
    assert neutral["t"][first] == blamed["t"][first] and neutral["visit"][first] == blamed["visit"][first]
    assert neutral["action"][first] == blamed["action"][first] == "finalize"
    assert blamed["u1"][first] <= neutral["u1"][first]
    t0 = int(neutral["t"][first])
    assert t0 > 1
    for table in ("tasks", "calls", "states"):
        a, b = (r[table].filter(pl.col("t") < t0) for r in runs)
        assert a.equals(b), table
