"""Model files (params), the per-task draw fields (draws), Experiment.validate's baseline slot
rule, the experiment commands' spec defaults and the live loop's token split: rules a mutation of
the code passed every other test with (twenty-fourth session's fifth mutation pass)."""

from __future__ import annotations

import copy
import dataclasses
import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tyro

from meshheal_jax import ablate, detectors, draws, main, params, recovery, runner, topology
from meshheal_jax.backends import live_loop
from meshheal_jax.config import DETECTORS, VARIANTS
from meshheal_jax.errors import MeshHealError


@pytest.fixture(scope="module")
def strong_doc() -> dict:
    return tomllib.loads((params.MODEL_DIR / "gpt-oss-120b.toml").read_text())


def test_a_review_row_that_does_not_sum_to_one_is_refused(strong_doc):
    """A categorical over the four anchors must sum to 1 (within 1e-6); the last threshold is forced
    to 1.0, so an unnormalised row would silently give its missing mass to the top anchor."""
    doc = copy.deepcopy(strong_doc)
    doc["review"]["strong_author"]["correct"] = [0.5, 0.2, 0.2, 0.05]
    with pytest.raises(MeshHealError, match=r"review\.strong_author\.correct sums to 0\.950000, not 1"):
        params.parse_model(doc, "mutant", "mutant.toml")


def test_the_other_distractors_share_the_rest_equally(strong_doc):
    """params.distractor_thresholds: "distractor 1 with p_popular_wrong, the others share the rest"."""
    doc = copy.deepcopy(strong_doc)
    doc.update(n_distractors=4, p_popular_wrong=0.4)
    thresholds = params.parse_model(doc, "mutant", "mutant.toml").distractor_thresholds()
    np.testing.assert_allclose(np.diff((0.0, *thresholds)), [0.4, 0.2, 0.2, 0.2], atol=1e-12)
    assert thresholds[-1] == 1.0


def test_a_task_type_entry_of_p_part_overrides_the_default(strong_doc):
    """spec/emulator.md: P(correct) = `p_part[dataset][type]`; `default` only for types not listed."""
    profile = topology.load_profile("bbh")
    named = profile.task_types[1]
    doc = copy.deepcopy(strong_doc)
    doc["p_part"]["bbh"] = {"default": 0.9, named: 0.3}
    base = params.parse_model(doc, "mutant", "mutant.toml").p_part_base(profile)
    assert base == tuple(0.3 if t == named else 0.9 for t in profile.task_types)


def test_each_draw_field_comes_from_its_own_field_id():
    """docs/decisions.md D1: each named field from fold_in(key_t, field_id), the fields entry,
    infer, route, calls (ids 0..3 in that order; every stored result depends on them)."""
    key = draws.task_key(3, 1, 17)
    got = draws.task_draws(3, 1, 17)

    def field(i, shape):
        return np.asarray(jax.random.uniform(jax.random.fold_in(key, i), shape, dtype=jnp.float64))

    np.testing.assert_array_equal(np.asarray(got.entry), field(0, ()))
    np.testing.assert_array_equal(np.asarray(got.infer), field(1, (draws.N_INFER,)))
    np.testing.assert_array_equal(np.asarray(got.route), field(2, (draws.N_VISITS, draws.N_ROUTE)))
    calls_shape = (draws.N_VISITS, draws.N_CALL_SLOTS, draws.N_CALL_U)
    np.testing.assert_array_equal(np.asarray(got.calls), field(3, calls_shape))


def test_baselines_refuse_several_slots():
    """Baselines run their own one-task-at-a-time program: --slots > 1 with a baseline is refused."""
    exp = runner.Experiment("scale", ("bbh",), ("default",), (0,), n_agents=12, slots=2, n_tasks=84)
    dataclasses.replace(exp, methods=("meshheal",)).validate()  # MeshHeal alone may run 2 slots
    with pytest.raises(MeshHealError, match="baselines run one task at a time: use --slots 1"):
        dataclasses.replace(exp, methods=("meshheal", "sac")).validate()
    for slots in (0, 3):  # out of range for any method: the range is named, not the baselines' rule
        with pytest.raises(MeshHealError, match=f"slots must be in 1..2 \\(at most N/6\\), got {slots}"):
            dataclasses.replace(exp, methods=("meshheal", "sac"), slots=slots).validate()


def test_recovery_names_the_one_length_that_fits():
    """The recovery stream needs five equal phases of whole blocks (42 tasks for MATH's 7 types):
    --tasks 100 or 84 is refused naming 210, not the 42-task block or the five phases alone."""
    exp = runner.Experiment("recovery", ("math",), ("default",), (0,), methods=("meshheal",), n_tasks=210)
    exp.validate()
    for n in (100, 84, 42, 205):
        with pytest.raises(MeshHealError, match=f"positive multiple of 210 .*got {n}$"):
            dataclasses.replace(exp, n_tasks=n).validate()


def test_commands_default_to_the_spec_s_experiments():
    """spec/experiments.md: 5 seeds (0..4) by default; §1 all datasets, 504 tasks, every method;
    §2 MATH, 630 tasks; §4 BBH, 504 tasks, every variant; §5 BBH, 504 tasks, pairs A and B, every
    detector."""
    m = tyro.cli(main.MainConfig, args=[])
    assert m.seed_tuple() == (0, 1, 2, 3, 4)
    assert (m.datasets, m.tasks, m.methods) == (("bbh", "math", "mmlu_pro"), 504, runner.METHODS)
    r = tyro.cli(recovery.RecoveryConfig, args=[])
    assert (r.dataset, r.tasks, r.methods, r.seed_tuple()) == ("math", 630, runner.METHODS, (0, 1, 2, 3, 4))
    a = tyro.cli(ablate.AblateConfig, args=[])
    assert (a.dataset, a.tasks, a.variants, a.seed_tuple()) == ("bbh", 504, VARIANTS, (0, 1, 2, 3, 4))
    d = tyro.cli(detectors.DetectorsConfig, args=[])
    assert (d.dataset, d.tasks, d.detectors, d.pairs) == ("bbh", 504, DETECTORS, ("A", "B"))
    assert d.seed_tuple() == (0, 1, 2, 3, 4)


@pytest.mark.parametrize(
    ("total", "n", "expected"), [(8, 3, [3, 3, 2]), (7, 3, [3, 2, 2]), (6, 3, [2, 2, 2])]
)
def test_a_reply_s_tokens_split_over_its_samples_remainder_first(total, n, expected):
    """live_loop._split: "total over n samples, exactly (remainder to the first samples)"."""
    assert live_loop._split(total, n) == expected
