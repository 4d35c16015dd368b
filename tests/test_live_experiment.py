"""Experiments with `--backend live`: the CLI flags -> runner -> live host loop -> run folder,
against the SCRIPTED STAND-IN servers of test_live_loop (in-process HTTP servers answering in the
OpenAI format; NOT vLLM, NOT a model). The same path against a real `transformers serve` is in
test_live_server.py."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
import types

import polars as pl
import pytest
import tyro

pytest.importorskip("openai")
pytest.importorskip("pydantic")

from test_live_loop import RECORDS, bbh_spec, config, stand_ins  # the scripted stand-in servers

from meshheal_jax import data, main, recovery, report, runner
from meshheal_jax.backends import live
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
    """`python -m meshheal_jax.main --backend live ... --reasoning-effort high` (2 seeds of 42 BBH
    tasks), run in-process."""
    pair = stand_ins()
    out = tmp_path_factory.mktemp("live-main") / "run"
    argv = flags(pair[0].url, pair[1].url, out, "--reasoning-effort", "high")
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
    # spec/live.md: tokens count an n=3 review's prompt three times; the shared prefill is reported apart
    prefix = summary["server_prefix"]
    review_prompt = calls.filter(pl.col("kind") == "review")["prompt_tokens"].sum()
    assert prefix["requests"] == sent and prefix["prompt_tokens"] == calls["prompt_tokens"].sum()
    assert prefix["prefix_shared_tokens"] == review_prompt * 2 // 3 > 0
    assert prefix["prefix_shared_share"] == prefix["prefix_shared_tokens"] / prefix["prompt_tokens"]


def test_rerun_resends_nothing_and_gives_the_same_results(live_main, tmp_path, capsys):
    out, pair, argv, sent = live_main
    before = pl.read_parquet(out / "tasks.parquet")
    import shutil

    shutil.rmtree(out / "parts")  # as if the run had died before writing any stream
    cfg = tyro.cli(main.MainConfig, args=argv)
    results = runner.run(main.experiment(cfg), out, progress=True)  # main.body's run, with its lines
    assert results.resumed  # the replies kept were all there was to resume from
    assert (
        f"resuming {out}: 0 of 2 streams already finished, {sent:,} replies in responses.sqlite"
        in capsys.readouterr().out
    )
    main.body(cfg)
    assert sum(len(s.chats) for s in pair) == sent  # every reply came from the response cache
    assert pl.read_parquet(out / "tasks.parquet").equals(before)
    assert (
        json.loads((out / "summary.json").read_text())["server_prefix"]["requests"] == sent
    )  # replays not counted


def test_a_live_run_stopped_mid_round_says_one_line(tmp_path, terminal_sigint):
    """Ctrl-C while a round's calls are out: the run's one-line stop and status 130, with no
    asyncio "exception was never retrieved" traceback after it (it followed in most such stops)."""
    import os
    import signal
    import subprocess
    import time

    from test_live_loop import well_formed

    pair = stand_ins(lambda role, body: (time.sleep(0.05), well_formed(role, body))[1])
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "meshheal_jax.main", *flags(pair[0].url, pair[1].url, tmp_path / "run")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"),
        )  # fmt: skip
        deadline = time.monotonic() + 240
        while sum(len(s.chats) for s in pair) < 30 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        for server in pair:
            server.close()
    assert proc.returncode == 130, err[-2000:]
    lines = [line for line in err.splitlines() if not line.startswith("warning:")]
    assert len(lines) == 1 and lines[0].startswith("stopped:"), err[-2000:]


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


def test_one_role_s_requests_in_flight_from_a_config_file(tmp_path):
    """A vLLM server with --data-parallel-size D serves D x --max-num-seqs at one URL: its role gets
    its own cap; the other role keeps max_in_flight. Neither is compared on resume (how, not what)."""
    from meshheal_jax import runner

    path = tmp_path / "live.toml"
    path.write_text('strong_url = "http://a:1/v1"\nweak_url = "http://c:1/v1"\nmax_in_flight = 128\n'
                    "strong_max_in_flight = 1792\n")  # fmt: skip
    live = live_settings(tyro.cli(main.MainConfig, args=["--backend", "live", "--live-config", str(path)]))
    groups = {g.role: g.max_in_flight for g in live.config(tmp_path / "responses.sqlite").servers}
    assert groups == {"strong": 1792, "weak": 128}
    before = {"live": dataclasses.asdict(live)}
    after = {
        "live": dataclasses.asdict(dataclasses.replace(live, strong_max_in_flight=None, max_in_flight=7))
    }
    assert runner.comparable(before) == runner.comparable(after)
    path.write_text('strong_url = "http://a:1/v1"\nweak_url = "http://c:1/v1"\nweak_max_in_flight = 0\n')
    with pytest.raises(MeshHealError, match="weak_max_in_flight must be >= 1, got 0"):
        main.experiment(
            tyro.cli(main.MainConfig, args=["--backend", "live", "--live-config", str(path)])
        ).validate()
    path.write_text('strong_url = "http://a:1/v1"\nstrong_max_in_flight = 2.5\n')
    with pytest.raises(MeshHealError, match="strong_max_in_flight must be an integer, got 2.5"):
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


def test_a_live_run_keeps_only_the_tables_asked_for(tmp_path):
    """`--tables tasks states` (scale's): a live stream's part holds those two, as an emulated one's."""
    pair = stand_ins()
    try:
        cfg = tyro.cli(
            main.MainConfig, args=flags(pair[0].url, pair[1].url, tmp_path / "run", "--seeds", "1")
        )
        exp = dataclasses.replace(main.experiment(cfg), tables=("tasks", "states"))
        results = runner.run(exp, tmp_path / "run", progress=False)
    finally:
        for server in pair:
            server.close()
    (part,) = (results.run_dir / "parts").iterdir()
    assert sorted(p.name for p in part.iterdir()) == ["states.parquet", "tasks.parquet"]
    assert results.calls.is_empty() and results.tasks.height == 42


def test_ablate_prints_its_parse_failures(tmp_path, capsys):
    """Replies that never parse are recorded with their parser's fallback; main prints a line per
    result, and so do the other commands (report.print_parse_notes; they printed nothing). Ablate
    here: recovery's shortest live run takes ~80 s against these stand-ins."""
    from test_live_loop import garbage

    from meshheal_jax import ablate

    pair = stand_ins(garbage)
    argv = ["--backend", "live", "--strong-url", pair[0].url, "--weak-url", pair[1].url, "--data", "sample",
            "--seeds", "1", "--quiet", "--out", str(tmp_path / "run")]  # fmt: skip
    try:
        ablate.body(tyro.cli(ablate.AblateConfig, args=[*argv, "--variants", "full", "--tasks", "42"]))
    finally:
        for server in pair:
            server.close()
    out = capsys.readouterr().out
    assert "Parse failures, bbh meshheal (default), per stream:" in out
    assert "replies failed their retry too (fallback recorded)" in out


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
    cfg = tyro.cli(
        recovery.RecoveryConfig,
        args=[
            "--backend",
            "live",
            "--strong-url",
            "http://a/v1",
            "--weak-url",
            "http://b/v1",
            "--methods",
            "meshheal",
            "--data",
            "sample",
        ],
    )  # fmt: skip (validate reads the questions)
    exp = recovery.experiment(cfg)
    exp.validate()
    assert exp.backend == "live" and exp.live.weak_urls == ("http://b/v1",)
    # the URLs and in-flight limit do not change results: a resumed run may use other servers
    a = runner.comparable(json.loads(json.dumps(exp.to_json())))
    moved = runner.Experiment(
        **{**exp.__dict__, "live": runner.LiveSettings(("http://z/v1",), ("http://y/v1",), data="sample",
                                                        request_timeout_s=60.0)}
    )  # fmt: skip
    assert runner.comparable(json.loads(json.dumps(moved.to_json()))) == a


def test_request_timeout_reaches_the_client_and_is_checked():
    """--request-timeout-s (or the live config's request_timeout_s) is each HTTP call's timeout."""
    live_args = ["--backend", "live", "--strong-url", "http://a/v1", "--weak-url", "http://b/v1"]

    def settings(*args: str) -> runner.LiveSettings:
        return live_settings(tyro.cli(main.MainConfig, args=[*live_args, *args]))

    assert settings("--request-timeout-s", "45").config(None).retry.request_timeout_s == 45.0
    assert settings().request_timeout_s == 900.0
    bad = settings("--request-timeout-s", "0")
    with pytest.raises(MeshHealError, match="request_timeout_s must be > 0 seconds, got 0.0"):
        bad.validate()


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


# ----------------------------------------------------------------------------------------------
# --reasoning-effort and the --hub-* flags (spec/live.md "Requests", "Datasets")
# ----------------------------------------------------------------------------------------------


def test_reasoning_effort_goes_to_the_gpt_oss_server_only_and_is_recorded(live_main):
    out, pair, _, _ = live_main
    strong, weak = pair  # gpt-oss-120b behind the strong stand-in, Llama-3.2-1B behind the weak one
    assert strong.chats and {chat.get("reasoning_effort") for chat in strong.chats} == {"high"}
    assert weak.chats and not any("reasoning_effort" in chat for chat in weak.chats)
    recorded = json.loads((out / "config.json").read_text())["experiment"]["live"]
    assert recorded["reasoning_effort"] == "high"
    assert recorded["hub"] == {}  # --data sample: nothing is read from the hub


def test_resume_with_another_reasoning_effort_is_refused(live_main):
    out, pair, argv, sent = live_main
    config_before = (out / "config.json").read_text()
    for other in (["--reasoning-effort", "low"], []):  # [] = the default, medium
        changed = [*argv[: argv.index("--reasoning-effort")], *other]
        with pytest.raises(MeshHealError, match=r"different configuration \(live\.reasoning_effort differ\)"):
            main.body(tyro.cli(main.MainConfig, args=changed))
    assert sum(len(s.chats) for s in pair) == sent and (out / "config.json").read_text() == config_before


@pytest.mark.parametrize("effort", ["low", "medium", "high"])
def test_server_groups_send_the_effort_to_gpt_oss_models_only(effort):
    settings = runner.LiveSettings(("http://a/v1",), ("http://b/v1",), reasoning_effort=effort)
    for group in settings.config(None).servers:
        assert group.effort_for("openai/gpt-oss-120b") == group.effort_for("OpenAI/GPT-OSS-20B") == effort
        assert group.effort_for("meta-llama/Llama-3.2-1B-Instruct") is None
        assert group.effort_for("google/gemma-3-4b-it") is None
    # the default sends what ServerGroup's own default ("auto") sends: cached replies keep their keys
    assert runner.DEFAULT_REASONING_EFFORT == live.DEFAULT_REASONING_EFFORT == "medium"
    assert runner.DEFAULT_REQUEST_TIMEOUT_S == live.RetryPolicy().request_timeout_s
    default = runner.LiveSettings(("http://a/v1",), ("http://b/v1",)).config(None).servers[0]
    auto = live.ServerGroup("strong", ("http://a/v1",))
    for model in ("openai/gpt-oss-120b", "meta-llama/Llama-3.2-1B-Instruct"):
        assert default.effort_for(model) == auto.effort_for(model)


HUB_ARGS = [*LIVE_AB, "--methods", "meshheal"]


def hub_experiment(*args: str, command=main) -> runner.Experiment:
    config_type = main.MainConfig if command is main else recovery.RecoveryConfig
    tasks = ["--tasks", "84"] if command is main else []  # recovery: its default length
    exp = command.experiment(tyro.cli(config_type, args=[*HUB_ARGS, *tasks, *args]))
    exp.validate()
    return exp


@pytest.fixture
def hub_stub(monkeypatch):
    """`datasets.load_dataset` answering MATH and MMLU-Pro ids from the packaged sample (no hub
    offline; validating a live run reads its questions); yields the calls it got. The runner's
    question cache is emptied around the test, so every read goes through the stub."""
    loaded = []

    def load_dataset(hub_id, config=None, split=None, **kwargs):
        loaded.append((hub_id, config, split, kwargs))
        is_math = "math" in hub_id.lower()
        folder = data.SAMPLE_DIR / ("math" if is_math else "mmlu_pro")
        name = "math500_sample.jsonl" if is_math else "mmlu_pro_test_sample.jsonl"
        return [json.loads(line) for line in (folder / name).open()]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    runner.read_questions.cache_clear()
    runner.hub_commit.cache_clear()
    yield loaded
    runner.read_questions.cache_clear()
    runner.hub_commit.cache_clear()


def test_a_hub_run_reads_and_records_one_commit(monkeypatch, hub_stub, tmp_path):
    """When the hub can be asked (data.hub_commit, a stub here), the questions are read at the commit
    the revision names, config.json's inputs record it, and report.md's command pins it."""
    commit, asked = "c0ffee" * 6 + "abcd", []
    monkeypatch.setattr(
        data, "hub_commit", lambda hub_id, revision=None: asked.append((hub_id, revision)) or commit
    )
    exp = hub_experiment("--datasets", "math", "--hub-id", "math=HuggingFaceH4/MATH-500")
    assert hub_stub == [("HuggingFaceH4/MATH-500", None, "test", {"revision": commit})]
    config = json.loads((runner.prepare_run_dir(exp, tmp_path / "run") / "config.json").read_text())
    assert config["inputs"]["questions math"]["commit"] == commit
    assert asked == [("HuggingFaceH4/MATH-500", None)]  # asked once per process
    (command, _) = report.reproduce_commands(config)
    assert f"--hub-revision math={commit}" in command
    monkeypatch.setattr(
        data, "hub_commit", lambda hub_id, revision=None: None
    )  # offline: as given, none kept
    runner.hub_commit.cache_clear()
    runner.read_questions.cache_clear()
    exp = hub_experiment("--datasets", "math", "--hub-id", "math=HuggingFaceH4/MATH-500")
    assert hub_stub[-1][3] == {}
    config = json.loads((runner.prepare_run_dir(exp, tmp_path / "offline") / "config.json").read_text())
    assert config["inputs"]["questions math"]["commit"] is None
    assert "--hub-revision" not in report.reproduce_commands(config)[0]


def test_a_resume_reads_the_commit_its_folder_recorded(monkeypatch, hub_stub, tmp_path):
    """An emulated `--data hub` run (the reference engine: no compile) is cut short, then the hub's
    branch moves to a commit whose questions differ. The rerun reads the recorded commit: it resumes,
    and the stream it runs again is the same as before. A new folder reads the new commit."""
    old, new = "a" * 40, "b" * 40
    head = [old]
    monkeypatch.setattr(data, "hub_commit", lambda hub_id, revision=None: head[0])
    stub_load = sys.modules["datasets"].load_dataset

    def load_dataset(hub_id, config=None, split=None, **kwargs):
        rows = stub_load(hub_id, config, split, **kwargs)
        if kwargs.get("revision") == new:  # the moved branch: other texts
            rows = [{**row, "problem": row["problem"] + " Show your work."} for row in rows]
        return rows

    monkeypatch.setattr(sys.modules["datasets"], "load_dataset", load_dataset)
    exp = runner.Experiment("main", ("math",), ("default",), (0, 1), engine="reference", n_tasks=84,
                            live=runner.LiveSettings((), (), data="hub"))  # fmt: skip
    first = runner.run(exp, tmp_path / "run", progress=False)
    one_read = len(hub_stub)  # (a load_dataset call per MATH subject)
    shutil.rmtree(runner._part_dir(tmp_path / "run", "meshheal", "math", "default", 1))  # cut short
    head[0] = new
    runner.hub_commit.cache_clear()  # a new process: the hub is asked again
    runner.read_questions.cache_clear()
    before = len(hub_stub)
    again = runner.run(exp, tmp_path / "run", progress=False)
    assert [kwargs for *_, kwargs in hub_stub[before:]] == [{"revision": old}] * one_read  # the old commit
    for name in exp.tables:
        assert getattr(again, name).equals(getattr(first, name)), name
    other = dataclasses.replace(exp, live=runner.LiveSettings((), (), data="hub",
                                                              hub=(runner.HubSource("math", "HuggingFaceH4/MATH-500"),)))  # fmt: skip
    before = len(hub_stub)
    with pytest.raises(MeshHealError, match=r"different configuration \(live.hub.math.hub_id differ\)"):
        runner.run(other, tmp_path / "run", progress=False)  # another source: read at its own head, refused
    assert {kwargs["revision"] for *_, kwargs in hub_stub[before:]} == {new}
    fresh = runner.prepare_run_dir(exp, tmp_path / "fresh")
    assert json.loads((fresh / "config.json").read_text())["inputs"]["questions math"]["commit"] == new
    assert hub_stub[-1][3] == {"revision": new}


def test_hub_flags_reach_load_hub_and_the_datasets_loader(monkeypatch, hub_stub):
    """--hub-id / --hub-split / --hub-config / --hub-revision, per dataset, become load_hub's
    arguments and then `datasets.load_dataset`'s (a stub here: no hub offline); a dataset not named
    keeps load_hub's defaults. Validating the run reads them once."""
    loaded = hub_stub
    exp = hub_experiment("--datasets", "math", "mmlu_pro", "--hub-id", "math=HuggingFaceH4/MATH-500",
                         "--hub-split", "mmlu_pro=validation", "--hub-revision", "math=abc123",
                         "mmlu_pro=refs/convert/parquet", "--hub-config", "math=default")  # fmt: skip
    for dataset in exp.datasets:
        assert runner.read_questions(exp.live, dataset, None)  # the sample's rows, mapped and kept
    assert loaded == [("HuggingFaceH4/MATH-500", "default", "test", {"revision": "abc123"}),
                      ("TIGER-Lab/MMLU-Pro", None, "validation", {"revision": "refs/convert/parquet"})]  # fmt: skip

    calls = []
    monkeypatch.setattr(data, "load_hub", lambda dataset, **kwargs: calls.append((dataset, kwargs)) or [])
    exp = hub_experiment("--datasets", "bbh", "math", "mmlu_pro", "--hub-id", "mmlu_pro=me/mmlu-pro-mirror")
    for dataset in exp.datasets:
        exp.live.questions(dataset, None)
    expected = {"bbh": ("lukaemon/bbh", "test"), "math": ("EleutherAI/hendrycks_math", "test"),
                "mmlu_pro": ("me/mmlu-pro-mirror", "test")}  # fmt: skip
    for dataset, kwargs in calls:
        assert (kwargs["hub_id"], kwargs["split"]) == expected[dataset]
        assert kwargs["config"] is None and kwargs["revision"] is None
    assert {dataset: data.DEFAULT_HUB_IDS[dataset] for dataset in ("bbh", "math")} == {
        dataset: expected[dataset][0] for dataset in ("bbh", "math")
    }  # the defaults are load_hub's own
    # every experiment with --data takes them (CommonFlags): recovery, too
    exp = hub_experiment("--dataset", "math", "--hub-id", "math=HuggingFaceH4/MATH-500", command=recovery)
    assert exp.live.hub_source("math").hub_id == "HuggingFaceH4/MATH-500"


def test_hub_sources_are_recorded_and_a_resume_with_others_is_refused(tmp_path, hub_stub):
    out = tmp_path / "run"
    exp = hub_experiment("--datasets", "math", "mmlu_pro", "--hub-id", "math=HuggingFaceH4/MATH-500",
                         "--hub-revision", "math=abc123")  # fmt: skip
    runner.prepare_run_dir(exp, out)
    recorded = json.loads((out / "config.json").read_text())["experiment"]["live"]
    assert recorded["hub"] == {
        "math": {"hub_id": "HuggingFaceH4/MATH-500", "split": "test", "config": None, "revision": "abc123"},
        "mmlu_pro": {"hub_id": "TIGER-Lab/MMLU-Pro", "split": "test", "config": None, "revision": None},
    }  # the defaults are recorded too: what the run read
    assert recorded["reasoning_effort"] == "medium"
    # config.json's form reads back (report.py rebuilds the experiment from it)
    back = report.experiment_from_config(json.loads((out / "config.json").read_text())["experiment"])
    assert json.loads(json.dumps(back.to_json())) == json.loads(json.dumps(exp.to_json()))
    same = hub_experiment("--datasets", "math", "mmlu_pro", "--hub-id", "math=HuggingFaceH4/MATH-500",
                          "mmlu_pro=TIGER-Lab/MMLU-Pro", "--hub-revision", "math=abc123",
                          "--hub-split", "mmlu_pro=test")  # the defaults, named: the same run  # fmt: skip
    assert runner.prepare_run_dir(same, out) == out
    for args, changed in (
        (("--hub-id", "math=EleutherAI/hendrycks_math", "--hub-revision", "math=abc123"), "live.hub.math.hub_id"),
        (("--hub-id", "math=HuggingFaceH4/MATH-500"), "live.hub.math.revision"),
        (("--hub-id", "math=HuggingFaceH4/MATH-500", "--hub-revision", "math=abc123",
          "--hub-split", "mmlu_pro=validation"), "live.hub.mmlu_pro.split"),
        (("--hub-id", "math=HuggingFaceH4/MATH-500", "--hub-revision", "math=abc123",
          "--reasoning-effort", "high"), "live.reasoning_effort"),
    ):  # fmt: skip
        with pytest.raises(MeshHealError, match=rf"different configuration \({changed} differ\)"):
            runner.prepare_run_dir(hub_experiment("--datasets", "math", "mmlu_pro", *args), out)


def test_a_live_folder_from_before_the_effort_and_hub_were_recorded_resumes(tmp_path, hub_stub):
    """Such a folder ran with the defaults (medium, load_hub's ids): the same run, resumable."""
    out = tmp_path / "run"
    exp = hub_experiment("--datasets", "math")
    runner.prepare_run_dir(exp, out)
    config = json.loads((out / "config.json").read_text())
    for key in ("hub", "reasoning_effort"):
        del config["experiment"]["live"][key]
    (out / "config.json").write_text(json.dumps(config))
    assert runner.prepare_run_dir(exp, out) == out
    with pytest.raises(MeshHealError, match=r"live\.hub\.math\.hub_id differ"):
        runner.prepare_run_dir(hub_experiment("--datasets", "math", "--hub-id", "math=x/math-mirror"), out)


def test_live_config_file_keys_and_flags_merge_per_dataset(tmp_path):
    path = tmp_path / "live.toml"
    path.write_text('strong_url = "http://a/v1"\nweak_url = "http://b/v1"\nreasoning_effort = "low"\n'
                    'hub_split = ["math=train"]\n[hub_id]\nmath = "HuggingFaceH4/MATH-500"\n'
                    'mmlu_pro = "me/mmlu-pro-mirror"\n')  # fmt: skip
    settings = live_settings(tyro.cli(main.MainConfig, args=["--live-config", str(path)]))
    assert settings.reasoning_effort == "low"
    assert settings.hub_source("math") == runner.HubSource("math", "HuggingFaceH4/MATH-500", "train")
    assert settings.hub_source("mmlu_pro").hub_id == "me/mmlu-pro-mirror"
    settings = live_settings(tyro.cli(main.MainConfig, args=["--live-config", str(path), "--reasoning-effort",
                                                             "high", "--hub-id", "math=EleutherAI/hendrycks_math"]))  # fmt: skip
    assert settings.reasoning_effort == "high"  # the flag wins
    assert settings.hub_source("math") == runner.HubSource("math", "EleutherAI/hendrycks_math", "train")
    assert settings.hub_source("mmlu_pro").hub_id == "me/mmlu-pro-mirror"  # the file's other dataset stays


BAD_LIVE_VALUES = {
    "effort": (
        ["--reasoning-effort", "extreme"],
        "--reasoning-effort (reasoning_effort) must be one of low, medium, high, got 'extreme'",
    ),
    "effort case": (["--reasoning-effort", "HIGH"], "--reasoning-effort (reasoning_effort) must be one of"),
    "hub id without dataset": (["--hub-id", "HuggingFaceH4/MATH-500"], "--hub-id takes DATASET=ID"),
    "hub split of no dataset": (["--hub-split", "nosuch=test"], "--hub-split: unknown dataset 'nosuch'"),
    "empty revision": (["--hub-revision", "math="], "--hub-revision: math's REVISION must be non-empty"),
    "one dataset twice": (["--hub-id", "math=a/b", "math=c/d"], "--hub-id names math twice"),
    "bbh config": (["--datasets", "bbh", "--hub-config", "bbh=navigate"], "--hub-config bbh=navigate"),
    "hub flags without hub data": (["--data", "sample", "--hub-id", "math=a/b"], "apply to --data hub"),
    "file effort": (['reasoning_effort = "max"'], "--reasoning-effort (reasoning_effort) must be one of"),
    "file effort type": (["reasoning_effort = 3"], "reasoning_effort must be a string, got 3"),
    "file hub dataset": (['hub_id = {mat = "a/b"}'], "hub_id: unknown dataset 'mat'"),
    "file hub value": (["[hub_revision]\nmath = 3"], "hub_revision: math's REVISION must be non-empty text"),
}


@pytest.mark.parametrize("case", sorted(BAD_LIVE_VALUES))
def test_bad_effort_and_hub_values_exit_2_with_one_line(case, tmp_path, capsys, monkeypatch):
    args, fragment = BAD_LIVE_VALUES[case]
    if case.startswith("file"):
        path = tmp_path / "live.toml"
        path.write_text("\n".join(args) + "\n")
        args = ["--live-config", str(path)]
        fragment = f"--live-config {path}: {fragment}" if "must be one of" not in fragment else fragment
    out = tmp_path / "out"
    datasets = [] if "--datasets" in args else ["--datasets", "math"]
    argv = [*HUB_ARGS, "--tasks", "84", *datasets, *args, "--quiet", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", ["meshheal_jax.main", *argv])
    with pytest.raises(SystemExit) as exit_:
        main.cli()
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], lines
    assert not out.exists()
