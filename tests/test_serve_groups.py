"""``add_agents(agent_fn, tasks, n)``: ``n`` agents on one task form one group, as ``n`` samples of a prompt
do -- one ``group_id``, ``sample_index`` 0..n-1, returned in one step, failed whole -- and the same agents and
seeds give the same transcripts in every mode. Every test has a deadline: a hang fails it."""

from __future__ import annotations

import time
from collections import defaultdict

import pytest

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams

MODES = ["sequential", "intra", "inter", "oppo"]
DEADLINE_S = 120.0
N = 2


def make_engine(actor, tokenizer, mode: str, batch_size: int = 4) -> RolloutEngine:
    cfg = {}
    if mode in ("inter", "oppo"):
        cfg["overcommit"] = 2
    if mode in ("intra", "oppo"):
        cfg["chunk_size"] = 4
    return RolloutEngine(
        actor, reward=lambda p, r: float(len(r)), tokenizer=tokenizer,
        config=EngineConfig(batch_size=batch_size, mode=mode, max_model_len=512, page_size=16, **cfg),
        sampling=SamplingParams(max_new_tokens=40, seed=4),
    )  # fmt: skip


async def agent(task, client):
    messages = [{"role": "user", "content": f"what is {task} + 7 ?"}]
    for turn in range(2):
        answer = await client.chat.completions.create(
            model="m", messages=messages, max_tokens=8, temperature=1.0
        )
        messages += [
            {"role": "assistant", "content": answer.choices[0].message.content},
            {"role": "user", "content": f"and then {turn} ?"},
        ]
    return float(task)


def run(actor, tokenizer, mode: str, tasks: list[int], fn=agent, *, in_process: bool = True, expect=None):
    """Every step's rollouts and failures, until ``expect`` (all ``len(tasks) * N``) episodes came back;
    then one more step, which must return at once with nothing."""
    engine = make_engine(actor, tokenizer, mode)
    engine.serve()
    steps = []
    try:
        engine.add_agents(fn, tasks, n=N, in_process=in_process)
        deadline = time.monotonic() + DEADLINE_S
        while sum(len(r) + len(f) for r, f in steps) < (expect or len(tasks) * N):
            assert time.monotonic() < deadline, "the episodes did not come back"
            result = engine.step()
            steps.append((result.rollouts, result.failed))
        t = time.monotonic()
        last = engine.step()
        assert last.rollouts == last.failed == [] and time.monotonic() - t < 5.0
        stats = engine.cache_stats()
        assert stats.free_pages == stats.total_pages
    finally:
        engine.close()
    return steps


def transcripts(steps) -> dict:
    """(task, sample index) -> the transcript; each group's members checked to come back together."""
    out = {}
    for rollouts, failed in steps:
        assert failed == []
        groups = defaultdict(list)
        for r in rollouts:
            groups[r.group_id].append(r)
        for members in groups.values():
            # a group is returned whole, in one step: its n members, one task, samples 0..n-1
            assert sorted(r.sample_index for r in members) == list(range(N))
            assert len({r.reward for r in members}) == 1
            assert all(r.finish_reason == "agent_done" for r in members)
            for r in members:
                out[(r.reward, r.sample_index)] = (tuple(r.prompt_ids), tuple(r.response_ids))
    return out


def test_n_agents_on_one_task_form_one_group_with_the_same_transcripts_in_every_mode(actor, tokenizer):
    tasks = [0, 1, 2, 3]
    seen = {}
    for mode in MODES:
        seen[mode] = transcripts(run(actor, tokenizer, mode, tasks))
        assert sorted(seen[mode]) == [(float(t), j) for t in tasks for j in range(N)], mode
    seen["oppo-http"] = transcripts(run(actor, tokenizer, "oppo", tasks, in_process=False))
    first = seen["sequential"]
    for key, got in seen.items():
        assert got == first, key
    # the members of a group sampled with seeds of their own: their transcripts differ
    assert any(first[(float(t), 0)] != first[(float(t), 1)] for t in tasks)


@pytest.mark.parametrize("mode", ["sequential", "oppo"])
def test_a_member_that_raises_fails_its_whole_group_and_the_others_come_back(actor, tokenizer, mode):
    calls = defaultdict(int)

    async def flaky(task, client):
        calls[task] += 1
        if task == 1 and calls[task] == 2:  # one member of task 1's group, once it has its first answer
            messages = [{"role": "user", "content": "hello"}]
            await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
            raise RuntimeError("the tool is down")
        return await agent(task, client)

    steps = run(actor, tokenizer, mode, [0, 1, 2], fn=flaky)
    rollouts = [r for r, _ in steps for r in r]
    failed = [f for _, f in steps for f in f]
    assert len(failed) == N and len({f.group_id for f in failed}) == 1
    assert sorted(f.sample_index for f in failed) == list(range(N))
    assert any("the tool is down" in (f.error or "") for f in failed)
    assert sorted(r.reward for r in rollouts) == [0.0, 0.0, 2.0, 2.0]


def test_a_member_that_raises_before_its_first_request_fails_its_group_and_stalls_no_step(actor, tokenizer):
    calls = defaultdict(int)

    async def flaky(task, client):
        calls[task] += 1
        if task == 1 and calls[task] == 2:
            raise RuntimeError("no first request")
        return await agent(task, client)

    # The group never had a sequence, yet it comes back once, in StepResult.failed: the member that raised
    # with its error, the other (its request got 410) with its group's. The others come back, and the last
    # step returns at once: nothing waits for the group's first requests.
    steps = run(actor, tokenizer, "oppo", [0, 1, 2], fn=flaky)
    rollouts = [r for r, _ in steps for r in r]
    assert sorted(r.reward for r in rollouts) == [0.0, 0.0, 2.0, 2.0]
    failed = [f for _, f in steps for f in f]
    assert len(failed) == N and len({f.group_id for f in failed}) == 1
    assert {f.group_id for f in failed}.isdisjoint(r.group_id for r in rollouts)
    assert sorted(f.sample_index for f in failed) == list(range(N))
    assert all(f.finish_reason == "error" and f.response_ids == [] for f in failed)
    assert any("no first request" in f.error for f in failed)


def test_add_agents_refuses_a_group_that_the_batch_cannot_return_whole(actor, tokenizer):
    engine = make_engine(actor, tokenizer, "oppo", batch_size=4)
    engine.serve()
    try:
        with pytest.raises(ValueError, match="divide"):
            engine.add_agents(agent, [0], n=3)
        with pytest.raises(ValueError, match="n must be an integer"):
            engine.add_agents(agent, [0], n=0)
    finally:
        engine.close()


def test_a_second_group_size_is_refused_until_the_first_has_come_back(actor, tokenizer):
    """With groups of 1 and 2 in flight a step could be left with one place and only a group of 2 to fill it:
    fewer than B or a stall (the reviewer's mixed2.py). So one size at a time, and every episode of the old
    size comes back before another size is queued."""
    engine = make_engine(actor, tokenizer, "oppo", batch_size=2)
    handle = engine.serve()
    try:
        engine.add_agents(agent, [0], n=1)
        with pytest.raises(ValueError, match="groups of 1 are queued or in flight"):
            engine.add_agents(agent, [1], n=2)
        got, deadline = [], time.monotonic() + DEADLINE_S
        while len(got) < 1:
            assert time.monotonic() < deadline
            got += engine.step().rollouts
        engine.add_agents(agent, [1, 2], n=2)  # nothing of size 1 left: size 2 now
        with pytest.raises(ValueError, match="groups of 2"):
            handle.open_episode()
        with pytest.raises(ValueError, match="groups of 2"):
            engine.add_prompts([[5, 6, 7]])
        while len(got) < 5:
            assert time.monotonic() < deadline
            result = engine.step()
            assert len(result.rollouts) in (0, 2) and result.failed == []
            got += result.rollouts
        assert sorted(r.reward for r in got) == [0.0, 1.0, 1.0, 2.0, 2.0]
        handle.open_episode().finish(None)  # every group of 2 came back: groups of 1 again
    finally:
        engine.close()


def test_on_divergence_restart_answers_409_to_a_group_member_and_the_group_comes_back_whole(actor, tokenizer):
    """A restarted member would be a singleton episode outside its group, and the group's reward would go to
    the wrong rollout: a member's diverging request gets the 409 even under on_divergence="restart"."""
    import openai

    statuses = []

    async def edits(task, client):
        messages = [{"role": "user", "content": f"what is {task} ?"}]
        await client.chat.completions.create(model="m", messages=messages, max_tokens=4)
        try:
            await client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "edited"}], max_tokens=4
            )
        except openai.ConflictError as e:
            statuses.append(e.status_code)
            assert "never restarted" in str(e)
        return 3.0

    engine = make_engine(actor, tokenizer, "oppo", batch_size=2)
    engine.serve(on_divergence="restart")
    try:
        engine.add_agents(edits, [0], n=2)
        got, deadline = [], time.monotonic() + DEADLINE_S
        while len(got) < 2:
            assert time.monotonic() < deadline
            result = engine.step()
            assert result.failed == []
            got += result.rollouts
        assert statuses == [409, 409]
        assert [r.reward for r in got] == [3.0, 3.0] and len({r.group_id for r in got}) == 1
        assert sorted(r.sample_index for r in got) == [0, 1]
        assert engine.step().rollouts == []  # no restarted episode is left behind
    finally:
        engine.close()


def test_an_agent_that_raises_before_its_first_request_comes_back_in_failed(actor, tokenizer):
    """n=1 too: an episode that never had a sequence comes back once, in StepResult.failed, with its error."""

    async def broken(task, client):
        if task == 1:
            raise RuntimeError("no tool")
        return await agent(task, client)

    engine = make_engine(actor, tokenizer, "oppo", batch_size=2)
    engine.serve()
    try:
        engine.add_agents(broken, [0, 1, 2])
        rollouts, failed, deadline = [], [], time.monotonic() + DEADLINE_S
        while len(rollouts) + len(failed) < 3:
            assert time.monotonic() < deadline
            result = engine.step()
            rollouts += result.rollouts
            failed += result.failed
        assert sorted(r.reward for r in rollouts) == [0.0, 2.0]
        assert len(failed) == 1 and "no tool" in failed[0].error and failed[0].prompt_ids == []
        assert engine.step().failed == []  # once
    finally:
        engine.close()


def test_a_seed_given_at_opening_refuses_another_in_the_first_request_and_an_agents_request_seed_is_used(
    actor, tokenizer
):
    """One rule for seeds: fixed at the opening when given there (a first request with another gets 400, as a
    later one does); else the first request's -- an agent's too, over its task's -- else the task's."""
    import httpx2

    async def seeded(task, client):
        messages = [{"role": "user", "content": "same question"}]
        answer = await client.chat.completions.create(
            model="m", messages=messages, max_tokens=8, temperature=1.0, seed=11
        )
        return float(task) if answer.choices[0].message.content is not None else -1.0

    engine = make_engine(actor, tokenizer, "oppo", batch_size=2)
    handle = engine.serve()
    try:
        episode = handle.open_episode(seed=5)
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "seed": 7}
        answer = httpx2.post(f"{episode.base_url}/chat/completions", json=body, timeout=DEADLINE_S)
        assert answer.status_code == 400 and "opened with seed=5" in answer.text
        episode.finish(None)
        engine.add_agents(seeded, [0, 1])
        got, deadline = [], time.monotonic() + DEADLINE_S
        while len(got) < 2:
            assert time.monotonic() < deadline
            got += engine.step().rollouts
        # the same messages and the same request seed: the same transcript, whatever the task's seed
        assert got[0].response_ids == got[1].response_ids and sorted(r.reward for r in got) == [0.0, 1.0]
    finally:
        engine.close()


def seeded_agent(seed: int):
    async def agent_with_seed(task, client):
        messages = [{"role": "user", "content": f"what is {task} + 7 ?"}]
        for turn in range(2):
            answer = await client.chat.completions.create(
                model="m", messages=messages, max_tokens=8, temperature=1.0, seed=seed
            )
            messages += [
                {"role": "assistant", "content": answer.choices[0].message.content},
                {"role": "user", "content": f"and then {turn} ?"},
            ]
        return float(task)

    return agent_with_seed


def test_group_members_that_send_one_seed_sample_with_seeds_of_their_own(actor, tokenizer):
    """Both agents of a group send seed=7 (and repeat it on every request): member j samples with
    ``sample_seed(7, j)`` -- member 0 with 7 itself -- exactly as a lone episode with that seed does."""
    from oppo_engine.sched.prompts import sample_seed

    steps = run(actor, tokenizer, "oppo", [3], fn=seeded_agent(7))
    members = {r.sample_index: r for rollouts, _ in steps for r in rollouts}
    assert members[0].response_ids != members[1].response_ids  # they no longer sample alike
    for j, member in members.items():
        engine = make_engine(actor, tokenizer, "oppo")
        engine.serve()
        try:
            engine.add_agents(seeded_agent(sample_seed(7, j)), [3])
            deadline, alone = time.monotonic() + DEADLINE_S, []
            while not alone:
                assert time.monotonic() < deadline
                alone = engine.step().rollouts
        finally:
            engine.close()
        assert alone[0].prompt_ids == member.prompt_ids and alone[0].response_ids == member.response_ids


def test_a_checkpoint_keeps_queued_groups_whole_and_failed_groups_awaiting_their_report():
    """``PromptQueue.state_dict``: a group of ``add_group`` (n agents on one task) loads as one group again
    (one group id, ``group_size`` n, samples 0..n-1, their seeds), and a group of ``add_failed`` that no step
    has reported yet is reported by the loading queue's next ``take_failed``."""
    from oppo_engine.sched.prompts import PromptQueue

    def queue() -> PromptQueue:
        return PromptQueue(SamplingParams(seed=7), max_model_len=64, vocab_size=128)

    saved = queue()
    saved.add([[1, 2, 3]], None)
    saved.add_group([[4, 5], [6, 7, 8]], [SamplingParams(seed=11), SamplingParams(seed=12)], [None, None])
    saved.add([[9]], None)
    saved.add_failed([[10, 11], []], ["agent raised", "sample 0 of its group failed: agent raised"])
    loaded = queue()
    loaded.load_state_dict(saved.state_dict())
    for q in (saved, loaded):
        seqs = q.take(4, wait=False)
        assert [s.prompt_ids for s in seqs] == [[1, 2, 3], [4, 5], [6, 7, 8], [9]]
        lone, *members, last = seqs
        assert [s.group_n for s in seqs] == [1, 2, 2, 1]
        assert members[0].group_id == members[1].group_id != lone.group_id
        assert [(s.sample_index, s.seed) for s in members] == [(0, 11), (1, 12)]
        ((_, prompts, errors),) = q.take_failed()
        assert prompts == [[10, 11], []] and errors[0] == "agent raised"
