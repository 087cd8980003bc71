"""ActorScheduler and ScorerScheduler bookkeeping under random workloads and tight page budgets.

The schedulers never read tensors, so the model is replaced here by a deterministic function of a
sequence's tokens (what a seeded sampler is to the scheduler); the properties are the scheduler's own:
every prompt finishes, preemption never changes a sequence's tokens, pages never leak, the arena's
invariant holds after every scheduling decision, and every scheduled chunk is consistent with the cache.
"""

from __future__ import annotations

import torch
from hypothesis import event, given, settings
from hypothesis import strategies as st

from oppo_engine.cache import KVArena, KVCacheManager, KVSpec
from oppo_engine.config import SamplingParams
from oppo_engine.model.scorer import Scorer
from oppo_engine.sched.scheduler import ActorScheduler
from oppo_engine.sched.scorer import ScorerScheduler
from oppo_engine.sched.sequence import SeqStatus, Sequence

EOS = 0
VOCAB = 50
SPEC = KVSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype=torch.float32)


def next_token(seq: Sequence) -> int:
    """The 'model': a hash of the sequence so far, a token id below 200; hits EOS now and then."""
    h = (
        seq.seed * 1_000_003 + sum((i + 1) * t for i, t in enumerate(seq.prompt_ids + seq.response_ids))
    ) % 997
    return h % VOCAB


def reference_response(prompt: list[int], seed: int, max_new: int, max_model_len: int) -> list[int]:
    seq = Sequence(0, 0, list(prompt), SamplingParams(max_new_tokens=max_new), seed)
    while True:
        tok = next_token(seq)
        seq.response_ids.append(tok)
        if tok == EOS or len(seq.response_ids) >= max_new or seq.num_tokens >= max_model_len:
            return seq.response_ids


class PrefixScorer(Scorer):
    """A scorer without a model: it records the tokens it is fed; its result is the whole sequence."""

    field = "reward"

    def __init__(self, cache: KVCacheManager) -> None:
        self.cache = cache
        self.seen: dict[int, list[int]] = {}

    def begin(self, seq_id, prompt_len, temperature) -> None:
        self.seen[seq_id] = []

    def prefill(self, chunks) -> None:
        for c in chunks:
            self.seen[c.seq.seq_id].extend(c.token_ids)

    def finish(self, seq_id, prompt_ids, response_ids) -> list[int]:
        return self.seen.pop(seq_id)

    def release(self, seq_id) -> None:
        super().release(seq_id)
        self.seen.pop(seq_id, None)


def check_invariant(arena: KVArena, managers: list[KVCacheManager]) -> None:
    assert arena.num_free_pages() + sum(m.num_pages_used for m in managers) == arena.num_pages


workloads = st.lists(
    st.tuples(st.integers(1, 40), st.integers(1, 40)),  # (prompt length, max_new_tokens)
    min_size=1,
    max_size=16,
)


@settings(max_examples=150, deadline=None)
@given(
    work=workloads,
    page_size=st.sampled_from([8, 16]),
    spare_pages=st.integers(0, 6),
    max_num_seqs=st.integers(1, 16),
    token_budget=st.integers(1, 64),
)
def test_every_prompt_finishes_with_unchanged_tokens_and_no_page_leaks(
    work, page_size, spare_pages, max_num_seqs, token_budget
):
    max_model_len = 64
    pages_per_seq = -(-max_model_len // page_size)
    # The engine guarantees one max_model_len sequence fits the actor and the reward model together.
    arena = KVArena(
        {"actor": SPEC, "reward": SPEC}, page_size=page_size, num_pages=2 * pages_per_seq + spare_pages
    )
    actor_cache, reward_cache = KVCacheManager(arena, "actor"), KVCacheManager(arena, "reward")
    sched = ActorScheduler(
        actor_cache,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=token_budget,
        max_model_len=max_model_len,
        eos_token_ids=[EOS],
    )
    seqs = [
        Sequence(
            i, i, [1 + (i * 7 + j) % (VOCAB - 1) for j in range(plen)], SamplingParams(max_new_tokens=mnt), i
        )
        for i, (plen, mnt) in enumerate(work)
    ]
    for seq in seqs:
        sched.add(seq)
    finished = []
    for _ in range(10_000):
        if not sched.has_work:
            break
        chunks = sched.schedule()
        assert chunks, "no progress"
        check_invariant(arena, [actor_cache, reward_cache])
        assert sum(len(c.token_ids) for c in chunks) <= token_budget
        assert len({c.seq.seq_id for c in chunks}) == len(chunks)
        for c in chunks:
            assert c.seq.status is SeqStatus.RUNNING
            # The chunk's tokens are the sequence's own, at the positions its slots were reserved for.
            assert (
                c.token_ids == (c.seq.prompt_ids + c.seq.response_ids)[c.start : c.start + len(c.token_ids)]
            )
            assert actor_cache.num_tokens(c.seq.seq_id) == c.start + len(c.token_ids) == c.seq.num_computed
            pages = actor_cache.pages(c.seq.seq_id)
            assert c.slots == [
                pages[t // page_size] * page_size + t % page_size for t in range(c.start, c.seq.num_computed)
            ]
        for c in chunks:
            if c.samples and sched.append_token(c.seq, next_token(c.seq), 0.0, 0):
                finished.append(c.seq)
    else:
        raise AssertionError("scheduler did not drain")
    event(f"preempted: {sched.num_preemptions > 0}")
    assert sorted(s.seq_id for s in finished) == list(range(len(seqs)))
    for seq in seqs:
        assert seq.response_ids == reference_response(
            seq.prompt_ids, seq.seed, seq.sampling.max_new_tokens, max_model_len
        )
    assert arena.num_free_pages() == arena.num_pages

    # Scoring the finished sequences in the same arena: every one gets its final chunk, nothing leaks.
    rsched = ScorerScheduler(PrefixScorer(reward_cache), max_num_batched_tokens=token_budget)
    for seq in finished:
        rsched.add(seq)
        rsched.hand_off(seq, seq.num_tokens, final=True)
    scored = []
    while rsched.has_work:
        chunks = rsched.schedule()
        assert chunks, "no progress"
        check_invariant(arena, [actor_cache, reward_cache])
        for c in chunks:
            assert (
                c.token_ids == (c.seq.prompt_ids + c.seq.response_ids)[c.start : c.start + len(c.token_ids)]
            )
            assert reward_cache.num_tokens(c.seq.seq_id) == c.start + len(c.token_ids)
        rsched.scorer.prefill(chunks)
        for c in chunks:
            if c.samples:
                # The scorer saw every token exactly once, in order, even across preemptions.
                assert rsched.complete(c.seq) == c.seq.prompt_ids + c.seq.response_ids
                scored.append(c.seq.seq_id)
    assert sorted(scored) == list(range(len(seqs)))
    assert arena.num_free_pages() == arena.num_pages


class _PendingEvent:
    """A CUDA event whose lane's kernels are still running (never completes here): the freed pages stay
    pending."""

    def query(self) -> bool:
        return False

    def synchronize(self) -> None:
        raise AssertionError("the scheduler must not wait for an event")


def test_preemption_reuses_pages_pending_behind_the_lanes_own_event_and_takes_one_victim():
    # 4 pages of 8 tokens; three 8-token prompts hold 3. On CUDA a preempted sequence's pages pend behind
    # the actor lane's event: the actor lane may reuse them at once (its stream orders the kernels), so
    # one victim is enough for the sequence that needs a page.
    arena = KVArena({"actor": SPEC}, page_size=8, num_pages=4)
    cache = KVCacheManager(arena, "actor")
    arena.set_lane("actor", "actor-stream")
    cache.free_event = _PendingEvent
    sched = ActorScheduler(cache, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64)
    seqs = [Sequence(i, i, [1 + i] * 8, SamplingParams(max_new_tokens=20), i) for i in range(3)]
    for seq in seqs:
        sched.add(seq)
    assert len(sched.schedule()) == 3  # the three prompts, one page each
    for seq in seqs:
        sched.append_token(seq, 5, 0.0, 0)
    chunks = sched.schedule()  # every sequence needs a second page; one is free
    assert sched.num_preemptions == 1 and seqs[2].status is SeqStatus.WAITING
    assert [c.seq.seq_id for c in chunks] == [0, 1]
    assert arena.num_pending_pages == 0 and arena.num_free_pages() == 0


def test_admission_leaves_the_pages_an_older_sequence_needs_for_its_pending_tokens():
    """Regression (the simulator, seeds 107/135/208/227): a sample whose first chunk stops at its group's
    prefix left budget for a younger sequence, admitted into the pages the sample needed for the rest of its
    prompt; the sample then preempted it, but the victim's frees were deferred (its kernels on them), so it
    preempted itself too, and again at every step. Now admission leaves those pages."""
    arena = KVArena({"m": SPEC}, page_size=8, num_pages=6)
    cache = KVCacheManager(arena, "m")
    cache.free_event = _PendingEvent
    sched = ActorScheduler(cache, max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64)
    params = SamplingParams(max_new_tokens=40, n=2)
    # Prompt of 21 tokens (a prefix of 20) and 19 response tokens kept over a preemption: 5 pages.
    old = Sequence(0, 0, list(range(4, 25)), params, seed=1, response_ids=[5] * 19)
    young = Sequence(2, 1, [7], params, seed=2, response_ids=[5] * 10)  # 11 tokens: 2 pages
    sched.add(old)
    sched.add(young)
    computed = []
    for _ in range(3):
        for chunk in sched.schedule():
            assert chunk.seq is old, "the young sequence took the old one's pages"
        computed.append(old.num_computed)
    assert computed == [16, 20, 36]  # 16, then the prefix chunk, then on: never preempted
    assert old.num_preemptions == 0


def test_a_starved_run_gives_up_the_kv_of_the_sequences_it_leaves_out_and_only_then():
    """Regression (tests/test_soak.py on CI): a group the quarantine took out of a step, or a group a probe
    leaves out, keeps the actor KV the step found it with. No run scheduled it, so nothing could free those
    pages, and a sequence needing the actor's whole reserve waited for them until the 10 s stall check.
    The run's scheduler now gives them up when starved -- after the kept pages, before any KV of its own."""
    arena = KVArena({"actor": SPEC, "scorer": SPEC}, page_size=8, num_pages=8)
    arena.set_reserve("actor", 4)  # one sequence of max_model_len=32 in each model, no spare page
    arena.set_reserve("scorer", 4)
    cache, scorer = KVCacheManager(arena, "actor"), KVCacheManager(arena, "scorer")
    sched = ActorScheduler(
        cache, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32, eos_token_ids=[EOS]
    )
    params = SamplingParams(max_new_tokens=32)
    out = Sequence(0, 0, list(range(4, 20)), params, seed=1)  # left out, holding 16 tokens: 2 pages
    assert cache.append_slots(out.seq_id, 16) is not None
    out.num_computed = 16
    assert scorer.append_slots("scored", 32) is not None  # the scorer holds its whole reserve
    short = Sequence(1, 1, [7] * 8, params, seed=2)  # 1 page: fits beside the left-out KV
    long = Sequence(2, 2, [8] * 24, params, seed=3)  # 3 pages: only if the left-out KV goes
    sched.leave_out([out])
    sched.add(short)
    assert [c.seq for c in sched.schedule()] == [short]  # not starved: the left-out KV stays
    assert cache.num_tokens(out.seq_id) == 16 and out.num_computed == 16
    sched.append_token(short, EOS, 0.0, 0)  # finished: its page back
    sched.add(long)
    assert [c.seq for c in sched.schedule()] == [long]  # starved: the left-out KV went
    assert out.seq_id not in cache and out.num_computed == 0
    assert sched.detach_all() == [long] and sched.schedule() == []


def test_a_starved_run_gives_up_the_kv_of_a_sequence_a_probe_set_aside():
    """A probe stops a non-rewindable environment's sequence at its turn's end (``set_aside``): it leaves
    every queue with its KV, which no run schedules any more. Like the KV of the sequences a run leaves out,
    it is given up when the run is starved, or a sequence needing the actor's whole reserve would wait for
    pages nothing frees."""
    arena = KVArena({"actor": SPEC, "scorer": SPEC}, page_size=8, num_pages=8)
    arena.set_reserve("actor", 4)
    arena.set_reserve("scorer", 4)
    cache, scorer = KVCacheManager(arena, "actor"), KVCacheManager(arena, "scorer")
    sched = ActorScheduler(
        cache, max_num_seqs=4, max_num_batched_tokens=64, max_model_len=32, eos_token_ids=[EOS]
    )
    params = SamplingParams(max_new_tokens=32)
    aside = Sequence(0, 0, list(range(4, 20)), params, seed=1)
    sched.add(aside)
    assert [c.seq for c in sched.schedule()] == [aside]  # its prompt prefilled: 2 pages
    sched.set_aside(aside)
    assert scorer.append_slots("scored", 32) is not None  # the scorer holds its whole reserve
    long = Sequence(2, 2, [8] * 24, params, seed=3)  # 3 pages: only if the set-aside KV goes
    sched.add(long)
    assert [c.seq for c in sched.schedule()] == [long]
    assert aside.seq_id not in cache and aside.num_computed == 0


def test_only_the_run_s_listening_environments_hear_a_forward():
    """``EnvDriver.decoded(live)``: an environment that follows its turn token by token hears only of a
    sequence of this run; a decoding one outside it (a quarantined group left out of the final attempt)
    hears nothing, as ``collect(live)`` takes only the run's answers. Before, every RUNNING one heard."""
    from types import SimpleNamespace

    from oppo_engine.sched.envs import EnvDriver

    heard: list[int] = []

    class Listening:
        def __init__(self, seq_id: int) -> None:
            self.seq_id = seq_id

        def decoded(self, response_ids, logprobs, turn_start) -> None:
            heard.append(self.seq_id)

    driver = EnvDriver(None, vocab_size=64, max_model_len=64)
    params = SamplingParams(max_new_tokens=8)
    seqs = [Sequence(i, i, [5, 6], params, seed=i) for i in range(3)]
    for seq in seqs:
        seq.status = SeqStatus.RUNNING
        seq.episode = SimpleNamespace(env=Listening(seq.seq_id), turn_start=0)
        driver.listening[seq.seq_id] = seq
    assert driver.decoded({0, 2}) == [] and heard == [0, 2]
