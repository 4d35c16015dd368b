"""A tiny random-weight Llama behind a real `transformers serve` on CPU, built offline: the real
OpenAI-compatible server the tests (tests/test_live_server.py) and the live benchmark
(benchmarks/live_throughput.py) run the live backend against. Its replies are garbage; it exists to
exercise real HTTP, chat templates, tokenization and usage counts without a GPU or a download.

    reason = unavailable()            # None, or why it cannot run here
    build_tiny_llama(model_dir)
    with serve_tiny(model_dir, ["--continuous-batching"]) as url:   # http://127.0.0.1:PORT/v1
        ...                           # the served model name is str(model_dir)

Needs torch (CPU), tokenizers and `transformers[serving]` (the project's `test` extra).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

from meshheal_jax import prompts

TINY_MODEL_ID = "local/tiny-random-llama"  # the "real model id" the response cache keys on
MODULES = ("torch", "transformers", "tokenizers", "fastapi", "uvicorn")


def transformers_command() -> str | None:
    """The `transformers` CLI of this interpreter's environment (or on PATH)."""
    exe = Path(sys.executable).with_name("transformers")
    return str(exe) if exe.exists() else shutil.which("transformers")


def unavailable() -> str | None:
    """Why the tiny server cannot run here, or None."""
    missing = [m for m in MODULES if importlib.util.find_spec(m) is None]
    if missing:
        return f"missing {', '.join(missing)} (pip install -e .[test])"
    exe = transformers_command()
    if exe is None:
        return "`transformers serve` is unavailable: no transformers command on PATH"
    probe = subprocess.run([exe, "serve", "--help"], capture_output=True, text=True, timeout=120, check=False)
    if probe.returncode != 0 or "--device" not in probe.stdout:
        return "`transformers serve` is unavailable in this transformers version"
    return None


def build_tiny_llama(out_dir: Path | str) -> None:
    """A 2-layer, 64-wide random Llama with a BPE tokenizer trained here: no download."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    corpus = [
        prompts.SYSTEM_PROMPT,
        "RESULT: (A) COMPETENCE_MATCH:yes",
        json.dumps({"half_correct": 0.5}),
    ] * 20
    specials = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    tokenizer = train_bpe(corpus, 512, specials)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="</s>"
    )
    fast.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    fast.save_pretrained(out_dir)
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=fast.vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
        bos_token_id=1, eos_token_id=2, pad_token_id=2, tie_word_embeddings=True,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(out_dir)
    GenerationConfig(bos_token_id=1, eos_token_id=2, pad_token_id=2).save_pretrained(out_dir)


def train_bpe(corpus, vocab_size: int, specials: list[str]):
    """A byte-level BPE `tokenizers.Tokenizer` trained on `corpus` (specials first, "<unk>" the
    unknown token): a real tokenizer with no download."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tokenizer.train_from_iterator(corpus, trainer)
    return tokenizer


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextlib.contextmanager
def serve_tiny(
    model_dir: Path | str,
    extra_args: Sequence[str] = (),
    timeout_s: float = 180.0,
    threads: int | None = None,
) -> Iterator[str]:
    """Start `transformers serve MODEL_DIR` on 127.0.0.1 (CPU, offline), wait for /health, yield
    its base URL; stop it on exit. `threads` caps torch's intra-op threads (OMP_NUM_THREADS; None:
    torch's default, one per core): where the client or other work shares the cores, one thread
    keeps the server from fighting them. Raises RuntimeError with the log's tail when it exits or
    is not healthy within `timeout_s`. The port is a free one picked just before the start; should another
    process take it in between (the server exits with "address already in use"), up to two more
    ports are tried."""
    model_dir = Path(model_dir)
    exe = transformers_command()
    if exe is None:
        raise RuntimeError("no `transformers` command")
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        **({} if threads is None else {"OMP_NUM_THREADS": str(threads)}),
    }
    for attempt in range(3):
        port = free_port()
        log = model_dir.parent / f"transformers-serve-{port}.log"
        with open(log, "w") as log_file:
            proc = subprocess.Popen(
                [exe, "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
                 *extra_args], stdout=log_file, stderr=subprocess.STDOUT, env=env,
            )  # fmt: skip
        try:
            if _wait_healthy(proc, port, log, timeout_s, last_try=attempt == 2):
                break
        except BaseException:
            _stop(proc)
            raise
    try:
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        _stop(proc)


def _wait_healthy(proc: subprocess.Popen, port: int, log: Path, timeout_s: float, last_try: bool) -> bool:
    """Wait for the server's /health; False when it exited because its port was taken (and this is
    not the last try), RuntimeError with the log's tail on any other exit or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            tail = log.read_text()[-3000:]
            if not last_try and "address already in use" in tail.lower():
                return False
            raise RuntimeError(f"transformers serve exited ({proc.returncode}):\n{tail}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return True
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"transformers serve not healthy after {timeout_s:.0f} s:\n{log.read_text()[-3000:]}"
            )
        time.sleep(0.5)


def _stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=20)
