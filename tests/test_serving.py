"""serving/vllm_pair.sh: the printed commands of each layout (--dry-run), the refusals (gated model
without HF_TOKEN, bad settings), secrets never echoed, and the start -> ready -> stop flow run
against a FAKE `vllm` executable (a stand-in on PATH that answers /health and /v1/models; vLLM
itself needs CUDA and is not installed here)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "serving" / "vllm_pair.sh"
HF_SECRET = "hf_DoNotPrintThisToken42"
API_SECRET = "sk-local-DoNotPrintThisKey"

pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def run_script(
    *args: str, env: dict | None = None, timeout: float = 30, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith("MESHHEAL_") and k not in ("HF_TOKEN",)}
    base["PATH"] = "/usr/bin:/bin"  # no vllm here unless a test puts its fake first
    base.update(env or {})
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        env=base,
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=cwd,
        check=False,
    )


def serve_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if " vllm serve " in line and not line.startswith("#")]


# ----------------------------------------------------------------------------------------------
# Dry runs


def test_one_gpu_layout(tmp_path):
    result = run_script(
        "--layout", "one-gpu", "--dry-run", "--run-dir", str(tmp_path), env={"HF_TOKEN": HF_SECRET}
    )
    assert result.returncode == 0, result.stderr
    strong, weak = serve_lines(result.stdout)
    assert strong.startswith(
        "CUDA_VISIBLE_DEVICES=0 vllm serve openai/gpt-oss-120b --served-model-name strong"
    )
    assert weak.startswith(
        "CUDA_VISIBLE_DEVICES=0 vllm serve meta-llama/Llama-3.2-1B-Instruct --served-model-name weak"
    )
    for line, port, mem in ((strong, 8000, "0.77"), (weak, 8001, "0.15")):
        assert f"--port {port}" in line and f"--gpu-memory-utilization {mem}" in line
        assert "--host 127.0.0.1" in line and "--enable-prefix-caching" in line
        assert "--enable-prompt-tokens-details" in line  # else vLLM reports no prefix-cache hits
        assert (
            "--generation-config vllm" in line
            and "--max-model-len 32768" in line
            and "--max-num-seqs 256" in line
        )
        assert "--data-parallel-size" not in line
    out = result.stdout
    assert out.index("--served-model-name strong") < out.index("/health is 200 and /v1/models lists 'strong'")
    assert out.index("lists 'strong'") < out.index(
        "--served-model-name weak"
    )  # strong ready before weak starts
    assert "--strong-url http://127.0.0.1:8000/v1 --weak-url http://127.0.0.1:8001/v1" in out
    assert not (tmp_path / "strong.pid").exists()  # a dry run starts nothing


def test_node8_layout():
    # one independent strong server per GPU (vLLM's data parallelism of 7 fails for gpt-oss, whose
    # MoE width 2880 must divide data x tensor parallel ranks), the weak port past theirs
    result = run_script("--layout", "node8", "--dry-run", env={"HF_TOKEN": HF_SECRET})
    assert result.returncode == 0, result.stderr
    *strong, weak = serve_lines(result.stdout)
    assert len(strong) == 7
    for gpu, line in enumerate(strong):
        assert line.startswith(
            f"CUDA_VISIBLE_DEVICES={gpu} vllm serve openai/gpt-oss-120b --served-model-name strong"
        )
        assert f"--port {8000 + gpu} " in line and "--data-parallel-size" not in line
    assert weak.startswith("CUDA_VISIBLE_DEVICES=7 vllm serve meta-llama/Llama-3.2-1B-Instruct")
    assert "--port 8007 " in weak and "--data-parallel-size" not in weak
    urls = ",".join(f"http://127.0.0.1:{8000 + k}/v1" for k in range(7))
    assert f"# client: --strong-url {urls} --weak-url http://127.0.0.1:8007/v1" in result.stdout
    assert "warning" not in result.stderr


def test_node8_with_vllms_data_parallelism_warns_for_gpt_oss():
    result = run_script("--layout", "node8", "--strong-dp", "vllm", "--dry-run", env={"HF_TOKEN": HF_SECRET})
    assert result.returncode == 0, result.stderr
    strong, weak = serve_lines(result.stdout)
    assert strong.startswith("CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6 vllm serve openai/gpt-oss-120b")
    assert strong.endswith("--data-parallel-size 7") and "--port 8001 " in weak
    assert (
        "on 7 ranks per server (data x tensor parallel): vLLM's gpt-oss needs the ranks to divide 2880"
        in result.stderr
    )
    six = run_script("--layout", "node8", "--strong-dp", "vllm", "--strong-gpus", "0,1,2,3,4,5", "--dry-run",
                     env={"HF_TOKEN": HF_SECRET})  # fmt: skip
    assert serve_lines(six.stdout)[0].endswith("--data-parallel-size 6") and "warning" not in six.stderr
    assert (
        "fronts 6 engines of --max-num-seqs 256: in the client's --live-config, strong_max_in_flight = 1536"
        in six.stdout
    )
    replicas = run_script("--layout", "node8", "--dry-run", env={"HF_TOKEN": HF_SECRET})
    assert "strong_max_in_flight" not in replicas.stdout  # one engine per URL: max_in_flight fits
    taken = run_script("--layout", "node8", "--weak-port", "8003", "--dry-run", env={"HF_TOKEN": HF_SECRET})
    assert (
        taken.returncode == 2
        and "the weak port 8003 is one of the strong replicas' ports (8000-8006)" in taken.stderr
    )


def test_multi_node_hints():
    result = run_script("--layout", "multi-node", "--node-hosts", "gpu-a,gpu-b")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "--layout node8 --host 0.0.0.0" in out
    per_node = [f"http://{h}:{8000 + k}/v1" for h in ("gpu-a", "gpu-b") for k in range(7)]
    assert f"--strong-url {','.join(per_node)}\n" in out
    assert "--weak-url http://gpu-a:8007/v1,http://gpu-b:8007/v1" in out
    assert "14 do not, so this option fails to load it" in out  # option 2's 14 ranks, for gpt-oss
    head, worker, weak = serve_lines(out)
    assert "--data-parallel-size 14 --data-parallel-size-local 7 --data-parallel-address gpu-a" in head
    assert "--host 0.0.0.0" in head and "--served-model-name strong" in head
    assert "--headless" in worker and "--data-parallel-start-rank 7" in worker
    assert "--served-model-name weak" in weak
    assert "strong_max_in_flight" not in out  # option 2's 14 ranks cannot load gpt-oss: no hint for them
    six = run_script("--layout", "multi-node", "--node-hosts", "gpu-a,gpu-b", "--strong-gpus", "0,1,2,3,4,5")
    # option 2's one strong URL fronts 12 engines: the client is told to keep 12 x 256 in flight there
    assert (
        "fronts 12 engines of --max-num-seqs 256: in the client's --live-config, strong_max_in_flight = 3072"
        in six.stdout
    )


def test_multi_node_commands_carry_the_settings_given():
    result = run_script("--layout", "multi-node", "--node-hosts", "gpu-a,gpu-b", "--strong-tp", "2",
                        "--strong-port", "9000", "--strong-model", "my/model", "--pair", "A")  # fmt: skip
    assert result.returncode == 0, result.stderr
    per_node = [line for line in result.stdout.splitlines() if line.startswith("serving/vllm_pair.sh")]
    flags = "--strong-tp 2 --strong-port 9000 --strong-model my/model --pair A"
    assert per_node == [f"serving/vllm_pair.sh --layout node8 --host 0.0.0.0 {flags}"]
    urls = ",".join(f"http://{h}:{9000 + k}/v1" for h in ("gpu-a", "gpu-b") for k in range(3))
    assert f"--strong-url {urls}\n" in result.stdout  # 3 replicas of 2 GPUs per node
    head, worker, _ = serve_lines(result.stdout)
    assert "--tensor-parallel-size 2" in head and "--tensor-parallel-size 2" in worker  # one engine shape


def test_pairs_models_ports_and_env():
    result = run_script(
        "--pair", "A", "--dry-run", env={"HF_TOKEN": HF_SECRET, "MESHHEAL_STRONG_PORT": "9000"}
    )
    strong, weak = serve_lines(result.stdout)
    assert "openai/gpt-oss-120b" in strong and "--port 9000" in strong and "google/gemma-3-4b-it" in weak
    result = run_script(
        "--pair",
        "B",
        "--layout",
        "node8",
        "--strong-tp",
        "2",
        "--dry-run",
        "--weak-port=8100",
        env={"HF_TOKEN": HF_SECRET},
    )
    *strong, weak = serve_lines(result.stdout)
    for k, line in enumerate(strong):  # 3 replicas of 2 GPUs
        gpus = f"{2 * k},{2 * k + 1}"
        assert line.startswith(f"CUDA_VISIBLE_DEVICES={gpus} vllm serve meta-llama/Llama-3.3-70B-Instruct")
        assert f"--port {8000 + k} " in line and line.endswith("--tensor-parallel-size 2")
    assert len(strong) == 3 and "--port 8100" in weak
    result = run_script(
        "--strong-model",
        "/models/mine",
        "--weak-model",
        "Qwen/Qwen2.5-0.5B-Instruct",
        "--max-model-len",
        "8192",
        "--weak-max-num-seqs",
        "64",
        "--host",
        "0.0.0.0",
        "--dry-run",
    )
    strong, weak = serve_lines(result.stdout)
    assert (
        "vllm serve /models/mine" in strong
        and "--max-model-len 8192" in strong
        and "--host 0.0.0.0" in strong
    )
    assert "--max-num-seqs 64" in weak and "--max-num-seqs 256" in strong
    assert "HF_TOKEN" not in result.stderr  # neither model is gated


@pytest.mark.parametrize(
    "args",
    [
        ["--layout", "one-gpu", "--dry-run"],
        ["--layout", "node8", "--dry-run"],
        ["--layout", "multi-node", "--node-hosts", "gpu-a,gpu-b"],
    ],
)
def test_readme_shows_the_real_dry_run_output(args):
    repo = SCRIPT.parents[1]
    result = run_script(*args, env={"HF_TOKEN": HF_SECRET}, cwd=repo)
    readme = (repo / "serving" / "README.md").read_text()
    assert f"$ serving/vllm_pair.sh {' '.join(args)}\n{result.stdout}" in readme


@pytest.mark.parametrize(
    "args, message",
    [
        (["--layout", "two-gpu"], "unknown layout"),
        (["--pair", "C"], "unknown pair"),
        (["--strong-mem", "0.85"], "share a GPU"),
        (["--strong-mem", "1.5"], "memory fraction"),
        (["--weak-port", "8000"], "different ports"),
        (["--strong-gpus", "0;1"], "strong GPUs"),
        (["--max-num-seqs", "many"], "positive integer"),
        (["--bogus", "1"], "unknown option"),
        (["--layout"], "needs a value"),
        (["restart"], "unknown command"),
    ],
)
def test_bad_settings_are_refused(args, message):
    result = run_script(*args, "--dry-run", env={"HF_TOKEN": HF_SECRET})
    assert result.returncode == 2 and message in result.stderr
    assert not serve_lines(result.stdout)


# ----------------------------------------------------------------------------------------------
# HF_TOKEN and secrets


def test_refuses_to_start_a_gated_model_without_hf_token(tmp_path):
    result = run_script("--run-dir", str(tmp_path))
    assert result.returncode == 2
    assert (
        "refusing to start" in result.stderr
        and "meta-llama/Llama-3.2-1B-Instruct is a gated model" in result.stderr
    )
    assert "HF_TOKEN" in result.stderr
    assert not serve_lines(result.stdout) and not list(tmp_path.iterdir())
    dry = run_script("--dry-run")  # a dry run still prints, with a note
    assert dry.returncode == 0 and "HF_TOKEN is not set" in dry.stderr
    gemma = run_script("--pair", "A", "--run-dir", str(tmp_path))
    assert gemma.returncode == 2 and "google/gemma-3-4b-it is a gated model" in gemma.stderr


def test_secrets_are_never_echoed():
    env = {"HF_TOKEN": HF_SECRET, "VLLM_API_KEY": API_SECRET}
    for args in (
        ["--dry-run"],
        ["--layout", "node8", "--dry-run"],
        ["--layout", "multi-node"],
        ["--help"],
        [],
    ):
        result = run_script(*args, env=env)
        assert HF_SECRET not in result.stdout + result.stderr
        assert API_SECRET not in result.stdout + result.stderr


# ----------------------------------------------------------------------------------------------
# Start, wait, stop against a fake vllm

FAKE_VLLM = r'''#!PYTHON
"""Fake `vllm serve` for the serving script's tests: answers /health and /v1/models."""
import http.server, json, os, sys, time
args = sys.argv[1:]
def opt(name):
    return args[args.index(name) + 1]
name, port, host = opt("--served-model-name"), int(opt("--port")), opt("--host")
def record(event):
    with open(os.environ["FAKE_VLLM_RECORD"], "a") as f:
        f.write(json.dumps({"event": event, "name": name, "argv": args, "t": time.time(),
                            "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
                            "token_seen": os.environ.get("HF_TOKEN") == os.environ.get("EXPECTED_TOKEN")}) + "\n")
record("start")
time.sleep(float(os.environ.get("FAKE_VLLM_LOAD_S", "0")))
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/health":
            code, body = 200, b""
        elif self.path == "/v1/models":
            code, body = 200, json.dumps({"object": "list", "data": [{"id": name, "root": args[1]}]}).encode()
        else:
            code, body = 404, b"{}"
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *a):
        pass
server = http.server.HTTPServer((host, port), Handler)
record("ready")
print("fake vllm ready", flush=True)
server.serve_forever()
'''


def free_ports(n: int) -> tuple[int, ...]:
    """n distinct free ports: all bound at once (ports asked one after another may repeat)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for sock in socks:
            sock.bind(("127.0.0.1", 0))
        return tuple(sock.getsockname()[1] for sock in socks)
    finally:
        for sock in socks:
            sock.close()


@pytest.fixture
def fake_vllm(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    exe = bin_dir / "vllm"
    exe.write_text(FAKE_VLLM.replace("PYTHON", sys.executable))
    exe.chmod(0o755)
    smi = bin_dir / "nvidia-smi"  # ahead of a real one in /usr/bin: a 141 GB GPU, whatever this host has
    smi.write_text("#!/bin/sh\necho 143771\n")
    smi.chmod(0o755)
    record = tmp_path / "record.jsonl"
    ports = free_ports(2)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "FAKE_VLLM_RECORD": str(record),
        "FAKE_VLLM_LOAD_S": "1.0",
        "HF_TOKEN": HF_SECRET,
        "EXPECTED_TOKEN": HF_SECRET,
        "VLLM_API_KEY": API_SECRET,
        "MESHHEAL_WAIT_INTERVAL": "1",
        "MESHHEAL_WAIT_TIMEOUT": "30",
    }
    args = [
        "--run-dir",
        str(tmp_path / "serving"),
        "--strong-port",
        str(ports[0]),
        "--weak-port",
        str(ports[1]),
    ]
    yield env, args, record, ports, tmp_path / "serving"
    run_script("stop", "--run-dir", str(tmp_path / "serving"), env=env)  # never leave one running


def answers(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as reply:
            return reply.status == 200
    except OSError:
        return False


def events(record: Path) -> list[dict]:
    return [json.loads(line) for line in record.read_text().splitlines()]


def test_start_detached_then_stop(fake_vllm):
    env, args, record, ports, run_dir = fake_vllm
    result = run_script(*args, "--detach", env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "both servers ready" in result.stdout
    order = [(e["name"], e["event"]) for e in events(record)]
    assert order == [("strong", "start"), ("strong", "ready"), ("weak", "start"), ("weak", "ready")]
    assert all(e["cuda"] == "0" and e["token_seen"] for e in events(record))  # vLLM gets HF_TOKEN from env
    assert answers(ports[0]) and answers(ports[1])
    for role in ("strong", "weak"):
        assert (run_dir / f"{role}.pid").read_text().strip().isdigit()
        assert f"--served-model-name {role}" in (run_dir / f"{role}.log").read_text()
    logs = "".join(p.read_text() for p in run_dir.iterdir()) + result.stdout + result.stderr
    assert HF_SECRET not in logs and API_SECRET not in logs
    status = run_script("status", "--run-dir", str(run_dir), env=env)
    assert "strong: running" in status.stdout and "weak: running" in status.stdout
    again = run_script(*args, "--detach", env=env)
    assert again.returncode == 2 and "already running" in again.stderr

    stopped = run_script("stop", "--run-dir", str(run_dir), env=env, timeout=60)
    assert stopped.returncode == 0
    deadline = time.monotonic() + 10
    while (answers(ports[0]) or answers(ports[1])) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not answers(ports[0]) and not answers(ports[1])
    assert not (run_dir / "strong.pid").exists() and not (run_dir / "weak.pid").exists()


def test_ctrl_c_stops_both(fake_vllm, terminal_sigint):
    env, args, _record, ports, run_dir = fake_vllm
    base = {k: v for k, v in os.environ.items() if not k.startswith("MESHHEAL_") and k != "HF_TOKEN"}
    proc = subprocess.Popen(
        ["bash", str(SCRIPT), *args],
        env={**base, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 40
        while not any("Ctrl-C stops both" in line for line in lines) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.stderr.read()
            time.sleep(0.1)
        assert any("Ctrl-C stops both" in line for line in lines)
        assert answers(ports[0]) and answers(ports[1])
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=40) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    deadline = time.monotonic() + 10
    while (answers(ports[0]) or answers(ports[1])) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not answers(ports[0]) and not answers(ports[1])
    assert not (run_dir / "strong.pid").exists()


def test_server_that_dies_during_start_up_is_reported(fake_vllm):
    env, args, _record, _ports, run_dir = fake_vllm
    bad = run_dir.parent / "bin" / "vllm"
    bad.write_text("#!/bin/sh\necho 'CUDA out of memory' >&2\nexit 1\n")
    result = run_script(*args, env=env, timeout=60)
    assert result.returncode == 2
    assert "strong server exited during start-up" in result.stderr and "CUDA out of memory" in result.stderr


def test_node8_replicas_start_wait_and_stop_together(fake_vllm):
    env, _args, record, _ports, run_dir = fake_vllm
    strong0, weak = free_ports(2)
    args = ["--layout", "node8", "--strong-gpus", "0,1", "--weak-gpus", "2", "--run-dir", str(run_dir),
            "--strong-port", str(strong0), "--weak-port", str(weak)]  # fmt: skip
    if answers(strong0 + 1):
        pytest.skip(f"port {strong0 + 1} is taken")
    result = run_script(*args, "--detach", env=env, timeout=60)
    assert result.returncode == 0, result.stderr
    starts = [
        (e["name"], e["cuda"], e["argv"][e["argv"].index("--port") + 1])
        for e in events(record)
        if e["event"] == "start"
    ]
    assert sorted(starts[:2]) == [
        ("strong", "0", str(strong0)),
        ("strong", "1", str(strong0 + 1)),
    ]  # together
    assert starts[2] == ("weak", "2", str(weak))  # once both are ready
    urls = f"http://127.0.0.1:{strong0}/v1,http://127.0.0.1:{strong0 + 1}/v1"
    assert f"live client: --strong-url {urls} --weak-url http://127.0.0.1:{weak}/v1" in result.stdout
    assert all(answers(port) for port in (strong0, strong0 + 1, weak))
    status = run_script("status", "--run-dir", str(run_dir), env=env)
    assert [line.split(":")[0] for line in status.stdout.splitlines()] == ["strong-1", "strong-2", "weak"]
    assert all(": running" in line for line in status.stdout.splitlines())
    assert run_script("stop", "--run-dir", str(run_dir), env=env, timeout=60).returncode == 0
    deadline = time.monotonic() + 10
    while any(answers(p) for p in (strong0, strong0 + 1, weak)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(answers(p) for p in (strong0, strong0 + 1, weak)) and not list(run_dir.glob("*.pid"))


def test_gpt_oss_on_a_gpu_too_small_for_its_share_is_refused(fake_vllm):
    env, args, record, _ports, _run_dir = fake_vllm
    smi = Path(env["PATH"].split(":")[0]) / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 81559\n")  # an 80 GB H100, as nvidia-smi reports it in MiB
    smi.chmod(0o755)
    result = run_script(*args, env=env, timeout=60)
    assert result.returncode == 2 and not record.exists()
    assert "GPU(s) 0 have 79 GiB; 0.77 of them (61 GiB) cannot hold openai/gpt-oss-120b" in result.stderr
    smi.write_text("#!/bin/sh\necho 'NVIDIA-SMI has failed' >&2\nexit 9\n")  # no answer: vLLM will say
    result = run_script(*args, "--detach", env=env, timeout=60)
    assert result.returncode == 0, result.stderr


def test_a_weak_tensor_parallel_size_that_splits_no_head_count_is_warned_of():
    three = run_script("--layout", "node8", "--strong-gpus", "0,1,2,3,4", "--weak-gpus", "5,6,7", "--dry-run",
                       env={"HF_TOKEN": HF_SECRET})  # fmt: skip
    assert (
        three.returncode == 0 and "the weak server on 3 GPUs (5,6,7): vLLM needs the tensor" in three.stderr
    )
    assert serve_lines(three.stdout)[-1].endswith("--tensor-parallel-size 3")
    two = run_script("--layout", "node8", "--strong-gpus", "0,1,2,3,4,5", "--weak-gpus", "6,7", "--dry-run",
                     env={"HF_TOKEN": HF_SECRET})  # fmt: skip
    assert two.returncode == 0 and "warning" not in two.stderr
