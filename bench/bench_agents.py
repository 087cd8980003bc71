"""Agents written against the ``openai`` client, with a long-tailed tool between their turns: the engine
served over HTTP and in-process, the same episodes as an engine ``Env``, and a batch-synchronous loop.

    python -m bench.bench_agents --steps 4 --repeats 2

The workload: B episodes per step, each a chat of 2-4 turns (drawn per task from the seed) of at most
``--turn-tokens`` sampled tokens; after every turn but the last the agent calls a tool, which answers after a
latency drawn lognormal (median 50 ms, sigma 1.5, capped at 3 s) per (task, turn) from the seed, and sends the
result back as a tool message; after the last turn it returns its reward. A tiny random chat model (the
demo's tokenizer and ChatML-style template), so the tokens differ from a trained model's but the schedule
does not. The same tasks, latencies and seeds in every arm:

- ``oppo-http``: ``RolloutEngine(mode="oppo")`` serving, ``add_agents(..., in_process=False)``: every
  request goes through the socket;
- ``oppo-inproc``: the same, each client reaching the app in-process (``httpx2.ASGITransport``);
- ``oppo-env``: the same episodes as an engine ``Env`` (the agent's logic on the token side: the tool's
  latency, then the template suffix of its tool message), no server: the transcripts equal the served ones;
- ``batch-sync``: the loop the issue compares against: the batch's turn is generated (HF ``generate``), and a
  turn is answered only once all B requests of that turn are in; the tools of a turn run at once (the turn
  waits for the slowest), then the next turn prefills the whole transcripts again.

Reported per arm, from the same run: episodes per second over the measured steps (after one warm-up step),
and for the served arms the serving thread's CPU milliseconds per request (from /proc: the thread's user +
system time) and the actor thread's microseconds per forward in the environments' ``decoded()`` (the
streaming hook every served episode has), with the agents it visited per forward (``--stream``: the agents
stream their turns, so each visit also hands tokens to the serving loop). The machine's load average is
printed beside each figure: on a shared machine the figures move with it.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import torch
from transformers import AutoModelForCausalLM, Qwen2Config

from oppo_engine import EngineConfig, Observation, RolloutEngine, SamplingParams
from oppo_engine.ppo import tools_task
from oppo_engine.sched.sequence import SeqStatus
from oppo_engine.serve.chat import Renderer, normalise


def latency(seed: int, task: int, turn: int, median_s=0.05, sigma=1.5, cap_s=3.0) -> float:
    rng = random.Random(zlib.crc32(repr((seed, task, turn)).encode()))
    return min(cap_s, median_s * math.exp(sigma * rng.gauss(0.0, 1.0)))


def turns_of(seed: int, task: int) -> int:
    return random.Random(zlib.crc32(repr((seed, task, "turns")).encode())).randint(2, 4)


def question(task: int) -> list[dict]:
    return [{"role": "user", "content": f"what is {task} + {task % 7} ?"}]


def tool_message(task: int, turn: int) -> dict:
    return {"role": "user", "content": f"<tool_response> {task + turn} </tool_response>"}


def make_agent(seed: int, turn_tokens: int, stream: bool = False):
    async def agent(task: int, client) -> float:
        messages = question(task)
        turns = turns_of(seed, task)
        for turn in range(turns):
            if stream:  # token by token (the turn's text concatenated from the chunks)
                chunks = await client.chat.completions.create(
                    model="m", messages=messages, max_tokens=turn_tokens, stream=True
                )
                content = "".join([c.choices[0].delta.content or "" async for c in chunks if c.choices])
            else:
                answer = await client.chat.completions.create(
                    model="m", messages=messages, max_tokens=turn_tokens
                )
                content = answer.choices[0].message.content
            messages.append({"role": "assistant", "content": content})
            if turn + 1 < turns:
                await asyncio.sleep(latency(seed, task, turn))
                messages.append(tool_message(task, turn))
        return 1.0

    return agent


class EpisodeEnv:
    """The agent's logic as an ``Env``: the same tool latency, the same template suffix appended."""

    def __init__(self, tokenizer, renderer: Renderer, seed: int, task: int, turn_tokens: int) -> None:
        self.tokenizer, self.renderer, self.seed, self.task = tokenizer, renderer, seed, task
        self.turn_tokens = turn_tokens
        self.messages = normalise(question(task))
        self.turn = 0

    def reset(self, prompt_ids):
        pass

    async def step(self, turn_ids):
        end = self.renderer.turn_end
        closed = bool(turn_ids) and turn_ids[-1] == end
        text = self.tokenizer.decode(turn_ids[:-1] if closed else turn_ids, skip_special_tokens=True)
        self.messages.append({"role": "assistant", "content": text})
        turn, self.turn = self.turn, self.turn + 1
        if self.turn >= turns_of(self.seed, self.task):
            return Observation([], done=True, reward=1.0, finish_reason="agent_done")
        await asyncio.sleep(latency(self.seed, self.task, turn))
        new = normalise([tool_message(self.task, turn)])
        suffix = self.renderer.suffix(self.messages, new, None, turn_closed=closed)
        self.messages += new
        return Observation(suffix, next_turn_tokens=self.turn_tokens)


def build(args):
    tokenizer = tools_task.train_tokenizer([tools_task.CHAT_TEMPLATE, "what is 12 + 7 ? the answer is 19 ."])
    torch.manual_seed(0)
    actor = AutoModelForCausalLM.from_config(
        Qwen2Config(vocab_size=-(-len(tokenizer) // 16) * 16, hidden_size=256, intermediate_size=512,
                    num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                    eos_token_id=tokenizer.eos_token_id, pad_token_id=0),
        dtype=torch.float32,
    ).eval()  # fmt: skip
    return tokenizer, actor


def make_engine(args, tokenizer, actor, env=None) -> RolloutEngine:
    b = args.batch_size
    return RolloutEngine(
        actor, reward=lambda p, r: 0.0, tokenizer=tokenizer, env=env,
        config=EngineConfig(batch_size=b, mode="oppo", overcommit=b // 2, chunk_size=8, max_model_len=1024),
        sampling=SamplingParams(max_new_tokens=64, seed=args.seed),
    )  # fmt: skip


def thread_cpu_s(thread: threading.Thread) -> float:
    """User + system CPU seconds of ``thread`` so far (Linux /proc)."""
    with open(f"/proc/self/task/{thread.native_id}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class DecodedCost:
    """The actor thread's time in the environments' ``decoded()`` (``EnvDriver.decoded``: every served
    episode's ``AgentEnv.decoded``, the streaming hook, after every forward), per forward, and how many
    sequences it visited per forward (the agents decoding)."""

    def __init__(self, envs) -> None:
        self.envs, self.inner = envs, envs.decoded
        self.calls, self.seconds, self.visited = 0, 0.0, 0
        envs.decoded = self  # the step loop calls envs.decoded() after every forward while any listens

    def __call__(self, live: set[int]):
        t = time.perf_counter()
        failed = self.inner(live)
        self.seconds += time.perf_counter() - t
        self.calls += 1
        self.visited += sum(
            s.status is SeqStatus.RUNNING and s.seq_id in live for s in self.envs.listening.values()
        )
        return failed

    def reset(self) -> None:
        self.calls, self.seconds, self.visited = 0, 0.0, 0


def run_served(args, tokenizer, actor, in_process: bool) -> dict:
    engine = make_engine(args, tokenizer, actor)
    handle = engine.serve()
    cost = DecodedCost(engine._loop.envs)
    total = args.batch_size * (args.steps + 1)
    agent = make_agent(args.seed, args.turn_tokens, args.stream)
    engine.add_agents(agent, range(total), in_process=in_process)
    engine.step()  # warm-up
    cost.reset()
    cpu0, t0, done = thread_cpu_s(handle.thread), time.perf_counter(), 0
    for _ in range(args.steps):
        done += len(engine.step().rollouts)
    wall = time.perf_counter() - t0
    cpu = thread_cpu_s(handle.thread) - cpu0
    requests = sum(turns_of(args.seed, t) for t in range(args.batch_size, total))  # about the measured ones
    engine.close()
    calls = max(cost.calls, 1)
    return {
        "episodes_per_s": done / wall,
        "server_cpu_ms_per_request": 1000 * cpu / requests,
        "decoded_us_per_forward": 1e6 * cost.seconds / calls,
        "agents_decoding_per_forward": cost.visited / calls,
        "forward_ms": 1000 * wall / calls,  # wall time per forward of the measured steps (all of it)
    }


def run_env(args, tokenizer, actor) -> dict:
    renderer = Renderer(tokenizer, tokenizer.convert_tokens_to_ids("<|im_end|>"))
    total = args.batch_size * (args.steps + 1)
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    engine = make_engine(args, tokenizer, actor)
    prompts = [renderer.render(normalise(question(t)), None, generation_prompt=True) for t in range(total)]
    sampling = [
        SamplingParams(
            max_new_tokens=64, seed=None, turn_stop_token_ids=(end,), max_turn_tokens=args.turn_tokens
        )
        for _ in range(total)
    ]
    envs = [lambda t=t: EpisodeEnv(tokenizer, renderer, args.seed, t, args.turn_tokens) for t in range(total)]
    engine.add_prompts(prompts, sampling=sampling, envs=envs)
    engine.step()
    t0, done = time.perf_counter(), 0
    for _ in range(args.steps):
        done += len(engine.step().rollouts)
    wall = time.perf_counter() - t0
    engine.close()
    return {"episodes_per_s": done / wall, "server_cpu_ms_per_request": None}


def run_batch_sync(args, tokenizer, actor) -> dict:
    """Each step: B episodes; each turn is generated for the whole batch at once (HF ``generate``), and the
    next turn starts only when every tool of this one has answered."""
    pool = ThreadPoolExecutor(args.batch_size)
    torch.manual_seed(args.seed)

    def one_batch(tasks: list[int]) -> None:
        convs = [question(t) for t in tasks]
        live = list(range(len(tasks)))
        turn = 0
        while live:
            texts = [
                tokenizer.apply_chat_template(convs[i], add_generation_prompt=True, tokenize=False)
                for i in live
            ]
            enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
            with torch.inference_mode():
                out = actor.generate(**enc, max_new_tokens=args.turn_tokens, do_sample=True,
                                     pad_token_id=tokenizer.pad_token_id)  # fmt: skip
            answers = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
            calls = []
            for i, text in zip(live, answers, strict=True):
                convs[i].append({"role": "assistant", "content": text})
                if turn + 1 < turns_of(args.seed, tasks[i]):
                    calls.append((i, latency(args.seed, tasks[i], turn)))
            list(pool.map(lambda c: time.sleep(c[1]), calls))  # the turn waits for the slowest tool
            for i, _ in calls:
                convs[i].append(tool_message(tasks[i], turn))
            live = [i for i, _ in calls]
            turn += 1

    b = args.batch_size
    one_batch(list(range(b)))  # warm-up
    t0 = time.perf_counter()
    for step in range(args.steps):
        one_batch(list(range(b * (step + 1), b * (step + 2))))
    wall = time.perf_counter() - t0
    pool.shutdown()
    return {"episodes_per_s": b * args.steps / wall, "server_cpu_ms_per_request": None}


ARMS = {
    "oppo-http": lambda a, t, m: run_served(a, t, m, in_process=False),
    "oppo-inproc": lambda a, t, m: run_served(a, t, m, in_process=True),
    "oppo-env": run_env,
    "batch-sync": run_batch_sync,
}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--turn-tokens", type=int, default=24)
    p.add_argument("--repeats", type=int, default=2, help="interleaved runs of every arm; the best is shown")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--arms", default=",".join(ARMS))
    p.add_argument("--stream", action="store_true", help="the served arms' agents stream their turns")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    tokenizer, actor = build(args)
    names = args.arms.split(",")
    best: dict[str, dict] = {}
    for repeat in range(args.repeats):
        for name in names:  # interleaved, so the machine's load falls on every arm alike
            load = os.getloadavg()[0]
            got = ARMS[name](args, tokenizer, actor)
            got["load"] = load
            print(f"repeat {repeat} {name}: {got}", flush=True)
            if name not in best or got["episodes_per_s"] > best[name]["episodes_per_s"]:
                best[name] = got
    base = best.get("batch-sync", {}).get("episodes_per_s")
    print("\n| arm | episodes/s | server CPU ms/request | vs batch-sync | load (1 min) |")
    print("|---|---|---|---|---|")
    for name in names:
        r = best[name]
        cpu = "-" if r["server_cpu_ms_per_request"] is None else f"{r['server_cpu_ms_per_request']:.2f}"
        ratio = f"{r['episodes_per_s'] / base:.2f}x" if base else "-"
        print(f"| {name} | {r['episodes_per_s']:.2f} | {cpu} | {ratio} | {r['load']:.1f} |")
    return best


if __name__ == "__main__":
    main()
