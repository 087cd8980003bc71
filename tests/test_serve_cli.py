"""``oppo-engine serve --actor FOLDER`` as a process with a real socket: it prints its URL, answers a plain
``/v1`` request with the official ``openai`` client (greedy: the HF forward's argmax), serves an episode to
its end (its rollout written with ``--rollouts``), and exits 0 on SIGTERM -- even while an episode is open and
silent. The process is killed if it outlives its deadline: the test fails, never hangs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx2
import openai
import pytest
from hf_check import hf_logprobs
from serve_models import chat_actor, chat_tokenizer

DEADLINE_S = 90.0


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    tokenizer = chat_tokenizer()
    folder = tmp_path_factory.mktemp("tiny-chat")
    chat_actor(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, tokenizer


SERVE = [sys.executable, "-m", "oppo_engine.cli", "serve"]


def start(folder, *args, command: list[str] = SERVE) -> tuple[subprocess.Popen, str, list[str]]:
    """The server process (``command`` and its arguments) and its URL, read from its first line; its later
    lines are collected."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [*command, "--actor", str(folder), "--port", "0", "--batch-size", "1", "--max-new-tokens", "24",
         *args],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
    )  # fmt: skip
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if " at http://" in line:
                ready.set()

    threading.Thread(target=read, daemon=True).start()
    if not ready.wait(DEADLINE_S):
        proc.kill()
        raise AssertionError(f"the server did not start: {''.join(lines)}")
    url = next(line for line in lines if " at http://" in line).split(" at ")[-1].strip()
    return proc, url, lines


def stop(proc: subprocess.Popen, lines: list[str]) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(DEADLINE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"the server did not stop on SIGTERM: {''.join(lines)}") from None


def test_the_serve_command_answers_over_a_socket_and_stops_on_sigterm(model_folder, tmp_path):
    folder, tokenizer = model_folder
    rollouts_file = tmp_path / "rollouts.jsonl"
    proc, url, lines = start(folder, "--api-key", "k", "--rollouts", str(rollouts_file))
    try:
        assert url.startswith("http://127.0.0.1:") and url.endswith("/v1")
        client = openai.OpenAI(base_url=url, api_key="k", max_retries=0, timeout=DEADLINE_S)
        messages = [{"role": "user", "content": "what is 12 + 30 ?"}]
        answer = client.chat.completions.create(
            model="m", messages=messages, max_tokens=8, temperature=0.0, extra_body={"return_token_ids": True}
        )
        prompt, ids = answer.model_extra["prompt_token_ids"], answer.choices[0].model_extra["token_ids"]
        logp = hf_logprobs(chat_actor(tokenizer), prompt + ids)
        assert ids and ids == logp[len(prompt) - 1 : -1].argmax(-1).tolist()
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=url, api_key="wrong", max_retries=0).models.list()
        # an episode, to its end: its rollout is written
        root = url.removesuffix("/v1")
        headers = {"Authorization": "Bearer k"}
        with httpx2.Client(base_url=root, headers=headers, timeout=DEADLINE_S) as http:
            opened = http.post("/v1/episodes", json={"seed": 1}).json()
            turn = http.post(
                f"{opened['base_url']}/chat/completions",
                json={"messages": messages, "max_tokens": 6, "return_token_ids": True},
            ).json()
            assert http.post(f"/v1/episodes/{opened['id']}/finish", json={"reward": 2.5}).status_code == 200
            http.post("/v1/episodes", json={})  # open, silent: SIGTERM must not wait for it
        deadline = time.monotonic() + DEADLINE_S
        while not (rollouts_file.exists() and rollouts_file.read_text().strip()):
            assert time.monotonic() < deadline, "the episode's rollout was not written"
            time.sleep(0.05)
        (rollout,) = [json.loads(line) for line in rollouts_file.read_text().splitlines()]
        assert rollout["reward"] == 2.5 and rollout["finish_reason"] == "agent_done"
        assert rollout["prompt_ids"] + rollout["response_ids"][: len(turn["choices"][0]["token_ids"])] == (
            turn["prompt_token_ids"] + turn["choices"][0]["token_ids"]
        )
    finally:
        rc = stop(proc, lines)
    assert rc == 0, "".join(lines)
    assert "stopped; 1 episodes returned" in "".join(lines)


def test_the_serve_command_refuses_a_bad_actor_with_a_message(tmp_path):
    result = subprocess.run(
        [sys.executable, "-m", "oppo_engine.cli", "serve", "--actor", str(tmp_path / "nothing")],
        capture_output=True, text=True, timeout=DEADLINE_S,
    )  # fmt: skip
    assert result.returncode == 2 and "oppo-engine serve:" in result.stderr


def test_the_serve_command_exits_2_with_a_message_when_its_port_is_in_use(model_folder):
    import socket

    folder, _ = model_folder
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        result = subprocess.run(
            [sys.executable, "-m", "oppo_engine.cli", "serve", "--actor", str(folder), "--port", str(port)],
            capture_output=True, text=True, timeout=DEADLINE_S,
        )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert f"cannot listen on 127.0.0.1:{port}" in result.stderr and "Traceback" not in result.stderr


# ``oppo-engine serve`` (serve_main) with its two closes recorded: the endpoint's, on the thread that SIGTERM
# wakes (slowed down, as a close that waits for its connections is), and the engine's, on the main thread.
RECORDED_CLOSES = """
import json, sys, threading, time
from oppo_engine import RolloutEngine
from oppo_engine.serve.command import serve_main
from oppo_engine.serve.server import ServeHandle

events, close_endpoint, close_engine = [], ServeHandle.close, RolloutEngine.close

def endpoint(self):
    if threading.current_thread().name != "oppo-serve-stop":
        return close_endpoint(self)
    events.append("endpoint close starts")
    time.sleep(1.0)
    close_endpoint(self)
    events.append("endpoint closed")

def engine(self):
    events.append("engine close")
    close_engine(self)

ServeHandle.close, RolloutEngine.close = endpoint, engine
rc = serve_main(sys.argv[1:])
print("closes: " + json.dumps(events), flush=True)
sys.exit(rc)
"""


def test_on_sigterm_the_serve_command_closes_the_endpoint_before_the_engine(model_folder):
    """The endpoint is closed by the thread SIGTERM wakes, and the engine only once that close is over:
    never two closes at once (an engine closed under a closing endpoint). Before the fix, the main loop
    left at once and closed the engine while the endpoint's close ran."""
    folder, _ = model_folder
    proc, _, lines = start(folder, command=[sys.executable, "-c", RECORDED_CLOSES])
    assert stop(proc, lines) == 0, "".join(lines)
    [closes] = [json.loads(line.split(": ", 1)[1]) for line in lines if line.startswith("closes: ")]
    assert closes == ["endpoint close starts", "endpoint closed", "engine close"], "".join(lines)
