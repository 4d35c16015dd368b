"""Model parameter files (params) and the per-task draw conventions (draws): rules a mutation of
params.py / draws.py passed tests/test_draws.py, test_model_files.py, test_defaults_and_inputs.py
and test_profiles.py with (params_draws audit). Cheap: no engine run, a handful of small programs."""

from __future__ import annotations

import copy
import dataclasses
import math
import tomllib
import uuid
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from meshheal_jax import draws as D
from meshheal_jax import params, reference, topology
from meshheal_jax.errors import MeshHealError
from meshheal_jax.streams import DIFFICULTY_BINS

SOURCE = "mutant.toml"


@pytest.fixture(scope="module")
def strong_doc() -> dict:
    return tomllib.loads((params.MODEL_DIR / "gpt-oss-120b.toml").read_text())


def parse(doc: dict, source: str = SOURCE) -> params.ModelParams:
    return params.parse_model(doc, "mutant", source)


def refused(doc: dict, *fragments: str) -> str:
    with pytest.raises(MeshHealError) as info:
        parse(doc)
    message = str(info.value)
    assert "\n" not in message and message.startswith(SOURCE), message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


# ----------------------------------------------------------------------------------------------
# Validation: one line naming the file and the key
# ----------------------------------------------------------------------------------------------


def test_a_categorical_must_sum_to_one_within_1e_6_and_reads_exactly_1_at_the_top(strong_doc):
    """A row off by 2e-6 is refused; one off by 5e-7 (six-decimal rounding) is read, and its last
    threshold is exactly 1.0 (architecture.md "Randomness": computed once, last = 1.0)."""
    doc = copy.deepcopy(strong_doc)
    doc["review_difficulty"] = 0.0  # every bin reads the row as written
    doc["review"]["weak_author"]["wrong"] = [0.5, 0.2, 0.2, 0.099998]
    refused(doc, "review.weak_author.wrong sums to 0.999998, not 1")
    doc["review"]["weak_author"]["wrong"] = [0.5, 0.2, 0.2, 0.0999995]
    thresholds = parse(doc).review_thresholds("weak_author", False, 0)
    assert thresholds[-1] == 1.0 and thresholds[2] == pytest.approx(0.9, abs=1e-15)


@pytest.mark.parametrize("row", [[0.25, 0.25, 0.25, 0.25, 0.0], [0.5, 0.5, 0.0]])
def test_a_categorical_needs_exactly_one_probability_per_anchor(strong_doc, row):
    doc = copy.deepcopy(strong_doc)
    doc["round2"]["strong_author"]["correct"] = row
    refused(doc, "round2.strong_author.correct needs 4 probabilities")


@pytest.mark.parametrize(
    "section, value", [("completion_tokens", [1]), ("prompt_tokens", 3), ("p_part", 0.5)]
)
def test_a_section_that_is_not_a_table_is_named(strong_doc, section, value):
    doc = copy.deepcopy(strong_doc)
    doc[section] = value
    refused(doc, f"{section} must be a table, got {value!r}")


def test_a_completion_range_of_one_length_is_allowed(strong_doc):
    doc = copy.deepcopy(strong_doc)
    doc["completion_tokens"]["infer"] = [0, 0]
    doc["completion_tokens"]["review"] = [37, 37]
    m = parse(doc)
    assert m.completion_tokens["infer"] == (0, 0) and m.completion_tokens["review"] == (37, 37)


def write(folder, name: str, text: str):
    path = folder / f"{name}.toml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "line, fragment",
    [
        ("difficulty_spread = inf", "difficulty_spread must be a finite number >= 0, got inf"),
        ("review_difficulty = nan", "review_difficulty must be a finite number >= 0, got nan"),
        ("draft_blame = -0.0001", "draft_blame must be a probability in [0, 1], got -0.0001"),
    ],
)
def test_a_file_s_message_names_its_path_and_key(tmp_path, line, fragment):
    """load_model: the message starts with the file's path (not a bare model name)."""
    text = (params.MODEL_DIR / "gpt-oss-120b.toml").read_text()
    key = line.split(" = ")[0]
    text = "\n".join(x for x in text.splitlines() if not x.startswith(f"{key} ="))
    path = write(tmp_path, "gpt-oss-120b", f"{line}\n{text}\n")
    with pytest.raises(MeshHealError) as info:
        params.load_model("gpt-oss-120b", tmp_path)
    assert str(info.value) == f"{path}: {fragment}"


def test_a_toml_path_is_read_as_that_file_and_model_defaults_to_its_stem(tmp_path):
    text = (params.MODEL_DIR / "llama-3.2-1b.toml").read_text()
    text = "\n".join(x for x in text.splitlines() if not x.startswith("model ="))
    path = write(tmp_path, "my-model", text)
    assert params.model_path(path) == path and params.model_path(str(path)) == path
    m = params.load_model(str(path))  # a .toml path, not a name under MODEL_DIR
    assert (m.name, m.model) == ("my-model", "my-model")
    assert params.model_path("my-model", tmp_path) == path  # a name: <dir>/<name>.toml


def test_a_missing_or_unparsable_file_and_an_unknown_pair_are_named(tmp_path):
    with pytest.raises(MeshHealError, match="model parameter file not found: .*nowhere.toml"):
        params.load_model("nowhere", tmp_path)
    path = write(tmp_path, "broken", "p_infer = = 0.5\n")
    with pytest.raises(MeshHealError, match=f"cannot parse model parameter file {path}: "):
        params.load_model("broken", tmp_path)
    with pytest.raises(MeshHealError, match=r"unknown pair 'Z'; known: \['A', 'B', 'default'\]"):
        params.load_pair("Z")


def test_a_misspelt_attribute_is_an_attribute_error_not_a_value(strong_doc):
    """ModelParams reads its scalars as attributes; anything else stays an AttributeError (a typo
    must not read as 0, and hasattr / copy rely on it)."""
    m = parse(copy.deepcopy(strong_doc))
    assert m.p_infer == strong_doc["p_infer"]
    with pytest.raises(AttributeError):
        m.p_infre  # noqa: B018
    assert not hasattr(m, "p_infre")
    assert copy.deepcopy(m) == m


def test_a_blunt_round2_row_warns_once_per_file_and_finding(strong_doc):
    doc = copy.deepcopy(strong_doc)
    doc["round2"]["weak_author"]["wrong"] = [0.0, 0.0, 0.0, 1.0]  # never flags a wrong output
    source = f"blunt-{uuid.uuid4().hex}.toml"  # the once-only memory is per process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        parse(copy.deepcopy(doc), source)
        parse(copy.deepcopy(doc), source)
        parse(copy.deepcopy(doc), source + ".other")
    blunt = [w for w in caught if issubclass(w.category, params.ModelFileWarning)]
    assert [str(w.message).split(":")[0] for w in blunt] == [source, source + ".other"]
    assert "weak_author.wrong" in str(blunt[0].message)


# ----------------------------------------------------------------------------------------------
# Thresholds: float64, cumulative, last exactly 1.0, the table both JAX engines read
# ----------------------------------------------------------------------------------------------


def test_difficulty_bins_are_the_midpoint_quantiles_of_a_standard_normal():
    """decisions E9: bin b stands for z_b = inverse-Phi((b + 1/2) / 8)."""
    assert DIFFICULTY_BINS == 8 and len(params.DIFFICULTY_Z) == 8
    assert params.DIFFICULTY_Z[0] == pytest.approx(-1.5341205443525459, abs=1e-12)  # Phi^-1(1/16)
    assert params.DIFFICULTY_Z[3] == pytest.approx(-0.15731068461017067, abs=1e-12)  # Phi^-1(7/16)
    assert all(a == -b for a, b in zip(params.DIFFICULTY_Z, reversed(params.DIFFICULTY_Z)))


def test_each_difficulty_knob_moves_only_its_own_table(strong_doc):
    """difficulty_spread shifts p_part, review_difficulty tilts the review categoricals: neither
    touches the other's table (bit for bit)."""
    profile = topology.load_profile("bbh")
    doc = copy.deepcopy(strong_doc)
    doc.update(difficulty_spread=1.0, review_difficulty=0.0)
    spread = parse(doc)
    for key, row in spread.review.items():
        assert spread.review_cumulative[key] == (params.ModelParams.thresholds(row),) * DIFFICULTY_BINS
    doc.update(difficulty_spread=0.0, review_difficulty=1.0)
    tilt = parse(doc)
    assert tilt.p_part_for(profile) == tuple((p,) * DIFFICULTY_BINS for p in tilt.p_part_base(profile))
    assert tilt.review_cumulative != spread.review_cumulative


def test_a_tilt_of_zero_keeps_a_row_bit_for_bit_even_when_its_sum_is_not_exactly_one(strong_doc):
    row = (0.7, 0.1, 0.1, 0.1)  # sums to 0.9999999999999999 in float64
    assert sum(row) != 1.0 and params.tilted(row, 0.0) == row
    doc = copy.deepcopy(strong_doc)
    doc["review"]["strong_author"]["correct"] = list(row)
    doc["review_difficulty"] = 0.0
    m = parse(doc)
    assert (
        m.review_cumulative[("strong_author", True)]
        == (params.ModelParams.thresholds(row),) * DIFFICULTY_BINS
    )
    assert m.review_thresholds("strong_author", True, 5) == (0.7, 0.7999999999999999, 0.8999999999999999, 1.0)


def test_a_tilt_past_exp_overflow_keeps_each_anchor_s_weight():
    """A tilt so large that exp overflows: the same weights p * exp(tilt * (a - top)), not an
    equal weight for every anchor with p > 0."""
    row, tilt = (0.0, 0.2, 0.3, 0.5), 710.0
    w = [p * math.exp(tilt * (a - 1.0)) for p, a in zip(row, params.ANCHORS)]
    assert params.tilted(row, tilt) == pytest.approx(tuple(x / sum(w) for x in w), rel=1e-12, abs=0.0)


def test_distractor_thresholds_at_their_edges(strong_doc):
    doc = copy.deepcopy(strong_doc)
    doc.update(n_distractors=1, p_popular_wrong=0.3)
    assert parse(doc).distractor_thresholds() == (1.0,)
    doc.update(n_distractors=4, p_popular_wrong=1.0)
    assert parse(doc).distractor_thresholds() == (1.0, 1.0, 1.0, 1.0)
    doc.update(p_popular_wrong=0.0)
    thresholds = parse(doc).distractor_thresholds()
    assert thresholds[0] == 0.0 and thresholds[-1] == 1.0
    assert reference.categorical(0.0, thresholds) == 1  # a probability-0 distractor is never drawn


@pytest.mark.parametrize("pair_name", sorted(params.PAIRS))
def test_threshold_table_is_each_model_s_lookup_in_the_engines_order(pair_name):
    """(reviewer [strong, weak], author role, judged class [wrong, right, right on a wrong draft],
    bin, anchor), float64, bit for bit the model's own thresholds: the engine indexes it with
    `part_ok.astype(int32)` for the class and the reviewer's role 0 = strong."""
    assert (params.JUDGED_WRONG, params.JUDGED_RIGHT, params.JUDGED_RIGHT_ON_WRONG_DRAFT) == (0, 1, 2)
    assert params.AUTHOR_ROLES == ("strong_author", "weak_author")
    pair = params.load_pair(pair_name)
    blame = dataclasses.replace(pair.weak, scalars={**pair.weak.scalars, "draft_blame": 0.35})
    pair = params.Pair(pair.name, pair.strong, blame)  # the third class differs from the second
    classes = ((False, False), (True, False), (True, True))
    for section in ("review", "round2"):
        table = params.threshold_table(pair, section)
        assert table.dtype == np.float64 and table.shape == (2, 2, 3, DIFFICULTY_BINS, 4)
        assert np.all(table[..., -1] == 1.0) and np.all(np.diff(table, axis=-1) >= 0.0)
        for r, m in enumerate((pair.strong, pair.weak)):
            lookup = m.review_thresholds if section == "review" else m.round2_thresholds
            for a, role in enumerate(params.AUTHOR_ROLES):
                for c, (correct, wrong_draft) in enumerate(classes):
                    for b in (0, 3, DIFFICULTY_BINS - 1):
                        assert tuple(table[r, a, c, b]) == lookup(role, correct, b, wrong_draft), (r, a, c, b)
        assert not np.array_equal(table[1, :, 2], table[1, :, 1])


def test_dump_model_quotes_a_task_type_with_spaces(strong_doc):
    """MATH's "Intermediate Algebra": a p_part entry whose name needs quotes round-trips."""
    m = parse(copy.deepcopy(strong_doc))
    m = dataclasses.replace(
        m, p_part={"math": {"default": 0.5, "Intermediate Algebra": 0.25, "Algebra": 0.75}}
    )
    again = params.parse_model(tomllib.loads(params.dump_model(m)), "mutant", SOURCE)
    assert again.p_part == m.p_part


@pytest.mark.parametrize("key", ["a.b", "c++", "x/y", "Bob's", "über", "a=b", "#tag", 'say "hi"', "del\x7f"])
def test_dump_model_writes_any_names_and_model_id_so_they_read_back(strong_doc, key):
    """A profile's task types and datasets may be any text (and the model any id): dump_model wrote
    them bare unless they held a space or "&", so "a.b" read back nested and refused, and "c++" or an
    id with a quote was not TOML. Control characters in the header are written as spaces."""
    m = dataclasses.replace(parse(copy.deepcopy(strong_doc)), model=f"org/{key}",
                            p_part={"bbh": {"default": 0.5, key: 0.25}, f"my {key}": {"default": 0.75}})  # fmt: skip
    text = params.dump_model(m, header="fitted\x00 by\x07 a test\nline 2")
    assert params.parse_model(tomllib.loads(text), "mutant", SOURCE) == m
    assert text.startswith("# fitted  by  a test\n# line 2\n")


@pytest.mark.parametrize("model", [5, "", "  ", ["gpt"]])
def test_a_model_id_that_is_not_text_is_named(strong_doc, model):
    """`model` is the id a live run sends to its server: 5 was read as "5", and "" or [1] were kept."""
    with pytest.raises(MeshHealError, match=rf"{SOURCE}: model must be a non-empty model id"):
        parse({**copy.deepcopy(strong_doc), "model": model})


# ----------------------------------------------------------------------------------------------
# Draws: the stored key derivation and the pick / categorical conventions of both engines
# ----------------------------------------------------------------------------------------------


def test_spec_dataset_ids():
    """architecture.md "Randomness": bbh = 0, math = 1, mmlu_pro = 2 (every stored stream's key)."""
    ids = {name: topology.load_profile(name).dataset_id for name in ("bbh", "math", "mmlu_pro")}
    assert ids == {"bbh": 0, "math": 1, "mmlu_pro": 2}


def test_stored_draws_do_not_move():
    """Golden values: a JAX release (or a change here) that moved fold_in, threefry or uniform's
    bits would silently change every stored result while the lazy-vs-eager identity tests still
    passed (both sides would move together)."""
    a, b = D.task_draws(0, 0, 1), D.task_draws(7, 2, 504)
    got = [float(a.entry), float(a.infer[0]), float(a.route[0, 0]), float(a.calls[0, 0, 0]),
           float(a.calls[8, 10, 3]), float(b.entry), float(b.infer[2]), float(b.route[8, 5]),
           float(b.calls[3, 4, 1])]  # fmt: skip
    want = ["0x1.423bf22b4d250p-2", "0x1.969dcd9471d00p-2", "0x1.d78d764e53ca6p-1", "0x1.ea00fabc8e32ap-1",
            "0x1.7738ff953c330p-2", "0x1.ae6368ed5b59cp-1", "0x1.6e57a1df90a10p-1", "0x1.f20efdc177d9cp-2",
            "0x1.9c2689214bc00p-6"]  # fmt: skip
    assert [x.hex() for x in got] == want


BELOW_ONE = 1.0 - 2.0**-52  # the largest uniform draw


def test_pick_index_is_the_reference_s_pick_at_every_boundary():
    """min(floor(u n), n - 1): at u = k/n exactly, one ulp below it, the largest draw and u = 1."""
    us, ns = [], []
    for n in range(1, 8):
        for k in range(n + 1):
            for u in (k / n, np.nextafter(k / n, -1.0), np.nextafter(k / n, 2.0), BELOW_ONE, 1.0):
                if 0.0 <= u <= 1.0:
                    us.append(float(u))
                    ns.append(n)
    got = np.asarray(D.pick_index(jnp.asarray(us), jnp.asarray(ns, jnp.int32)))
    assert got.dtype == np.int32
    assert got.tolist() == [reference.pick(u, n) for u, n in zip(us, ns)]


@pytest.mark.parametrize(
    "thresholds",
    [(0.1, 0.5, 0.9, 1.0), (0.0, 0.3, 0.3, 1.0), (0.25, 0.25, 1.0, 1.0), (1.0, 1.0, 1.0, 1.0)],
)
def test_categorical_is_the_reference_s_first_k_with_u_below_its_threshold(thresholds):
    """Ties: an anchor of probability 0 (equal neighbouring thresholds) is never drawn; u on a
    threshold goes to the next anchor."""
    us = sorted(
        {0.0, BELOW_ONE, 1.0, *thresholds, *(float(np.nextafter(t, -1.0)) for t in thresholds if t > 0)}
    )
    got = np.asarray(D.categorical(jnp.asarray(us), jnp.asarray(thresholds)))
    assert got.tolist() == [reference.categorical(u, thresholds) for u in us]
    zero = [k for k, p in enumerate(np.diff((0.0, *thresholds))) if p == 0.0]
    assert not set(got[np.asarray(us) < 1.0].tolist()) & set(zero)


def test_pick_from_mask_is_the_reference_s_pick_among_the_listed_candidates():
    masks = [
        (False, True, False, True, True),
        (True,),
        (False, False, True),
        (True, True, True, True),
        (False,) * 4,
    ]
    cases = [(mask, u) for mask in masks for u in (0.0, 1 / 3, 0.5, 2 / 3, BELOW_ONE)]
    width = max(len(m) for m in masks)
    padded = np.array([m + (False,) * (width - len(m)) for m, _ in cases])
    got = np.asarray(jax.vmap(D.pick_from_mask)(jnp.asarray([u for _, u in cases]), jnp.asarray(padded)))
    want = []
    for mask, u in cases:
        listed = [i for i, x in enumerate(mask) if x]
        want.append(listed[reference.pick(u, len(listed))] if listed else -1)
    assert got.tolist() == want


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda d: d["review"]["strong_author"].update(wrnog=[0.25] * 4),
            r"review\.strong_author: unknown key\(s\) wrnog",
        ),
        (lambda d: d["round2"].update(strong_autor={}), r"round2: unknown key\(s\) strong_autor"),
        (lambda d: d["review"].update(strong_author=[1, 2]), r"review\.strong_author must be a table"),
        (lambda d: d.update(round2="x"), r"round2 must be a table"),
    ],
)
def test_a_review_table_s_misspelt_or_misshapen_entry_is_named(strong_doc, change, message):
    """Only the file's top level refused unknown keys: a misspelt label beside the right one (or an
    extra role) was read as absent, silently; a role given as a list was called missing."""
    doc = copy.deepcopy(strong_doc)
    change(doc)
    with pytest.raises(MeshHealError, match=rf"{SOURCE}: {message}"):
        parse(doc)
