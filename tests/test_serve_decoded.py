"""``AgentEnv.decoded``, the hook that streams a served episode's turn, driven as the step loop drives it: a
real ``Sequence`` and ``Episode`` decoding a turn token by token, ``EnvDriver.decoded`` after every forward
(none in a quarantine probe: ``EnvDriver.probing``), steps that fail and are rolled back to their snapshot
(``Sequence.restore``, then ``EnvDriver.rewound`` as ``StepLoop.abort`` calls it) and retried, the retry
decoding the same tokens or others from any position on. The serving side only records what it is handed.

Properties: what goes out is exactly what the reference -- the check the hook made before, the whole turn
against what went out after every forward -- sends, call by call; a retry that decodes the same tokens sends
nothing twice, and the tokens (and log-probs) streamed concatenate to the turn; a retry that decodes a
token that went out differently fails the episode (``ROLLED_BACK``) as it decodes it, however early in the
turn, and nothing goes out after it. And a call costs its new tokens: over a turn the hook reads each token
a bounded number of times (before, the whole turn after every forward: quadratic). ``Posts``, which carries
what the hook hands the serving loop, runs the calls in order, each once, on one wake-up of the loop."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st
from serve_models import RecordedServing

from oppo_engine import SamplingParams
from oppo_engine.sched.envs import EnvDriver
from oppo_engine.sched.episode import Episode
from oppo_engine.sched.sequence import SeqStatus, Sequence
from oppo_engine.serve.episode import AgentEnv
from oppo_engine.serve.stream import ROLLED_BACK


class _WholeTurnCheck:
    """The reference: the hook as it was, comparing the whole turn so far with what went out after every
    forward (so it needs no notice of a rollback)."""

    def __init__(self, served: RecordedServing) -> None:
        self.served, self.sent = served, (0, [])

    def decoded(self, response_ids, logprobs, turn_start) -> None:
        start, sent = self.sent if self.sent[0] == turn_start else (turn_start, [])
        turn = response_ids[start:]
        if turn[: len(sent)] != sent[: len(turn)]:
            self.served.post(self.served.fail, ROLLED_BACK)
            return
        if len(turn) > len(sent):
            self.sent = (start, turn)
            self.served.post(self.served.on_tokens, turn[len(sent) :], logprobs[start + len(sent) :])


class _Reads(list):
    """A list that counts the elements its slices read."""

    read = 0

    def __getitem__(self, i):
        if isinstance(i, slice):
            self.read += len(range(*i.indices(len(self))))
        return super().__getitem__(i)


def _turn(earlier: int, response_ids: list[int] | None = None) -> tuple[EnvDriver, Sequence, RecordedServing]:
    """A sequence decoding a turn after ``earlier`` tokens of earlier turns, its ``AgentEnv`` listening."""
    driver = EnvDriver(None, vocab_size=64, max_model_len=4096)
    seq = Sequence(0, 0, [5, 6], SamplingParams(max_new_tokens=4000), seed=0, status=SeqStatus.RUNNING)
    if response_ids is not None:
        seq.response_ids, seq.logprobs = response_ids, _Reads()
    seq.response_ids += [9] * earlier
    seq.logprobs += [0.0] * earlier
    seq.episode = Episode(factory=lambda: None, turn_start=earlier)
    served = RecordedServing()
    seq.episode.env = AgentEnv(served)
    driver.listening[seq.seq_id] = seq
    return driver, seq, served


attempts = st.lists(  # a step's runs: all but the last fail (each a retry, or a probe)
    st.tuples(
        st.integers(0, 12),  # forwards
        st.booleans(),  # a quarantine probe (no decoded())
        st.none() | st.tuples(st.integers(0, 12), st.integers(0, 3)),  # the run decodes token (at, as) anew
    ),
    min_size=1,
    max_size=3,
)


@settings(max_examples=300, deadline=None)
@given(earlier=st.integers(0, 3), steps=st.lists(attempts, min_size=1, max_size=5), seed=st.integers(0, 99))
def test_a_streamed_turn_sends_what_the_whole_turn_check_sends_through_rollbacks_and_retries(
    earlier, steps, seed
):
    rng = random.Random(seed)
    model = [rng.randrange(4) for _ in range(400)]  # token i of the turn, as the model decodes it now
    driver, seq, served = _turn(earlier)
    expected = RecordedServing()
    reference = _WholeTurnCheck(expected)

    def run(runs: list) -> bool:
        """One step: its runs, each failed one rolled back; False once the episode failed."""
        snap = seq.snapshot()
        for i, (n, probe, change) in enumerate(runs):
            last = i == len(runs) - 1
            driver.probing = probe and not last  # a probe is always rolled back: a step ends committing
            if change is not None:  # this run decodes differently from the step's start on
                model[len(seq.response_ids) - earlier + change[0]] = change[1]
            for _ in range(n):
                seq.response_ids.append(model[len(seq.response_ids) - earlier])
                seq.logprobs.append(-0.25 * len(seq.logprobs))  # a retry's as exact as its token
                assert driver.decoded({seq.seq_id}) == []
                if not driver.probing:
                    reference.decoded(seq.response_ids, seq.logprobs, earlier)
                assert served.calls == expected.calls
                if served.calls and served.calls[-1] == ("fail", ROLLED_BACK):
                    return False  # the episode fails: the engine drops its sequence at the next forward
            driver.probing = False
            if not last:  # the run failed: back to the step's start, then the next run
                seq.restore(snap, num_cached=0)
                driver.rewound(seq)
        return True

    if all(run(runs) for runs in steps):
        # The turn goes on past what went out (the last step's committing run may have decoded less).
        behind = sum(len(call[1]) for call in served.calls) - (len(seq.response_ids) - earlier)
        if run([(behind + 1, False, None)]):
            sent = [t for call in served.calls for t in call[1]]
            assert sent == seq.response_ids[earlier:], "the streamed tokens are not the turn"
            assert [lp for call in served.calls for lp in call[2]] == seq.logprobs[earlier:]


def test_a_retry_that_decodes_the_same_tokens_sends_nothing_again_and_one_that_differs_early_fails():
    """The turn's 40 tokens go out; the step that decoded them fails and is retried from the turn's start: the
    retry's same 40 tokens send nothing, the next 10 go out once; a second failure, and a retry whose third
    token differs from the one sent 50 forwards before, fails the episode as it decodes that token, and no
    later forward sends anything."""
    driver, seq, served = _turn(2)
    tokens = [random.Random(1).randrange(50) for _ in range(50)]

    def decode(ids: list[int]) -> None:
        for t in ids:
            seq.response_ids.append(t)
            seq.logprobs.append(-1.0)
            driver.decoded({seq.seq_id})

    snap = seq.snapshot()
    decode(tokens[:40])
    seq.restore(snap, num_cached=0)
    driver.rewound(seq)
    decode(tokens[:40])
    assert [c[1] for c in served.calls] == [[t] for t in tokens[:40]]
    decode(tokens[40:])
    assert [c[1] for c in served.calls] == [[t] for t in tokens]
    served.calls.clear()
    seq.restore(snap, num_cached=0)
    driver.rewound(seq)
    decode([tokens[0], tokens[1], tokens[2] + 1])
    assert served.calls == [("fail", ROLLED_BACK)]
    decode(tokens[3:60])
    assert set(served.calls) == {("fail", ROLLED_BACK)}


def test_each_forward_s_call_reads_only_its_new_tokens():
    """Over a turn of 2000 tokens, with a rollback halfway and its retry, the hook reads each token of the
    response (and of the log-probs) a bounded number of times: a call costs its new tokens (before, every
    call copied and compared the whole turn so far: about 2,000,000 reads)."""
    driver, seq, served = _turn(3, _Reads())

    def decode(n: int) -> None:
        for _ in range(n):
            seq.response_ids.append(len(seq.response_ids) % 7)
            seq.logprobs.append(-1.0)
            driver.decoded({seq.seq_id})

    decode(1000)
    snap = seq.snapshot()
    decode(500)
    seq.restore(snap, num_cached=0)
    driver.rewound(seq)
    decode(1000)
    assert sum(len(c[1]) for c in served.calls) == len(seq.response_ids) - 3
    decoded_tokens = 2500
    assert seq.response_ids.read + seq.logprobs.read <= 3 * decoded_tokens


def test_posts_run_in_order_each_once_on_one_wake_up_and_one_that_raises_leaves_the_others():
    """``Posts``: calls posted while the loop is busy run in the order posted, each once, on one wake-up of
    the loop (a ``call_soon_threadsafe`` per forward, not per streaming agent); one that raises (an
    ``Exception`` or another ``BaseException``, as ``CancelledError``) is reported to the loop's exception
    handler and the others still run; a post after they ran wakes the loop again;
    once the loop is closed a post is dropped, and nothing is held."""
    import asyncio
    import threading

    from oppo_engine.serve.server import Posts

    loop = asyncio.new_event_loop()
    reported, ran, busy = [], [], threading.Event()
    loop.set_exception_handler(lambda _, context: reported.append(context["exception"]))
    wake_ups = 0
    call_soon_threadsafe = loop.call_soon_threadsafe

    def counted(*args):
        nonlocal wake_ups
        wake_ups += 1
        return call_soon_threadsafe(*args)

    loop.call_soon_threadsafe = counted
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        posts = Posts(loop)
        call_soon_threadsafe(busy.wait, 10.0)  # the loop is busy while everything is posted

        def boom() -> None:
            raise ValueError("boom")

        def cancelled() -> None:  # a BaseException, not an Exception: the calls after it still run
            raise asyncio.CancelledError("cancelled")

        for i in range(1000):
            posts.post(ran.append, i)
            if i == 500:
                posts.post(boom)
            if i == 700:
                posts.post(cancelled)
        done = threading.Event()
        posts.post(done.set)
        busy.set()
        assert done.wait(10.0)
        assert ran == list(range(1000)) and wake_ups == 1
        assert [str(e) for e in reported] == ["boom", "cancelled"]
        again = threading.Event()
        posts.post(again.set)
        assert again.wait(10.0) and wake_ups == 2
    finally:
        call_soon_threadsafe(loop.stop)
        thread.join(10.0)
    posts.post(ran.append, "late")  # the loop stopped: its wake-up never runs, and the loop closes
    loop.close()
    posts.post(ran.append, "closed")
    assert ran[1000:] == [] and posts._calls == []
