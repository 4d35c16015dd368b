"""Experiments with `--backend live`: the CLI flags -> runner -> live host loop -> run folder,
against the SCRIPTED STAND-IN servers of test_live_loop (in-process HTTP servers answering in the
OpenAI format; NOT vLLM, NOT a model). The same path against a real `transformers serve` is in
test_live_server.py."""

from __future__ import annotations

import json
import sys

import polars as pl
import pytest
import tyro

pytest.importorskip("openai")
pytest.importorskip("pydantic")

from test_live_loop import RECORDS, bbh_spec, config, stand_ins  # the scripted stand-in servers

from meshheal_jax import main, recovery, runner
from meshheal_jax.backends.live_loop import run_live_streams
from meshheal_jax.cli import live_settings
from meshheal_jax.config import ProtocolParams
from meshheal_jax.errors import MeshHealError

pytestmark = pytest.mark.filterwarnings("ignore::meshheal_jax.data.QuestionPoolWarning")


def flags(strong: str, weak: str, out, *extra: str) -> list[str]:
    return ["--backend", "live", "--strong-url", strong, "--weak-url", weak, "--methods", "meshheal",
            "--datasets", "bbh", "--seeds", "2", "--tasks", "42", "--data", "sample", "--quiet",
            "--out", str(out), *extra]  # fmt: skip


@pytest.fixture(scope="module")
def live_main(tmp_path_factory):
    """`python -m meshheal_jax.main --backend live ...` (2 seeds of 42 BBH tasks), run in-process."""
    pair = stand_ins()
    out = tmp_path_factory.mktemp("live-main") / "run"
    argv = flags(pair[0].url, pair[1].url, out)
    try:
        main.body(tyro.cli(main.MainConfig, args=argv))
        yield out, pair, argv, sum(len(s.chats) for s in pair)
    finally:
        for server in pair:
            server.close()


def test_live_main_writes_a_run_folder(live_main):
    out, _, _, sent = live_main
    summary = json.loads((out / "summary.json").read_text())
    assert summary["backend"] == "live"
    (result,) = [r for r in summary["results"] if r["dataset"] == "bbh"]
    assert result["method"] == "meshheal" and len(result["seeds"]) == 2
    tasks = pl.read_parquet(out / "tasks.parquet")
    assert tasks.height == 84 and sorted(tasks["seed"].unique()) == [0, 1]
    calls = pl.read_parquet(out / "calls.parquet")
    assert calls.height == tasks["calls"].sum()
    # the models are the stand-ins' real ids (read from /v1/models), not role names
    assert set(calls["model"].unique()) <= {"openai/gpt-oss-120b", "meta-llama/Llama-3.2-1B-Instruct"}
    assert (out / "responses.sqlite").exists() and (out / "live-default" / "live_trace.parquet").exists()
    # one request per call, except an initial review's three samples (one n=3 request)
    reviews = calls.filter(pl.col("kind") == "review").height
    assert sent == calls.height - reviews * 2 // 3
    assert (out / "report.md").exists()


def test_rerun_resends_nothing_and_gives_the_same_results(live_main, tmp_path):
    out, pair, argv, sent = live_main
    before = pl.read_parquet(out / "tasks.parquet")
    import shutil

    shutil.rmtree(out / "parts")  # as if the run had died before writing any stream
    main.body(tyro.cli(main.MainConfig, args=argv))
    assert sum(len(s.chats) for s in pair) == sent  # every reply came from the response cache
    assert pl.read_parquet(out / "tasks.parquet").equals(before)


def test_live_settings_from_a_config_file(tmp_path):
    path = tmp_path / "live.toml"
    path.write_text('strong_url = ["http://a:1/v1,http://b:1/v1"]\nweak_url = "http://c:1/v1"\n'
                    'max_tokens = 64\ndata = "sample"\n')  # fmt: skip
    cfg = tyro.cli(
        main.MainConfig, args=["--backend", "live", "--live-config", str(path), "--max-tokens", "8"]
    )
    live = live_settings(cfg)
    assert live.strong_urls == ("http://a:1/v1", "http://b:1/v1") and live.weak_urls == ("http://c:1/v1",)
    assert live.max_tokens == 8 and live.data == "sample"  # the flag wins over the file
    assert set(live.options().max_completion_tokens.values()) == {8}
    path.write_text('strong_urls = ["x"]\n')
    with pytest.raises(MeshHealError, match="unknown keys"):
        live_settings(tyro.cli(main.MainConfig, args=["--live-config", str(path)]))
    for text, message in (
        (
            'strong_url = "http://a/v1"\nmax_in_flight = "many"\n',
            "max_in_flight must be an integer, got 'many'",
        ),
        ("strong_url = 5\n", "strong_url must be a URL or a list of URLs, got 5"),
        ('strong_url = "http://a/v1"\nstrong_model = 3\n', "strong_model must be a string, got 3"),
    ):
        path.write_text(text)
        with pytest.raises(MeshHealError, match=f"--live-config {path}: {message}"):
            live_settings(tyro.cli(main.MainConfig, args=["--live-config", str(path)]))


LIVE_AB = ["--backend", "live", "--strong-url", "http://a/v1", "--weak-url", "http://b/v1"]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--backend", "live"], "needs --strong-url and --weak-url"),
        (["--backend", "live", "--strong-url", "http://a/v1"], "weak model's server"),
        (["--strong-url", "http://a/v1", "--weak-url", "http://b/v1"], "add --backend live"),
        (
            [*LIVE_AB, "--methods", "meshheal", "--data", "/no/such/folder"],
            "does not exist",
        ),
        ([*LIVE_AB, "--max-tokens", "0"], "max_tokens must be >= 1, got 0"),
    ],
)
def test_bad_live_settings_are_named(argv, message):
    with pytest.raises(MeshHealError, match=message):
        main.experiment(tyro.cli(main.MainConfig, args=argv)).validate()


def test_unreachable_server_is_named_and_nothing_is_lost(tmp_path, capsys, monkeypatch):
    pair = stand_ins()
    dead = pair[1].url
    pair[1].close()  # the weak server is down from the start
    argv = flags(pair[0].url, dead, tmp_path / "run", "--seeds", "1")
    monkeypatch.setattr(sys, "argv", ["meshheal_jax.main", *argv])
    try:
        with pytest.raises(SystemExit) as exit_:
            main.cli()
    finally:
        pair[0].close()
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "127.0.0.1" in err and dead.split("//")[1].split("/")[0] in err
    assert (tmp_path / "run" / "config.json").exists()  # the run folder is there to resume


def test_recovery_and_runner_accept_the_live_backend():
    cfg = tyro.cli(recovery.RecoveryConfig, args=["--backend", "live", "--strong-url", "http://a/v1",
                                                  "--weak-url", "http://b/v1", "--methods", "meshheal"])  # fmt: skip
    exp = recovery.experiment(cfg)
    exp.validate()
    assert exp.backend == "live" and exp.live.weak_urls == ("http://b/v1",)
    # the URLs and in-flight limit do not change results: a resumed run may use other servers
    a = runner.comparable(json.loads(json.dumps(exp.to_json())))
    moved = runner.Experiment(
        **{**exp.__dict__, "live": runner.LiveSettings(("http://z/v1",), ("http://y/v1",))}
    )
    assert runner.comparable(json.loads(json.dumps(moved.to_json()))) == a


def test_single_reviewer_writes_its_correction_itself(tmp_path):
    """The single_reviewer ablation's one correction call (decisions V2, emitted as a synthesis with
    no candidates) is a correction prompt with the committee's reasons, not a synthesis prompt that
    shows the rejected output as a reviewer's corrected candidate."""
    pair = stand_ins()
    try:
        (frames,) = run_live_streams(
            [bbh_spec(0)], ProtocolParams(variant="single_reviewer"), config(pair), RECORDS, run_dir=tmp_path
        )
        prompts_sent = [c["messages"][-1]["content"] for server in pair for c in server.chats]
    finally:
        for server in pair:
            server.close()
    corrections = frames["calls"].filter(pl.col("kind") == "synthesis").height
    assert corrections > 0 and frames["calls"].filter(pl.col("kind") == "candidate").height == 0
    assert sum("Write a corrected version" in text for text in prompts_sent) == corrections
    assert not any("Two reviewers each wrote" in text for text in prompts_sent)
