"""Emulator model parameter files (params.parse_model / load_model / load_pair): every malformed
value is refused with one line naming the file and the key, before any run starts."""

from __future__ import annotations

import copy
import tomllib

import pytest

from meshheal_jax import params, topology
from meshheal_jax.errors import MeshHealError

SOURCE = "mutant.toml"


@pytest.fixture(scope="module")
def strong_doc() -> dict:
    return tomllib.loads((params.MODEL_DIR / "gpt-oss-120b.toml").read_text())


def reject(doc: dict, *fragments: str) -> None:
    with pytest.raises(MeshHealError) as info:
        params.parse_model(doc, "mutant", SOURCE)
    message = str(info.value)
    assert "\n" not in message and message.startswith(SOURCE), message
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_packaged_files_parse(strong_doc):
    assert (
        params.parse_model(copy.deepcopy(strong_doc), "gpt-oss-120b", SOURCE).p_infer == strong_doc["p_infer"]
    )


def test_baseline_kinds_have_their_own_token_figures_or_read_the_kind_they_resemble(strong_doc):
    """spec/emulator.md: compose / refine / extra chain-of-thought samples have their own token
    figures; a file without them reads synthesis, synthesis, generate (decisions B0)."""
    for name in ("gpt-oss-120b", "llama-3.2-1b", "gemma-3-4b", "llama-3.3-70b"):
        doc = tomllib.loads((params.MODEL_DIR / f"{name}.toml").read_text())
        for key in ("completion_tokens", "prompt_tokens"):
            assert set(params.BASELINE_TOKEN_KINDS) <= set(doc[key]), (name, key)  # every field is in them
    doc = copy.deepcopy(strong_doc)
    doc["completion_tokens"]["compose"] = [7, 9]
    m = params.parse_model(doc, "mutant", SOURCE)
    assert m.completion_tokens["compose"] == (7, 9)
    for key in ("completion_tokens", "prompt_tokens"):
        for kind in params.BASELINE_TOKEN_KINDS:
            doc[key].pop(kind, None)
    m = params.parse_model(doc, "mutant", SOURCE)
    assert tuple(m.completion_tokens) == params.TOKEN_KINDS
    assert m.completion_tokens["refine"] == m.completion_tokens["synthesis"]
    assert m.completion_tokens["cot"] == m.completion_tokens["generate"]
    assert m.prompt_tokens["compose"] == m.prompt_tokens["synthesis"]
    assert params.parse_model(tomllib.loads(params.dump_model(m)), "mutant", SOURCE) == m  # dumped with them


MALFORMED = {
    "misspelt optional key": (lambda d: d.update(difficulty_sprad=0.5), ("unknown key", "difficulty_sprad")),
    "boolean probability": (lambda d: d.update(p_infer=True), ("p_infer", "probability", "True")),
    "word for a count": (lambda d: d.update(n_distractors="four"), ("n_distractors", "integer", "'four'")),
    "fractional count": (lambda d: d.update(n_distractors=2.7), ("n_distractors", "integer", "2.7")),
    "missing scalar": (lambda d: d.pop("p_fix"), ("missing key", "p_fix")),
    "p_part as a number": (lambda d: d["p_part"].update(bbh=0.3), ("p_part.bbh must be a table", "0.3")),
    "word probability in p_part": (lambda d: d["p_part"]["bbh"].update(default="high"), ("p_part.bbh.default", "'high'")),
    "completion tokens as a number": (lambda d: d["completion_tokens"].update(infer=88), ("completion_tokens.infer", "88")),
    "completion tokens with a word": (lambda d: d["completion_tokens"].update(infer=["a", 88]), ("completion_tokens.infer", "'a'")),
    "a baseline kind reversed": (lambda d: d["completion_tokens"].update(cot=[442, 88]), ("completion_tokens.cot", "min <= max")),
    "completion tokens reversed": (lambda d: d["completion_tokens"].update(infer=[442, 88]), ("completion_tokens.infer", "min <= max")),
    "completion tokens missing a kind": (lambda d: d["completion_tokens"].pop("infer"), ("completion_tokens is missing infer",)),
    "completion tokens of an unknown kind": (lambda d: d["completion_tokens"].update(inferr=[1, 2]), ("unknown call kind", "inferr")),
    "negative prompt tokens": (lambda d: d["prompt_tokens"].update(infer=-720), ("prompt_tokens.infer", "-720")),
    "fractional prompt tokens": (lambda d: d["prompt_tokens"].update(infer=720.9), ("prompt_tokens.infer", "720.9")),
    "review row as a number": (lambda d: d["review"]["strong_author"].update(correct=1.0), ("review.strong_author.correct",)),
    "a billion distractors": (lambda d: d.update(n_distractors=10**9), ("n_distractors must be an integer in 1..64",)),
    "completion tokens past int32": (lambda d: d["completion_tokens"].update(infer=[1, 3 * 10**9]), ("completion_tokens.infer", "0..1000000")),
}  # fmt: skip


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_values_are_named(strong_doc, case):
    doc = copy.deepcopy(strong_doc)
    mutate, fragments = MALFORMED[case]
    mutate(doc)
    reject(doc, *fragments)


def test_unknown_task_type_in_p_part_is_named(strong_doc):
    doc = copy.deepcopy(strong_doc)
    doc["p_part"]["bbh"]["navigat"] = 0.9
    model = params.parse_model(doc, "mutant", SOURCE)
    with pytest.raises(MeshHealError, match="p_part.bbh has unknown task type.*navigat"):
        model.p_part_base(topology.load_profile("bbh"))


def test_different_distractor_counts_named_for_the_jax_engine_only(tmp_path):
    from meshheal_jax.runner import Experiment

    for name in params.PAIRS["default"]:
        text = (params.MODEL_DIR / f"{name}.toml").read_text()
        if name == "llama-3.2-1b":
            text = text.replace("n_distractors = 4", "n_distractors = 3", 1)
        (tmp_path / f"{name}.toml").write_text(text)
    exp = Experiment(
        name="main", datasets=("bbh",), pairs=("default",), seeds=(0,), n_tasks=42, params_dir=tmp_path
    )
    with pytest.raises(MeshHealError, match=r"pair default: .*gpt-oss-120b: 4, llama-3.2-1b: 3"):
        exp.validate()
    Experiment(
        name="main",
        datasets=("bbh",),
        pairs=("default",),
        seeds=(0,),
        n_tasks=42,
        params_dir=tmp_path,
        methods=("meshheal",),
        engine="reference",
    ).validate()  # the reference draws each model's own


def test_a_dataset_missing_from_p_part_is_refused_before_the_run(tmp_path):
    from meshheal_jax.runner import Experiment

    for name in params.PAIRS["default"]:
        text = (params.MODEL_DIR / f"{name}.toml").read_text()
        if name == "llama-3.2-1b":
            text = "\n".join(line for line in text.splitlines() if not line.startswith("bbh = "))
        (tmp_path / f"{name}.toml").write_text(text)
    exp = Experiment(
        name="main", datasets=("bbh",), pairs=("default",), seeds=(0,), n_tasks=42, params_dir=tmp_path
    )
    with pytest.raises(
        MeshHealError, match="model file llama-3.2-1b: no \\[p_part\\] entry for dataset 'bbh'"
    ):
        exp.validate()


def test_unreadable_model_files_are_named(tmp_path):
    """A model file that is not UTF-8 text, or a folder, is refused naming the file."""
    (tmp_path / "llama-3.2-1b.toml").write_bytes(b'model = "caf\xe9"\n')
    with pytest.raises(
        MeshHealError, match=r"model parameter file .*llama-3.2-1b.toml is not UTF-8 text \(line 1, byte 12"
    ):
        params.load_model("llama-3.2-1b", tmp_path)
    (tmp_path / "gpt-oss-120b.toml").mkdir()
    with pytest.raises(
        MeshHealError, match="cannot read model parameter file .*gpt-oss-120b.toml: Is a directory"
    ):
        params.load_model("gpt-oss-120b", tmp_path)


def test_difficulty_knobs_far_out_reach_their_limits_instead_of_overflowing():
    # review_difficulty / difficulty_spread are only bounded below: a value of 1000 in a model file
    # once overflowed math.exp while the pair was built
    review = (0.1, 0.2, 0.3, 0.4)
    assert params.tilted(review, 3000.0) == (0.0, 0.0, 0.0, 1.0)
    assert params.tilted(review, -3000.0) == (1.0, 0.0, 0.0, 0.0)
    assert params.tilted((0.0, 0.2, 0.3, 0.5), -3000.0) == (0.0, 1.0, 0.0, 0.0)  # an empty anchor stays empty
    assert params.shifted_probability(0.3, -1000.0) == 0.0
    assert params.shifted_probability(0.3, 1000.0) == 1.0
    # values in range keep the plain formula
    weights = [p * 2.718281828459045 ** (1.5 * a) for p, a in zip(review, params.ANCHORS)]
    assert params.tilted(review, 1.5) == pytest.approx(tuple(w / sum(weights) for w in weights), rel=1e-15)
