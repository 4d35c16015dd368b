"""Ability profiles (spec/abilities.md): the packaged files, every validation rule, graphs."""

from __future__ import annotations

import re

import numpy as np
import pytest

from meshheal_jax import topology
from meshheal_jax.errors import MeshHealError

X1, X1c = {"A1", "A2", "A3"}, {"A4", "A5", "A6"}
X2, X2c = {"A1", "A3", "A4"}, {"A2", "A5", "A6"}
X3, X3c = {"A2", "A3", "A6"}, {"A1", "A4", "A5"}

# The tables of spec/abilities.md, written out independently of the TOML files.
EXPECTED = {
    "bbh": (
        0,
        {"mathematical": X1, "symbolic": X1, "spatial": X1c, "sequence": X2, "logical": X2c,
         "temporal": X3, "linguistic": X3c},
        {"object_counting": ("spatial", "mathematical"), "navigate": ("spatial", "mathematical"),
         "geometric_shapes": ("spatial", "symbolic"),
         "tracking_shuffled_objects_five_objects": ("sequence", "logical"),
         "logical_deduction_five_objects": ("logical", "sequence"),
         "date_understanding": ("temporal", "linguistic"),
         "temporal_sequences": ("temporal", "linguistic")},
    ),
    "math": (
        1,
        {"symbolic_manipulation": X1, "arithmetic": X1, "multi_step_deduction": X1c, "enumeration": X1c,
         "figure_reasoning": X2, "theorem_knowledge": X2c, "analytic_computation": X2c},
        {"Algebra": ("symbolic_manipulation", "multi_step_deduction"),
         "Intermediate Algebra": ("symbolic_manipulation", "multi_step_deduction"),
         "Prealgebra": ("arithmetic", "multi_step_deduction"),
         "Counting & Probability": ("symbolic_manipulation", "enumeration"),
         "Number Theory": ("arithmetic", "enumeration"),
         "Geometry": ("figure_reasoning", "theorem_knowledge"),
         "Precalculus": ("figure_reasoning", "analytic_computation")},
    ),
    "mmlu_pro": (
        2,
        {"humanities_knowledge": X1, "life_science_knowledge": X1, "physical_science_knowledge": X1,
         "quantitative_methods": X1, "text_comprehension": X1c, "contextual_inference": X1c,
         "structural_reasoning": X1c},
        {"law": ("humanities_knowledge", "text_comprehension"),
         "history": ("humanities_knowledge", "contextual_inference"),
         "psychology": ("life_science_knowledge", "contextual_inference"),
         "biology": ("life_science_knowledge", "structural_reasoning"),
         "chemistry": ("physical_science_knowledge", "structural_reasoning"),
         "economics": ("quantitative_methods", "text_comprehension"),
         "physics": ("quantitative_methods", "structural_reasoning")},
    ),
}  # fmt: skip

BBH_HOLDINGS = {  # spec/abilities.md "Holdings"
    "A1": {"mathematical", "symbolic", "sequence", "linguistic"},
    "A2": {"mathematical", "symbolic", "logical", "temporal"},
    "A3": {"mathematical", "symbolic", "sequence", "temporal"},
    "A4": {"spatial", "sequence", "linguistic"},
    "A5": {"spatial", "logical", "linguistic"},
    "A6": {"spatial", "logical", "temporal"},
}


def holders_of(profile: topology.Profile, ability: str) -> set[str]:
    s = profile.abilities.index(ability)
    return {f"A{a + 1}" for a in np.flatnonzero(profile.holds[:, s])}


# ----------------------------------------------------------------------------------------------
# The packaged profiles
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dataset", topology.DATASETS)
def test_packaged_profile_matches_spec_tables(dataset):
    profile = topology.load_profile(dataset)
    dataset_id, holders, types = EXPECTED[dataset]
    assert profile.dataset == dataset
    assert profile.dataset_id == dataset_id
    assert profile.abilities == tuple(holders)  # vocabulary order = table order
    assert {a: holders_of(profile, a) for a in profile.abilities} == holders
    assert profile.task_types == tuple(types)
    assert [tuple(profile.abilities[s] for s in req) for req in profile.requires] == list(types.values())
    assert profile.degraded_targets == (2, 4)
    assert profile.holds.shape == (6, 7) and profile.holds.dtype == bool
    assert len(profile.descriptions) == 7 and all(profile.descriptions)


@pytest.mark.parametrize("dataset", topology.DATASETS)
def test_packaged_profile_satisfies_the_rules(dataset):
    p = topology.load_profile(dataset)
    assert p.holds.sum() == 21  # 21 (agent, ability) slots
    assert (p.holds.sum(axis=0) == 3).all()  # every ability held by exactly three agents
    t1, t2 = p.degraded_targets
    for s in range(7):
        assert p.holds[t1, s] != p.holds[t2, s]  # exactly one of A3 / A5 in every holder set
    for a, b in p.requires:
        assert a != b
        assert not (p.holds[:, a] & p.holds[:, b]).any()  # disjoint holder sets ...
        assert (p.holds[:, a] | p.holds[:, b]).all()  # ... so complements
    # every agent holds one ability of every pair (the probe remark of protocol.md §3)
    for pair in p.pairs:
        a, b = sorted(pair)
        assert (p.holds[:, a] ^ p.holds[:, b]).all()


def test_bbh_holdings_per_agent(bbh_profile):
    got = {
        f"A{k + 1}": {bbh_profile.abilities[s] for s in np.flatnonzero(bbh_profile.holds[k])}
        for k in range(6)
    }
    assert got == BBH_HOLDINGS


def test_load_by_path_equals_load_by_name(bbh_profile):
    by_path = topology.load_profile(topology.PROFILE_DIR / "bbh.toml")
    assert by_path.abilities == bbh_profile.abilities
    assert by_path.requires == bbh_profile.requires
    assert np.array_equal(by_path.holds, bbh_profile.holds)


def test_unknown_dataset_lists_known_ones():
    with pytest.raises(MeshHealError, match=r"unknown dataset 'nope'.*bbh.*math.*mmlu_pro"):
        topology.load_profile("nope")


def test_unparsable_profile_file(tmp_path):
    path = tmp_path / "broken.toml"
    path.write_text("dataset = \n")
    with pytest.raises(MeshHealError, match="cannot read profile"):
        topology.load_profile(path)


# ----------------------------------------------------------------------------------------------
# Pairs (wrong-pair draws list them in order of first appearance in the task table)
# ----------------------------------------------------------------------------------------------


def test_pairs_in_order_of_first_appearance(bbh_profile):
    ab = bbh_profile.abilities.index
    assert bbh_profile.pairs == (
        frozenset({ab("spatial"), ab("mathematical")}),
        frozenset({ab("spatial"), ab("symbolic")}),
        frozenset({ab("sequence"), ab("logical")}),
        frozenset({ab("temporal"), ab("linguistic")}),
    )
    # unordered: logical+sequence is the same pair as sequence+logical
    assert [bbh_profile.pair_index(k) for k in range(7)] == [0, 0, 1, 2, 2, 3, 3]


def test_pairs_follow_the_task_table_order(bbh_doc, bbh_profile):
    bbh_doc["task_type"] = list(reversed(bbh_doc["task_type"]))
    reversed_profile = topology.parse_profile(bbh_doc)
    assert reversed_profile.pairs == tuple(reversed(bbh_profile.pairs))
    assert [reversed_profile.pair_index(k) for k in range(7)] == [0, 0, 1, 1, 2, 3, 3]


@pytest.mark.parametrize("dataset, n_pairs", [("bbh", 4), ("math", 6), ("mmlu_pro", 7)])
def test_number_of_distinct_pairs(dataset, n_pairs):
    assert len(topology.load_profile(dataset).pairs) == n_pairs


# ----------------------------------------------------------------------------------------------
# Every rule: a mutated document is rejected, the message names the rule and the culprit
# ----------------------------------------------------------------------------------------------


def ability_row(doc: dict, name: str) -> dict:
    return next(row for row in doc["ability"] if row["name"] == name)


def type_row(doc: dict, name: str) -> dict:
    return next(row for row in doc["task_type"] if row["name"] == name)


def reject(doc: dict, *fragments: str) -> str:
    with pytest.raises(MeshHealError) as info:
        topology.parse_profile(doc, "mutant.toml")
    message = str(info.value)
    assert "\n" not in message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"
    return message


def test_unmutated_document_is_accepted(bbh_doc):
    assert topology.parse_profile(bbh_doc).dataset == "bbh"


def test_ability_held_by_two_agents(bbh_doc):
    ability_row(bbh_doc, "temporal")["holders"] = ["A2", "A3"]
    reject(
        bbh_doc, "rule 'every ability is held by exactly three agents'", "'temporal'", "has 2", "mutant.toml"
    )


def test_ability_held_by_four_agents(bbh_doc):
    ability_row(bbh_doc, "logical")["holders"] = ["A2", "A5", "A6", "A4"]
    reject(bbh_doc, "held by exactly three agents", "'logical'", "has 4")


def test_duplicate_holder_is_named(bbh_doc):
    ability_row(bbh_doc, "symbolic")["holders"] = ["A1", "A1", "A2"]
    reject(bbh_doc, "ability 'symbolic'", "holder 'A1' listed twice")
    ability_row(bbh_doc, "symbolic")["holders"] = ["A1", "A1", "A2", "A3"]  # three distinct: still refused
    reject(bbh_doc, "ability 'symbolic'", "holder 'A1' listed twice")


def test_task_type_requiring_three_abilities(bbh_doc):
    type_row(bbh_doc, "navigate")["requires"] = ["spatial", "mathematical", "symbolic"]
    reject(bbh_doc, "rule 'each task type requires exactly two abilities'", "'navigate'")


def test_task_type_requiring_one_ability(bbh_doc):
    type_row(bbh_doc, "date_understanding")["requires"] = ["temporal"]
    reject(bbh_doc, "requires exactly two abilities", "'date_understanding'")


def test_task_type_requiring_the_same_ability_twice(bbh_doc):
    type_row(bbh_doc, "geometric_shapes")["requires"] = ["spatial", "spatial"]
    reject(bbh_doc, "requires exactly two abilities", "'geometric_shapes'")


def test_two_abilities_of_a_type_sharing_a_holder(bbh_doc):
    # mathematical (A1,A2,A3) and sequence (A1,A3,A4) overlap
    type_row(bbh_doc, "navigate")["requires"] = ["mathematical", "sequence"]
    reject(
        bbh_doc,
        "rule 'the two abilities of a task type are held by disjoint agent sets'",
        "'navigate'", "'mathematical'", "'sequence'",
    )  # fmt: skip


def test_six_abilities(bbh_doc):
    bbh_doc["ability"] = [row for row in bbh_doc["ability"] if row["name"] != "symbolic"]
    type_row(bbh_doc, "geometric_shapes")["requires"] = ["spatial", "mathematical"]
    reject(bbh_doc, "rule '7-ability vocabulary'", "6 abilities")


def test_eight_abilities(bbh_doc):
    bbh_doc["ability"].append({"name": "extra", "holders": ["A1", "A4", "A5"], "description": "x"})
    reject(bbh_doc, "7-ability vocabulary", "8 abilities")


def test_six_task_types(bbh_doc):
    bbh_doc["task_type"].pop()
    reject(bbh_doc, "rule '7 distinct task types'")


def test_duplicate_task_type_names(bbh_doc):
    bbh_doc["task_type"][1]["name"] = bbh_doc["task_type"][0]["name"]
    reject(bbh_doc, "task type names must be unique", "['object_counting'] repeated")


@pytest.mark.parametrize(
    "table, row, key, value, fragment",
    [("task_type", 2, "name", None, "[[task_type]] row 2: name must be a non-empty string, got None"),
     ("task_type", 1, "name", 7, "[[task_type]] row 1: name must be a non-empty string, got 7"),
     ("task_type", 3, "name", " ", "[[task_type]] row 3: name must be a non-empty string"),
     ("ability", 4, "name", "", "[[ability]] row 4: name must be a non-empty string"),
     ("ability", 1, "description", 5, "[[ability]] row 1: description must be a string, got 5")],
)  # fmt: skip
def test_names_and_descriptions_must_be_text(bbh_doc, table, row, key, value, fragment):
    if value is None:
        del bbh_doc[table][row - 1][key]
    else:
        bbh_doc[table][row - 1][key] = value
    reject(bbh_doc, fragment, "mutant.toml")


def test_agent_names_are_written_as_in_the_spec(bbh_doc):
    ability_row(bbh_doc, "spatial")["holders"] = ["A4", "A5", "A06"]
    reject(bbh_doc, "'A06'", "A1..A6")
    for unicode_digit in ("A\u00b2", "A\uff13"):  # a superscript two, a full-width three
        ability_row(bbh_doc, "spatial")["holders"] = ["A4", "A5", unicode_digit]
        reject(bbh_doc, repr(unicode_digit), "A1..A6")


def test_duplicate_ability_names(bbh_doc):
    bbh_doc["ability"][1]["name"] = bbh_doc["ability"][0]["name"]
    reject(bbh_doc, "ability names must be unique", "['mathematical'] repeated")


def test_ability_names_a_reply_could_not_tell_apart(bbh_doc):
    # a model's reply is matched to an ability ignoring case, spaces, hyphens and underscores
    # (topology.name_key, prompts.parse_inference)
    bbh_doc["ability"][0]["name"] = "spatial_reasoning"
    bbh_doc["ability"][1]["name"] = "Spatial - Reasoning"
    reject(
        bbh_doc,
        "differ only in case, spaces, hyphens or underscores",
        "['Spatial - Reasoning', 'spatial_reasoning']",
    )


def test_unknown_ability_in_a_task_type(bbh_doc):
    type_row(bbh_doc, "navigate")["requires"] = ["spatial", "telepathy"]
    reject(bbh_doc, "task type 'navigate'", "unknown ability 'telepathy'")


def test_unknown_agent(bbh_doc):
    ability_row(bbh_doc, "spatial")["holders"] = ["A4", "A5", "A9"]
    reject(bbh_doc, "'A9'", "does not exist", "ability 'spatial'")


def test_malformed_agent_name(bbh_doc):
    ability_row(bbh_doc, "spatial")["holders"] = ["A4", "A5", "agent6"]
    reject(bbh_doc, "'agent6'", "A1..A6", "ability 'spatial'")


def test_unknown_degraded_target(bbh_doc):
    bbh_doc["degraded_targets"] = ["A3", "A7"]
    reject(bbh_doc, "degraded_targets", "'A7'")


def test_degraded_targets_both_holding_an_ability(bbh_doc):
    bbh_doc["degraded_targets"] = ["A1", "A3"]  # both hold mathematical
    reject(bbh_doc, "rule 'no ability is held by both degraded targets'", "'mathematical'")


def test_holder_set_without_a_degraded_target(bbh_doc):
    # mathematical and symbolic -> {A1,A2,A4}, spatial -> its complement {A3,A5,A6}: still a valid
    # disjoint mapping, but mathematical's holder set contains neither A3 nor A5.
    ability_row(bbh_doc, "mathematical")["holders"] = ["A1", "A2", "A4"]
    ability_row(bbh_doc, "symbolic")["holders"] = ["A1", "A2", "A4"]
    ability_row(bbh_doc, "spatial")["holders"] = ["A3", "A5", "A6"]
    reject(bbh_doc, "rule 'every holder set contains exactly one degraded target'", "'mathematical'")


@pytest.mark.parametrize("targets", [["A3"], ["A3", "A3"], ["A1", "A3", "A5"]])
def test_two_distinct_degraded_targets(bbh_doc, targets):
    bbh_doc["degraded_targets"] = targets
    reject(bbh_doc, "rule 'two distinct degraded targets'")


def test_missing_key(bbh_doc):
    del bbh_doc["dataset_id"]
    reject(bbh_doc, "missing key", "dataset_id")


MALFORMED = {
    "negative dataset_id": (
        lambda d: d.update(dataset_id=-5),
        ("dataset_id", "integer in 0..2147483647", "-5"),
    ),
    "string dataset_id": (lambda d: d.update(dataset_id="zero"), ("dataset_id", "'zero'")),
    "negative question_tokens": (lambda d: d.update(question_tokens=-260), ("question_tokens", "-260")),
    "fractional question_tokens": (lambda d: d.update(question_tokens=260.5), ("question_tokens", "260.5")),
    "misspelt top-level key": (
        lambda d: d.update(degraded_target=["A3", "A5"]),
        ("unknown key", "degraded_target"),
    ),
    "misspelt ability key": (
        lambda d: d["ability"][0].update(holderz=3),
        ("unknown key", "holderz", "mathematical"),
    ),
    "[ability] instead of [[ability]]": (
        lambda d: d.update(ability={"name": "x"}),
        ("array of tables", "[[ability]]"),
    ),
    "ability as a string": (lambda d: d.update(ability="abc"), ("array of tables",)),
    "holders as one string": (
        lambda d: d["ability"][0].update(holders="A1"),
        ("holders must be an array", "'A1'"),
    ),
    "requires as one string": (
        lambda d: d["task_type"][0].update(requires="spatial"),
        ("requires must be an array",),
    ),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_values_are_named(bbh_doc, case):
    mutate, fragments = MALFORMED[case]
    mutate(bbh_doc)
    reject(bbh_doc, "mutant.toml", *fragments)


def test_agent_name_errors_name_the_file(bbh_doc):
    ability_row(bbh_doc, "mathematical")["holders"] = ["A1", "B2", "A3"]
    reject(bbh_doc, "mutant.toml: ability 'mathematical'", "'B2'")


def test_profile_loaded_by_name_must_declare_that_dataset(tmp_path):
    text = (topology.PROFILE_DIR / "bbh.toml").read_text().replace('dataset = "bbh"', 'dataset = "math"', 1)
    (tmp_path / "bbh.toml").write_text(text)
    with pytest.raises(MeshHealError, match="declares dataset = 'math', but is the profile of 'bbh'"):
        topology.load_profile("bbh", tmp_path)


def test_a_profile_that_is_not_utf8_is_named(tmp_path):
    text = (topology.PROFILE_DIR / "bbh.toml").read_text()
    (tmp_path / "bbh.toml").write_bytes(text.encode() + b"# \xff\n")
    with pytest.raises(MeshHealError, match="profile .*bbh.toml is not UTF-8 text"):
        topology.load_profile("bbh", tmp_path)


def test_counts_past_what_the_engines_hold_are_refused(bbh_doc):
    bbh_doc["dataset_id"] = 2**40
    reject(bbh_doc, "dataset_id must be an integer in 0..2147483647")


def test_missing_profiles_folder_is_named(tmp_path):
    with pytest.raises(MeshHealError, match="profiles folder .*nowhere does not exist"):
        topology.load_profile("bbh", tmp_path / "nowhere")


def test_other_degraded_targets_are_accepted(bbh_doc):
    # A1 and A6 are complementary in BBH, so they are valid targets too
    bbh_doc["degraded_targets"] = ["A1", "A6"]
    assert topology.parse_profile(bbh_doc).degraded_targets == (0, 5)


# ----------------------------------------------------------------------------------------------
# Replication and graphs
# ----------------------------------------------------------------------------------------------


def test_replicate_holds_for_12_agents(bbh_profile):
    holds = topology.replicate_holds(bbh_profile, 12)
    assert holds.shape == (12, 7)
    for k in range(12):  # agent k has profile A{(k mod 6)+1}
        assert np.array_equal(holds[k], bbh_profile.holds[k % 6])


@pytest.mark.parametrize("n", [0, -6, 7, 13])
def test_replicate_holds_rejects_non_multiples_of_six(bbh_profile, n):
    with pytest.raises(MeshHealError, match="multiple of 6"):
        topology.replicate_holds(bbh_profile, n)


def test_build_network_12_agents(bbh_profile):
    net = topology.build_network(bbh_profile, 12)
    assert net.n_agents == 12
    assert net.degraded_targets == (2, 4, 8, 10)  # A3/A5 of every replica
    assert net.n_edges == 66
    assert net.neighbours(0) == list(range(1, 12))


def test_build_network_rejects_graph_of_the_wrong_size(bbh_profile):
    with pytest.raises(MeshHealError, match="7 agents"):
        topology.build_network(bbh_profile, 6, topology.complete_graph(7))


def test_complete_graph():
    adj = topology.complete_graph(5)
    assert adj.dtype == bool and not adj.diagonal().any() and adj.sum() == 20
    topology.validate_graph(adj)


def test_validate_graph_rejects_asymmetric():
    adj = topology.complete_graph(6)
    adj[1, 4] = False
    with pytest.raises(MeshHealError, match=re.escape("edge (1, 4) is not undirected")):
        topology.validate_graph(adj)


def test_validate_graph_rejects_self_loop():
    adj = topology.complete_graph(6)
    adj[3, 3] = True
    with pytest.raises(MeshHealError, match="self loop at agent 3"):
        topology.validate_graph(adj)


def test_validate_graph_rejects_disconnected():
    adj = np.zeros((6, 6), dtype=bool)
    for i, j in [(0, 1), (1, 2), (3, 4), (4, 5)]:  # two paths of three
        adj[i, j] = adj[j, i] = True
    with pytest.raises(
        MeshHealError,
        match=r"^graph: not connected: agent 3 \(A4 of replica 0\) is unreachable from agent 0 \(2 components\)$",
    ):
        topology.validate_graph(adj)


def test_validate_graph_rejects_non_square():
    with pytest.raises(MeshHealError, match="square"):
        topology.validate_graph(np.zeros((6, 5), dtype=bool))


def test_validate_graph_accepts_a_path():
    adj = np.zeros((6, 6), dtype=bool)
    for i in range(5):
        adj[i, i + 1] = adj[i + 1, i] = True
    topology.validate_graph(adj)
