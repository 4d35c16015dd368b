"""What the shared CLI plumbing (meshheal_jax/cli.py) and the figures (meshheal_jax/plots.py)
promise that no other test held (a mutation audit of both modules).

cli: guarded's exits (a MeshHealError: one `error:` line, status 2, in this process and from a
thread where no signal handler can be set; the project's warnings one line each, others as Python
prints them; the command's own stop line; a dropped exception that is not a stop reaches the hook
that was there), the protocol checks run after the parser at any depth, the seed and run options,
--live-config's one-line refusals (not TOML, unknown keys, booleans and texts where numbers go),
URLs split at commas, the hub sources in DATASETS order, a tokenizer that is not a path kept as
given, the emulated-run refusal naming every live setting, and the table helpers (fmt, fmt_range,
new_table, print_table).

plots: every figure is one PNG at the path given, returned as a Path, its folder made, and drawn
without pyplot; refused input writes nothing; empty frames, missing optional keys, nulls and NaN
draw; and what each docstring says a figure shows, read from the figure's artists (not its
pixels): the trajectory's panels, titles, markers, jitter, shading, peer band, rolling line and
state strip; the phase bars' means and sample stds over seeds, the within-seed mean over datasets,
the labels; the scaling plot's fractions, aliases, panels and axis. A few seconds; no run, no JAX.
"""

from __future__ import annotations

import dataclasses
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import numpy as np
import polars as pl
import pytest
import tyro
from matplotlib.colors import to_rgba

from meshheal_jax import cli, metrics
from meshheal_jax.config import CHECKPOINT_EVERY_S, ProtocolParams
from meshheal_jax.errors import MeshHealError
from meshheal_jax.runner import HubSource

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def main_flags(*args: str):
    from meshheal_jax import main

    return tyro.cli(main.MainConfig, args=list(args))


def exits(main, stopped: str | None = None) -> int:
    """guarded(main)'s exit status (SystemExit's code)."""
    with pytest.raises(SystemExit) as ended:
        cli.guarded(main) if stopped is None else cli.guarded(main, stopped)
    return ended.value.code


def raising(err: BaseException):
    def main() -> None:
        raise err

    return main


@pytest.fixture(autouse=True)
def _restore_formatwarning(monkeypatch):
    """guarded sets warnings.formatwarning for the command's life; put it back after each test."""
    import warnings

    monkeypatch.setattr(warnings, "formatwarning", warnings.formatwarning)


# ----------------------------------------------------------------------------------------------
# guarded: exits, warnings, stops, dropped exceptions
# ----------------------------------------------------------------------------------------------


def test_bad_input_is_one_error_line_and_status_2(capsys):
    assert exits(raising(MeshHealError("--seeds must be >= 1, got 0"))) == 2
    captured = capsys.readouterr()
    assert captured.err == "error: --seeds must be >= 1, got 0\n" and captured.out == ""


def test_a_command_that_returns_exits_nowhere_and_leaves_the_hooks_as_they_were(monkeypatch):
    seen: list = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    hook, handler = sys.unraisablehook, signal.getsignal(signal.SIGTERM)
    during = []
    assert cli.guarded(lambda: during.append((sys.unraisablehook, signal.getsignal(signal.SIGTERM)))) is None
    assert during == [(cli._stop_dropped, cli._terminate)]
    assert sys.unraisablehook == hook and signal.getsignal(signal.SIGTERM) is handler


def test_an_exception_dropped_in_a_finaliser_that_is_not_a_stop_reaches_the_earlier_hook(monkeypatch):
    """_stop_dropped re-sends only a Ctrl-C or SIGTERM; anything else goes to the hook that was there."""
    seen: list = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)

    class Finalised:
        def __del__(self):
            raise ValueError("raised in a finaliser")

    def main() -> None:
        Finalised()  # collected at once: its exception is dropped, "Exception ignored in"

    cli.guarded(main)
    assert [(type(u.exc_value), str(u.exc_value)) for u in seen] == [(ValueError, "raised in a finaliser")]


def test_a_command_run_off_the_main_thread_exits_the_same_and_sets_no_handler(capsys):
    """Signal handlers can be set only in the main thread: guarded run from another leaves them."""
    before = signal.getsignal(signal.SIGTERM)
    codes: list = []

    def worker() -> None:
        try:
            cli.guarded(raising(MeshHealError("bad input")))
        except SystemExit as ended:
            codes.append(ended.code)

    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(10)
    assert codes == [2] and capsys.readouterr().err == "error: bad input\n"
    assert signal.getsignal(signal.SIGTERM) is before


@pytest.mark.parametrize("err, status", [(KeyboardInterrupt(), 130), (cli.Terminated(), 143)])
def test_a_stop_prints_the_commands_own_line(err, status, capsys):
    """report's `stopped`, not the experiments' line about run folders."""
    assert exits(raising(err), "stopped") == status
    assert capsys.readouterr().err == "stopped\n"


def test_warnings_print_one_line_each_and_errors_one_line_in_a_real_process():
    script = textwrap.dedent(
        """
        import warnings
        from meshheal_jax import cli
        from meshheal_jax.errors import MeshHealError, MeshHealWarning

        def main():
            warnings.warn("the project's own", MeshHealWarning)
            warnings.warn("someone else's", UserWarning)
            print("a table")
            raise MeshHealError("named precisely")

        cli.guarded(main)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False,
        env=dict(os.environ, PYTHONWARNINGS="default"),
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == "a table\n"
    lines = proc.stderr.splitlines()
    assert lines[0] == "warning: the project's own"
    assert lines[1].endswith("UserWarning: someone else's")  # Python's own format: file:line: Category
    assert lines[-1] == "error: named precisely" and len(lines) == 3


# ----------------------------------------------------------------------------------------------
# parse_flags and the common flags
# ----------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Inner:
    protocol: ProtocolParams = dataclasses.field(default_factory=ProtocolParams)


@dataclasses.dataclass(frozen=True)
class _Outer:
    inner: _Inner = dataclasses.field(default_factory=_Inner)


def test_protocol_checks_run_after_the_parser_at_any_depth(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["command", "--inner.protocol.alpha", "3"])
    with pytest.raises(MeshHealError, match=r"need 0 < alpha <= beta, got alpha=3\.0, beta=2\.0"):
        cli.parse_flags(_Outer, "a command")
    monkeypatch.setattr(sys, "argv", ["command", "--inner.protocol.alpha", "1.5"])
    assert cli.parse_flags(_Outer, "a command").inner.protocol.alpha == 1.5


def test_a_bad_protocol_flag_through_entrypoint_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["command", "--inner.protocol.move-limit", "0"])
    ran = []
    with pytest.raises(SystemExit) as ended:
        cli.entrypoint(_Outer, ran.append, "a command")
    assert ended.value.code == 2 and ran == []
    assert capsys.readouterr().err == "error: protocol parameter move_limit must be >= 1, got 0\n"


def test_seeds_and_run_options_from_the_flags():
    assert main_flags().seed_tuple() == (0, 1, 2, 3, 4)
    assert main_flags("--seeds", "2").seed_tuple() == (0, 1)
    assert main_flags("--seeds", "0", "--seed-list", "7", "3").seed_tuple() == (7, 3)  # the list wins
    assert main_flags("--seed-list").seed_tuple() == ()  # given empty: Experiment.validate refuses it
    for bad in ("0", "-2"):
        with pytest.raises(MeshHealError, match=rf"^--seeds must be >= 1, got {bad}$"):
            main_flags("--seeds", bad).seed_tuple()
    assert main_flags().run_options() == {"lanes": None, "checkpoint_every": CHECKPOINT_EVERY_S}
    assert main_flags("--lanes", "3", "--checkpoint-every", "0").run_options() == {
        "lanes": 3, "checkpoint_every": 0.0,
    }  # fmt: skip


def test_a_value_outside_a_flags_choices_is_the_parsers_status_2():
    with pytest.raises(SystemExit) as ended:
        main_flags("--engine", "fast")
    assert ended.value.code == 2


# ----------------------------------------------------------------------------------------------
# --live-config and the live flags
# ----------------------------------------------------------------------------------------------


def live(tmp_path: Path, text: str | None, *args: str):
    if text is None:
        return cli.live_settings(main_flags(*args))
    path = tmp_path / "live.toml"
    path.write_text(text)
    return cli.live_settings(main_flags("--live-config", str(path), *args))


def test_a_live_config_that_is_not_toml_or_not_there_is_one_line(tmp_path):
    path = tmp_path / "live.toml"
    path.write_text("strong_url http://a/v1\n")
    with pytest.raises(MeshHealError) as err:
        cli.live_settings(main_flags("--live-config", str(path)))
    message = str(err.value)
    assert message.startswith(f"--live-config {path} is not valid TOML: ") and "\n" not in message
    with pytest.raises(MeshHealError, match=r"^cannot read --live-config .*nowhere\.toml: No such file"):
        cli.live_settings(main_flags("--live-config", str(tmp_path / "nowhere.toml")))


def test_a_live_config_key_unknown_is_named_with_the_known_ones(tmp_path):
    with pytest.raises(MeshHealError) as err:
        live(tmp_path, 'strong_urls = ["x"]\nweight = 2\n')
    assert str(err.value) == (
        f"--live-config {tmp_path / 'live.toml'}: unknown keys ['strong_urls', 'weight']; known: {list(cli.LIVE_KEYS)}"
    )


@pytest.mark.parametrize(
    "text, message",
    [("max_tokens = true\n", "max_tokens must be an integer, got True"),
     ("max_in_flight = 2.0\n", "max_in_flight must be an integer, got 2.0"),
     ("weak_max_in_flight = false\n", "weak_max_in_flight must be an integer, got False"),
     ("request_timeout_s = true\n", "request_timeout_s must be a number of seconds, got True"),
     ('request_timeout_s = "60"\n', "request_timeout_s must be a number of seconds, got '60'"),
     ("data = 3\n", "data must be a string, got 3"),
     ("tokenizer = 1\n", "tokenizer must be a string, got 1"),
     ('weak_url = ["http://a/v1", 2]\n', "weak_url must be a URL or a list of URLs, got ['http://a/v1', 2]"),
     ("[hub_id]\nmath = 3\n", "hub_id: math's ID must be non-empty text, got 3"),
     ('hub_split = ["math:test"]\n', "hub_split takes DATASET=SPLIT, e.g. math=..., got 'math:test'"),
     ('hub_revision = ["math=abc", 3]\n', "hub_revision takes DATASET=REVISION (one or more), got ['math=abc', 3]")],
)  # fmt: skip
def test_a_live_config_value_of_the_wrong_type_is_named(text, message, tmp_path):
    with pytest.raises(MeshHealError) as err:
        live(tmp_path, text)
    assert str(err.value) == f"--live-config {tmp_path / 'live.toml'}: {message}"


def test_live_flags_alone_are_named_live_settings_in_messages():
    with pytest.raises(MeshHealError, match=r"^live settings: strong_model must be a string"):
        cli._settings({"strong_model": 5}, main_flags())


def test_urls_split_at_commas_and_blanks_are_dropped(tmp_path):
    settings = live(None, None, "--strong-url", "http://a/v1, http://b/v1,", "http://c/v1", "--weak-url", " ")
    assert settings.strong_urls == ("http://a/v1", "http://b/v1", "http://c/v1") and settings.weak_urls == ()
    settings = live(tmp_path, 'strong_url = "http://a/v1,http://b/v1"\nweak_url = ["http://c/v1"]\n')
    assert settings.strong_urls == ("http://a/v1", "http://b/v1") and settings.weak_urls == ("http://c/v1",)
    assert (settings.max_in_flight, settings.request_timeout_s, settings.data) == (256, 900.0, "hub")


def test_the_files_urls_and_models_give_way_to_the_flags(tmp_path):
    settings = live(tmp_path, 'strong_url = ["http://a/v1"]\nstrong_model = "file-model"\n',
                    "--strong-url", "http://z/v1", "--strong-model", "flag-model")  # fmt: skip
    assert settings.strong_urls == ("http://z/v1",) and settings.strong_model == "flag-model"


def test_hub_settings_are_per_dataset_and_kept_in_the_datasets_order(tmp_path):
    settings = live(tmp_path, 'hub_split = "mmlu_pro=validation"\n',
                    "--hub-revision", " math = abc123 ", "--hub-id", "bbh=me/bbh")  # fmt: skip
    assert settings.hub == (HubSource("bbh", hub_id="me/bbh"), HubSource("math", revision="abc123"),
                            HubSource("mmlu_pro", split="validation"))  # fmt: skip
    assert cli.per_dataset(["math=a=b"], "--hub-id", "ID") == {"math": "a=b"}  # split at the first '='
    with pytest.raises(MeshHealError, match=r"^--hub-id takes DATASET=ID \(one or more\), got 5$"):
        cli.per_dataset(5, "--hub-id", "ID")


def test_a_tokenizer_that_is_not_a_path_here_is_kept_as_given(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    flags = main_flags("--data", "sample", "--tokenizer", "openai/gpt-oss-120b")
    assert cli.backend_fields(flags)["live"].tokenizer == "openai/gpt-oss-120b"


def test_an_emulated_run_names_every_live_setting_it_was_given():
    flags = main_flags("--weak-url", "http://b/v1", "--max-tokens", "64", "--strong-model", "m")
    with pytest.raises(MeshHealError) as err:
        cli.backend_fields(flags)
    assert str(err.value) == (
        "live server settings were given (max_tokens, strong_model, weak_url) but the backend is emulated: "
        "add --backend live (an emulated run takes only --data, --hub-* and --tokenizer)"
    )
    assert cli.backend_fields(main_flags("--backend", "live")) == {"backend": "live", "live": None}


# ----------------------------------------------------------------------------------------------
# Printed tables
# ----------------------------------------------------------------------------------------------


def test_fmt_is_mean_and_std_with_digits_and_scale():
    assert cli.fmt({"mean": 0.5, "std": 0.25}) == "0.500 ± 0.250"
    assert cli.fmt({"mean": 1234.5, "std": None}, 1, 0.001) == "1.2"  # no std: no ±
    assert cli.fmt({"mean": 0.0, "std": 0.0}, 2) == "0.00 ± 0.00"  # zero is a value
    assert cli.fmt({"mean": 2.0, "std": 0.5}, 0, 10.0) == "20 ± 5"
    for undefined in (None, {}, {"mean": None, "std": None}):
        assert cli.fmt(undefined) == "—"


def test_fmt_range_adds_the_range_and_the_defined_count():
    assert cli.fmt_range(metrics.stat([3.0, 7.0, None])) == "5.0 ± 2.8 (3–7) n=2"
    assert cli.fmt_range({"mean": 4.0, "std": None, "min": 4.0, "max": 4.0}, 2) == "4.00 (4–4)"
    assert cli.fmt_range(metrics.stat([None])) == "never" and cli.fmt_range(None) == "never"


def test_tables_put_label_columns_left_and_numbers_right(capsys):
    table = cli.new_table("Title", "dataset", "method", "phase", "agent", "acc H", "calls")
    assert table.title == "Title" and table.title_justify == "left"
    assert [c.justify for c in table.columns] == ["left"] * 4 + ["right"] * 2
    wide = cli.new_table("Wide", "dataset", "value")
    wide.add_row("x" * 120, "1.000")
    cli.print_table(wide)
    out = capsys.readouterr().out
    assert any("x" * 120 in line and "1.000" in line for line in out.splitlines())  # 200 columns, not 80


# ----------------------------------------------------------------------------------------------
# plots: one PNG at the path, no pyplot
# ----------------------------------------------------------------------------------------------

L = {"method": "meshheal", "dataset": "math", "pair": "default"}
N_TASKS = 40


def assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC and data[12:16] == b"IHDR"
    assert int.from_bytes(data[16:20], "big") > 300 and int.from_bytes(data[20:24], "big") > 300


@pytest.fixture
def drawn(monkeypatch) -> list:
    """The figures the plots draw, kept instead of written (the PNG tests write theirs)."""
    from meshheal_jax import plots

    figures: list = []
    monkeypatch.setattr(plots, "_save", lambda fig, path: figures.append(fig) or Path(path))
    return figures


def schedule():
    from meshheal_jax.streams import HealthSchedule

    return HealthSchedule(6, N_TASKS, ((1, 11, 31), (4, 21, N_TASKS + 1)))


def phase_of(t: int) -> int:
    return 0 if t <= 10 else 1 if t <= 30 else 2


def task_rows(seeds=(0, 1), **labels) -> list[dict]:
    return [{**L, **labels, "seed": s, "t": t, "phase": phase_of(t), "correct": t % 2 == 0}
            for s in seeds for t in range(1, N_TASKS + 1)]  # fmt: skip


def review(
    seed: int,
    t: int,
    author: int,
    q: float,
    state: str = "normal",
    probe: bool = False,
    before: str = "normal",
    **labels,
) -> dict:
    return {**L, **labels, "seed": seed, "t": t, "visit": 0, "author": author, "q": q, "probe": probe,
            "state_before": before, "state_after": state}  # fmt: skip


def trajectory_frames():
    """Seed 0: agent 1 (degraded 11–30) has four outputs, the last a probe when isolated; its
    healthy peers 0 and 3 score every 4 tasks from task 2, 2 and 5 from task 4, a q of agent/10
    (agent 5: 0.5 up to task 20, then 0.1); agent 4 (degraded from 21 to the end) scores 0.9 at
    task 1 and 0.1 at task 40 (a 39-task gap). Seed 1: agent 1 scores 40 times, which seed 0's
    figure must not count."""
    rows = [review(0, 2, 1, 1.0), review(0, 5, 1, 0.75), review(0, 12, 1, 0.25, "watched"),
            review(0, 15, 1, 0.0, "isolated", probe=True, before="watched")]  # fmt: skip
    rows += [review(0, t, peer, 0.1 if peer == 5 and t > 20 else peer / 10)
             for peer in (0, 2, 3, 5) for t in range(2 + peer % 3, N_TASKS + 1, 4)]  # fmt: skip
    rows += [review(0, 1, 4, 0.9), review(0, 40, 4, 0.1)]
    rows += [review(1, t, 1, 0.5) for t in range(1, N_TASKS + 1)]
    changes = [(12, "normal", "watched"), (15, "watched", "isolated"), (35, "isolated", "normal")]
    states = [{**L, "seed": 0, "t": t, "agent": 1, "from": a, "to": b} for t, a, b in changes]
    return (
        metrics.frame("reviews", rows),
        metrics.frame("states", states),
        metrics.frame("tasks", task_rows()),
    )


def test_every_figure_is_one_png_at_the_path_given_drawn_without_pyplot_or_a_display(tmp_path):
    """Each function writes one PNG at the path (a str is fine), making its folder, and returns the
    path as a Path; matplotlib's Agg canvas, never pyplot: no backend or display is consulted."""
    script = textwrap.dedent(
        f"""
        import sys
        from pathlib import Path
        from meshheal_jax import plots, metrics
        from meshheal_jax.streams import HealthSchedule
        root = Path({str(tmp_path)!r})
        tasks = metrics.frame("tasks", [dict(method="m", dataset="d", pair="p", seed=0, t=t, phase=t // 7,
                                             correct=t % 2 == 0) for t in range(1, 15)])
        made = [plots.phase_accuracy_bars(tasks, str(root / "a" / "p.png")),
                plots.scaling_plot([dict(n_agents=6, topology="sparse", acc_h=0.5)], str(root / "b" / "c" / "s.png")),
                plots.recovery_trajectory(metrics.frame("reviews", []), metrics.frame("states", []), tasks,
                                          HealthSchedule(6, 14, ((0, 8, 15),)), 0, str(root / "d" / "t.png"))]
        print([(isinstance(p, Path), str(p.relative_to(root))) for p in made])
        print(sorted(m for m in sys.modules if m in ("matplotlib.pyplot", "tkinter")))
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("DISPLAY", "WAYLAND_DISPLAY")}
    env["MPLBACKEND"] = "module://no_such_backend"  # pyplot would have to load it, and fail
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          check=False, env=env)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    made, loaded = proc.stdout.strip().splitlines()
    assert made == "[(True, 'a/p.png'), (True, 'b/c/s.png'), (True, 'd/t.png')]"
    assert loaded == "[]"
    for folder, name in (("a", "p.png"), ("b/c", "s.png"), ("d", "t.png")):
        assert [p.name for p in (tmp_path / folder).iterdir()] == [name]  # one file, nothing beside it
        assert_png(tmp_path / folder / name)


def test_refused_input_writes_nothing(tmp_path):
    from meshheal_jax import plots
    from meshheal_jax.streams import HealthSchedule

    reviews, states, tasks = trajectory_frames()
    out = tmp_path / "out" / "x.png"
    refusals = [
        (lambda: plots.phase_accuracy_bars(tasks.clear(), out), r"^no tasks to plot$"),
        (lambda: plots.scaling_plot([], out), r"^no scaling entries to plot$"),
        (lambda: plots.scaling_plot([{"topology": "sparse", "acc_h": 1}], out),
         r"^a scaling entry needs n_agents and topology, got keys \['acc_h', 'topology'\]$"),
        (lambda: plots.recovery_trajectory(reviews, states, tasks, HealthSchedule(6, N_TASKS, ()), 0, out),
         r"^the health schedule degrades no agent: no trajectory to draw$"),
        (lambda: plots.recovery_trajectory(reviews, states, tasks, schedule(), 5, out),
         r"^no tasks for seed 5$"),  # no label picked or found: none named
        (lambda: plots.recovery_trajectory(reviews, states, tasks, schedule(), 0, out, dataset="bbh"),
         r"^no tasks for seed 0 \(dataset=bbh, pair=default, method=meshheal\)$"),
    ]  # fmt: skip
    for draw, message in refusals:
        with pytest.raises(MeshHealError, match=message):
            draw()
    assert not (tmp_path / "out").exists()


# ----------------------------------------------------------------------------------------------
# recovery_trajectory
# ----------------------------------------------------------------------------------------------


def scatter_points(ax) -> dict[int, tuple[float, bool, tuple]]:
    """t -> (plotted q, hollow, colour) of the markers in a panel."""
    points = {}
    for coll in ax.collections:
        if type(coll).__name__ != "PathCollection":
            continue
        faces, edges = coll.get_facecolors(), coll.get_edgecolors()
        for k, (t, q) in enumerate(coll.get_offsets()):
            hollow = len(faces) == 0 or faces[k % len(faces)][3] == 0
            colour = tuple(edges[k % len(edges)] if hollow else faces[k % len(faces)])
            points[int(t)] = (float(q), hollow, colour[:3])
    return points


def rgb(name: str) -> tuple:
    return to_rgba(name)[:3]


def test_a_trajectory_draws_one_panel_per_degraded_agent_of_the_seed_picked(drawn, tmp_path):
    from meshheal_jax import plots

    reviews, states, tasks = trajectory_frames()
    plots.recovery_trajectory(reviews, states, tasks, schedule(), 0, tmp_path / "t.png",
                              phase_names=("healthy", "degraded", "recovery"))  # fmt: skip
    (fig,) = drawn
    panel1, strip1, panel4, strip4 = fig.axes  # a panel and a state strip per degraded agent, in order
    assert panel1.get_title(loc="left") == (
        "A2 (agent 1): degraded in tasks 11–30; 4 reviewed outputs (1 probes); isolated at the end of 20 of 40 tasks"
    )
    assert panel4.get_title(loc="left") == (
        "A5 (agent 4): degraded in tasks 21–40 (end); 2 reviewed outputs (0 probes); isolated at the end of 0 of 40 tasks"
    )
    assert (
        fig._suptitle.get_text()
        == "Recovery trajectory, seed 0 (dataset math, pair default, method meshheal)"
    )
    # the schedule's degraded tasks shaded, in the panel and its strip
    for ax, (begin, end) in ((panel1, (11, 31)), (strip1, (11, 31)), (panel4, (21, 41)), (strip4, (21, 41))):
        (shade,) = ax.patches
        assert (shade.get_x(), shade.get_x() + shade.get_width()) == (begin - 0.5, end - 0.5)
        dotted = sorted(line.get_xdata()[0] for line in ax.lines if line.get_linestyle() == ":")
        assert dotted == [10.5, 30.5]  # phase starts after the first
    assert [t.get_text() for t in panel1.texts] == ["healthy", "degraded", "recovery"]


def test_trajectory_markers_are_coloured_by_state_after_probes_hollow_and_jittered(drawn, tmp_path):
    from meshheal_jax import plots

    reviews, states, tasks = trajectory_frames()
    plots.recovery_trajectory(reviews, states, tasks, schedule(), 0, tmp_path / "t.png")
    points = scatter_points(drawn[0].axes[0])
    assert sorted(points) == [2, 5, 12, 15]  # agent 1's, seed 0's only
    colours = plots.STATE_COLORS
    expected = {2: (1.0, False, "normal"), 5: (0.75, False, "normal"), 12: (0.25, False, "watched"),
                15: (0.0, True, "isolated")}  # fmt: skip
    for t, (q, hollow, state) in expected.items():
        plotted, is_hollow, colour = points[t]
        assert is_hollow == hollow and np.allclose(colour, rgb(colours[state]))
        assert abs(plotted - q) <= plots.SCORE_JITTER
    assert len({round(points[t][0] - expected[t][0], 9) for t in points}) > 1  # jittered, not shifted


def test_the_state_strip_is_the_state_at_the_end_of_every_task(drawn, tmp_path):
    from meshheal_jax import plots

    reviews, states, tasks = trajectory_frames()
    plots.recovery_trajectory(reviews, states, tasks, schedule(), 0, tmp_path / "t.png")
    runs = []
    for coll in drawn[0].axes[1].collections:
        (path,) = coll.get_paths()
        xs = path.vertices[:, 0]
        runs.append((xs.min(), xs.max(), coll.get_facecolor()[0][:3]))
    colours = {s: rgb(c) for s, c in plots.STATE_COLORS.items()}
    expected = [
        (0.5, 11.5, "normal"),
        (11.5, 14.5, "watched"),
        (14.5, 34.5, "isolated"),
        (34.5, 40.5, "normal"),
    ]
    assert len(runs) == len(expected)
    for (lo, hi, colour), (e_lo, e_hi, state) in zip(sorted(runs), expected):
        assert (lo, hi) == (e_lo, e_hi) and np.allclose(colour, colours[state])


def test_the_peer_band_is_the_healthy_peers_quartiles_and_the_rolling_line_breaks_at_gaps(drawn, tmp_path):
    from meshheal_jax import plots

    reviews, states, tasks = trajectory_frames()
    plots.recovery_trajectory(reviews, states, tasks, schedule(), 0, tmp_path / "t.png", window=2)
    panel1, _, panel4, _ = drawn[0].axes
    band = [line for line in panel1.lines if line.get_color() == plots.PEER_BAND]
    low, high = (np.asarray(line.get_ydata(), dtype=float) for line in band)
    # each peer's rolling mean q over its last 2 outputs up to task t, agent 4's only while it is
    # healthy (before task 21): at task 1 agent 4 alone (one peer: no band), at task 2 with 0 and 3
    peers = {2: [0.9, 0.0, 0.3], 5: [0.9, 0.0, 0.2, 0.3, 0.5], 20: [0.9, 0.0, 0.2, 0.3, 0.5],
             21: [0.0, 0.2, 0.3, 0.5], 39: [0.0, 0.2, 0.3, 0.1]}  # fmt: skip
    for t, values in peers.items():
        assert (low[t - 1], high[t - 1]) == pytest.approx(tuple(np.percentile(values, [25, 75])))
    assert math.isnan(low[0]) and math.isnan(high[0])
    rolling = next(line for line in panel1.lines if line.get_color() == "black")
    assert list(rolling.get_xdata()) == [2, 5, 12, 15, 40]  # held MAX_GAP tasks after the last output
    assert np.allclose(rolling.get_ydata(), [1.0, 0.875, 0.5, 0.125, 0.125])  # the last 2 outputs' mean
    gap = next(line for line in panel4.lines if line.get_color() == "black")
    assert list(gap.get_xdata()) == [1, 31, 31, 40, 40]  # no output for 39 tasks: broken after MAX_GAP
    y = np.asarray(gap.get_ydata(), dtype=float)
    assert np.allclose(y[[0, 1, 3, 4]], [0.9, 0.9, 0.5, 0.5]) and math.isnan(y[2])


def test_a_trajectory_picks_a_label_or_refuses_several(drawn, tmp_path):
    from meshheal_jax import plots

    reviews, states, tasks = trajectory_frames()
    others = metrics.frame("tasks", task_rows(method="raps"))
    extra = metrics.frame("reviews", [review(0, t, 1, 0.5, method="raps") for t in range(1, 30)])
    tasks, reviews = pl.concat([tasks, others]), pl.concat([reviews, extra])
    with pytest.raises(MeshHealError) as err:
        plots.recovery_trajectory(reviews, states, tasks, schedule(), 0, tmp_path / "t.png")
    assert (
        str(err.value) == "the frames hold several methods ['meshheal', 'raps']; pass method=... to pick one"
    )
    plots.recovery_trajectory(reviews, states, tasks, schedule(), 0, tmp_path / "t.png", method="meshheal")
    assert "4 reviewed outputs" in drawn[0].axes[0].get_title(loc="left")
    # unique in the seed drawn is enough: here seed 1 alone ran the other method
    tasks = pl.concat(
        [metrics.frame("tasks", task_rows((0,))), metrics.frame("tasks", task_rows((1,), method="raps"))]
    )
    plots.recovery_trajectory(reviews, states, tasks, schedule(), 0, tmp_path / "t.png")
    assert drawn[-1]._suptitle.get_text().endswith("(dataset math, pair default, method meshheal)")
    assert "4 reviewed outputs" in drawn[-1].axes[0].get_title(loc="left")


def test_a_trajectory_draws_empty_frames_and_nan_scores(drawn, tmp_path):
    from meshheal_jax import plots

    _, _, tasks = trajectory_frames()
    path = plots.recovery_trajectory(metrics.frame("reviews", []), metrics.frame("states", []), tasks,
                                     schedule(), 0, tmp_path / "empty.png")  # fmt: skip
    assert path == tmp_path / "empty.png"
    assert (
        drawn[0]
        .axes[0]
        .get_title(loc="left")
        .endswith("0 reviewed outputs (0 probes); isolated at the end of 0 of 40 tasks")
    )
    from meshheal_jax.streams import HealthSchedule

    plots.recovery_trajectory(metrics.frame("reviews", []), metrics.frame("states", []), tasks,
                              HealthSchedule(6, N_TASKS, ((1, 11, N_TASKS),)), 0, tmp_path / "e.png")  # fmt: skip
    assert drawn[-1].axes[0].get_title(loc="left").startswith("A2 (agent 1): degraded in tasks 11–39;")
    nan_q = metrics.frame("reviews", [review(0, t, 1, math.nan if t == 3 else 0.5) for t in range(1, 10)])
    plots.recovery_trajectory(nan_q, metrics.frame("states", []), tasks, schedule(), 0, tmp_path / "nan.png")
    for fig in drawn:
        fig.canvas.draw()  # what savefig renders


# ----------------------------------------------------------------------------------------------
# phase_accuracy_bars
# ----------------------------------------------------------------------------------------------

# per-stream accuracy (of 4 tasks per phase) by (method, dataset, seed): phase 0, phase 1
ACC = {
    ("agentnet", "bbh", 0): (1.0, 0.5), ("agentnet", "bbh", 1): (0.5, 0.5), ("agentnet", "bbh", 2): (0.75, 0.25),
    ("agentnet", "math", 0): (0.5, 0.0), ("agentnet", "math", 1): (0.25, 0.25), ("agentnet", "math", 2): (0.0, 0.5),
    ("meshheal", "bbh", 0): (1.0, 1.0), ("meshheal", "bbh", 1): (0.75, 0.75), ("meshheal", "bbh", 2): (0.5, 1.0),
    ("meshheal", "math", 0): (0.25, 0.75), ("meshheal", "math", 1): (0.75, 0.5),  # no seed 2
    ("agentnet", "mmlu_pro", 0): (0.25, 1.0), ("agentnet", "mmlu_pro", 1): (1.0, 0.75),
    ("agentnet", "mmlu_pro", 2): (0.5, 0.0), ("meshheal", "mmlu_pro", 0): (0.5, 0.25),
    ("meshheal", "mmlu_pro", 1): (0.0, 1.0), ("meshheal", "mmlu_pro", 2): (1.0, 0.5),
}  # fmt: skip
DATASETS = ("bbh", "math", "mmlu_pro")


def bar_tasks(acc=ACC, pair: str = "default") -> pl.DataFrame:
    rows = []
    for (method, dataset, seed), accs in acc.items():
        for phase, a in enumerate(accs):
            for k in range(4):
                rows.append({"method": method, "dataset": dataset, "pair": pair, "seed": seed,
                             "t": 1 + 4 * phase + k, "phase": phase, "correct": k < round(4 * a)})  # fmt: skip
    return metrics.frame("tasks", rows)


def bars_of(ax) -> list[tuple[list[float], list[float] | None]]:
    """Per bar group of a panel: the bar heights and the error bars' half lengths (None: none)."""
    out = []
    for container in ax.containers:
        if type(container).__name__ != "BarContainer":
            continue
        heights = [float(p.get_height()) for p in container.patches]
        errs = None
        if container.errorbar is not None:
            segments = container.errorbar.lines[2][0].get_segments()
            errs = [float(s[1][1] - s[0][1]) / 2 for s in segments]
        out.append((heights, errs))
    return out


def mean_std(values):
    return float(np.mean(values)), float(np.std(values, ddof=1))


def test_phase_bars_are_means_and_sample_stds_over_seeds_with_a_within_seed_mean_panel(drawn, tmp_path):
    from meshheal_jax import plots

    plots.phase_accuracy_bars(bar_tasks(), tmp_path / "bars.png", ("healthy", "degraded"))
    (fig,) = drawn
    panels = fig.axes
    assert [ax.get_title() for ax in panels] == [*DATASETS, "mean over datasets"]
    labels = [t.get_text() for t in fig.legends[0].texts]
    assert labels == ["meshheal", "agentnet"]  # MeshHeal first
    for ax, dataset in zip(panels, DATASETS):
        for (heights, errs), method in zip(bars_of(ax), labels):
            seeds = [s for (m, d, s) in ACC if (m, d) == (method, dataset)]
            for phase in (0, 1):
                mean, std = mean_std([ACC[(method, dataset, s)][phase] for s in seeds])
                assert heights[phase] == pytest.approx(mean) and errs[phase] == pytest.approx(std)
    # the last panel: the mean over datasets within each seed that ran all (MeshHeal: seeds 0 and 1)
    for (heights, errs), method in zip(bars_of(panels[3]), labels):
        seeds = (0, 1) if method == "meshheal" else (0, 1, 2)
        for phase in (0, 1):
            within = [np.mean([ACC[(method, d, s)][phase] for d in DATASETS]) for s in seeds]
            mean, std = mean_std(within)
            assert heights[phase] == pytest.approx(mean) and errs[phase] == pytest.approx(std)
    assert [t.get_text() for t in panels[0].get_xticklabels()] == ["healthy", "degraded"]
    assert fig._suptitle.get_text() == "Accuracy per phase: mean ± sample std over 3 seeds"


def test_phase_bars_of_one_seed_have_no_error_bars_and_name_pairs_and_phases(drawn, tmp_path):
    from meshheal_jax import plots

    one = {key: accs for key, accs in ACC.items() if key[1] == "bbh" and key[2] == 0}
    tasks = pl.concat([bar_tasks(one, "A"), bar_tasks(one, "B")])
    plots.phase_accuracy_bars(tasks, tmp_path / "bars.png", ("healthy",))
    (fig,) = drawn
    (ax,) = fig.axes  # one dataset: no mean panel
    assert [t.get_text() for t in fig.legends[0].texts] == [
        "meshheal (A)", "meshheal (B)", "agentnet (A)", "agentnet (B)",
    ]  # fmt: skip
    assert [errs for _, errs in bars_of(ax)] == [None] * 4
    assert [heights for heights, _ in bars_of(ax)] == [[1.0, 1.0], [1.0, 1.0], [1.0, 0.5], [1.0, 0.5]]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["healthy", "phase 1"]  # unnamed: "phase k"
    assert fig._suptitle.get_text() == "Accuracy per phase: 1 seed (no error bars)"
    two = {key: accs for key, accs in ACC.items() if key[1] != "mmlu_pro" and key[2] == 0}
    plots.phase_accuracy_bars(bar_tasks(two), tmp_path / "two.png")
    assert [ax.get_title() for ax in drawn[-1].axes] == ["bbh", "math", "mean over datasets"]  # from two on


def test_phase_bars_skip_null_outcomes_and_draw_an_all_null_phase_empty(drawn, tmp_path):
    from meshheal_jax import plots

    tasks = bar_tasks({("meshheal", "bbh", 0): (0.5, 0.75)})
    tasks = tasks.with_columns(
        pl.when((pl.col("phase") == 0) | (pl.col("t") == 5))
        .then(None)
        .otherwise(pl.col("correct"))
        .alias("correct")
    )  # phase 0 all null; phase 1 has t 5 (correct) null: 2 of the other 3 correct
    plots.phase_accuracy_bars(tasks, tmp_path / "bars.png")
    drawn[0].canvas.draw()
    ((heights, _),) = bars_of(drawn[0].axes[0])
    assert math.isnan(heights[0]) and heights[1] == pytest.approx(2 / 3)
    assert [t.get_text() for t in drawn[0].axes[0].texts] == ["0.67"]  # no label over the empty bar


# ----------------------------------------------------------------------------------------------
# scaling_plot
# ----------------------------------------------------------------------------------------------


def series(ax) -> dict[str, tuple[list[float], list[float], list[float]]]:
    """label -> (x, y, error half lengths) of a panel's error-bar lines."""
    out = {}
    for container in ax.containers:
        line, _, (bars,) = container.lines
        errs = [float(s[1][1] - s[0][1]) / 2 if len(s) else math.nan for s in bars.get_segments()]
        out[container.get_label()] = (list(line.get_xdata()), list(line.get_ydata()), errs)
    return out


def test_the_scaling_plot_draws_fractions_of_the_degraded_from_numbers_or_stat_dicts(drawn, tmp_path):
    from meshheal_jax import plots

    entries = [
        {"n_agents": 48, "topology": "sparse", "acc_h": 0.7, "acc_d": 0.6, "isolated_degraded": 4,
         "degraded": 12, "false_isolations": {"mean": 3.0, "std": 1.0}},
        {"n_agents": 6, "topology": "sparse", "acc_h": 0.8, "acc_d": 0.5, "isolated_degraded": 1},
        {"n_agents": 6, "topology": "complete", "acc_h": 0.9, "acc_d": {"mean": 0.8, "std": 0.1},
         "isolated_degraded": 2},
        {"n_agents": 48, "topology": "complete", "acc_healthy": {"mean": 0.85, "std": 0.05},
         "acc_degraded": {"mean": 0.7, "std": None}, "isolated_degraded": {"mean": 8.0, "std": 2.0},
         "n_degraded": 12},
    ]  # fmt: skip
    plots.scaling_plot(entries, tmp_path / "scaling.png")
    (fig,) = drawn
    acc, isolated, false = fig.axes  # a third panel: an entry has false_isolations
    assert [ax.get_title() for ax in fig.axes] == [
        "Accuracy", "Degraded agents isolated at the end", "False isolations",
    ]  # fmt: skip
    assert list(series(acc)) == ["complete, healthy phase", "complete, degraded phase",
                                 "sparse, healthy phase", "sparse, degraded phase"]  # fmt: skip
    x, y, errs = series(acc)["complete, healthy phase"]
    assert x == [6, 48] and np.allclose(y, [0.9, 0.85]) and np.allclose(errs, [0.0, 0.05])
    x, y, errs = series(acc)["complete, degraded phase"]
    assert np.allclose(y, [0.8, 0.7]) and np.allclose(errs, [0.1, 0.0])  # std None: no error bar
    # isolated / degraded; degraded from `degraded`, `n_degraded`, else n_agents // 3
    x, y, errs = series(isolated)["complete"]
    assert x == [6, 48] and np.allclose(y, [2 / 2, 8 / 12]) and np.allclose(errs, [0.0, 2 / 12])
    assert np.allclose(series(isolated)["sparse"][1], [1 / 2, 4 / 12])
    x, y, errs = series(false)["sparse"]
    assert x == [6, 48] and math.isnan(y[0]) and (y[1], errs[1]) == (3.0, 1.0)  # the 6's has none
    assert all(ax.get_xscale() == "log" for ax in fig.axes)  # 48 / 6 = 8: sizes an order apart


def test_the_scaling_plot_draws_entries_missing_values_on_two_panels_and_a_linear_axis(drawn, tmp_path):
    from meshheal_jax import plots

    entries = [{"n_agents": 12, "topology": "banded", "acc_h": 0.6},  # any other name: a line of its own
               {"n_agents": 6, "topology": "complete", "acc_h": {"mean": None, "std": None}},
               {"n_agents": 42, "topology": "complete", "acc_h": 0.5, "isolated_degraded": 7}]  # fmt: skip
    plots.scaling_plot(entries, tmp_path / "scaling.png")
    (fig,) = drawn
    fig.canvas.draw()
    assert len(fig.axes) == 2 and all(ax.get_xscale() == "linear" for ax in fig.axes)  # 42 / 6 < 8
    assert list(series(fig.axes[1])) == ["complete", "banded"]  # complete first, the others after
    y = series(fig.axes[0])["complete, healthy phase"][1]
    assert math.isnan(y[0]) and y[1] == 0.5
    y = series(fig.axes[1])["complete"][1]
    assert math.isnan(y[0]) and y[1] == 0.5  # 7 of 42 // 3


def test_an_empty_tokenizer_is_refused_from_a_flag_or_the_file(tmp_path):
    """--tokenizer "" ("$TOK" with TOK unset) was dropped silently, the tokens then counted as
    characters / 4; `tokenizer = ""` in a --live-config was Path(""), the current folder, resolved
    and named as a tokenizer folder the user never gave. Both are refused by name."""
    with pytest.raises(MeshHealError, match="live settings: tokenizer is empty"):
        cli.backend_fields(main_flags("--data", "sample", "--tokenizer", ""))
    with pytest.raises(MeshHealError, match=r"live\.toml: tokenizer is empty"):
        live(tmp_path, 'data = "sample"\ntokenizer = " "\n')


def test_the_scaling_plot_keeps_a_count_of_zero_degraded_agents_and_draws_no_fraction(drawn, tmp_path):
    import warnings

    from meshheal_jax import plots

    entries = [{"n_agents": 6, "topology": "sparse", "isolated_degraded": 0, "degraded": 0},
               {"n_agents": 12, "topology": "sparse", "isolated_degraded": 1, "degraded": None,
                "n_degraded": 0},
               {"n_agents": 24, "topology": "sparse", "isolated_degraded": 3, "degraded": None}]  # fmt: skip
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no division by zero
        plots.scaling_plot(entries, tmp_path / "scaling.png")
    (fig,) = drawn
    y = series(fig.axes[1])["sparse"][1]
    assert math.isnan(y[0]) and math.isnan(y[1]) and y[2] == 3 / 8  # 0 is a count, None is not
