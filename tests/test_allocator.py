"""The C++ page allocator against a pure-Python model of itself.

The model keeps the free list in the allocator's exact order (LIFO; ``free`` pushes its ids in reverse so the
next ``alloc`` returns them in the order given), so every generated sequence of calls is checked on exact page
ids, not only on counts.
"""

from __future__ import annotations

import random
import sys
import threading
import time
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from oppo_engine.ops import PageAllocator


class AllocatorModel:
    """What the allocator should hold: the free list (``free_list[-1]`` is handed out next) and refcounts."""

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.free_list = list(range(num_pages - 1, -1, -1))
        self.refcount = [0] * num_pages

    def alloc(self, n: int) -> list[int] | None:
        if n > len(self.free_list):
            return None
        ids = [self.free_list.pop() for _ in range(n)]
        for i in ids:
            self.refcount[i] = 1
        return ids

    def free(self, ids: list[int]) -> None:
        for i in reversed(ids):
            self.refcount[i] -= 1
            if self.refcount[i] == 0:
                self.free_list.append(i)

    def incref(self, ids: list[int]) -> None:
        for i in ids:
            self.refcount[i] += 1

    def allocated(self) -> list[int]:
        return [i for i, rc in enumerate(self.refcount) if rc > 0]


def assert_matches_model(alloc: PageAllocator, model: AllocatorModel) -> None:
    refcounts = [alloc.refcount(i) for i in range(model.num_pages)]
    assert refcounts == model.refcount
    assert alloc.num_free() == len(model.free_list)
    # NOTE: the invariant the engine's leak checks rely on.
    assert alloc.num_free() + sum(rc > 0 for rc in refcounts) == alloc.num_pages


class AllocatorMachine(RuleBasedStateMachine):
    """Random alloc/free/incref sequences, valid and invalid, each checked against ``AllocatorModel``."""

    @initialize(num_pages=st.integers(1, 12))
    def create(self, num_pages: int) -> None:
        self.alloc = PageAllocator(num_pages)
        self.model = AllocatorModel(num_pages)

    def _bad_call_changes_nothing(self, method, ids: list[int]) -> None:
        before = [self.alloc.refcount(i) for i in range(self.model.num_pages)], self.alloc.num_free()
        with pytest.raises(ValueError):
            method(ids)
        after = [self.alloc.refcount(i) for i in range(self.model.num_pages)], self.alloc.num_free()
        # The free list's order is checked too: the model is left as it was, so later allocs must match it.
        assert after == before

    @rule(data=st.data())
    def alloc_returns_the_models_ids_or_none(self, data) -> None:
        n = data.draw(st.integers(0, self.model.num_pages + 2), label="n")
        expected = self.model.alloc(n)
        assert self.alloc.alloc(n) == expected

    @precondition(lambda self: self.model.allocated())
    @rule(data=st.data())
    def free_held_references(self, data) -> None:
        held = [i for i, rc in enumerate(self.model.refcount) for _ in range(rc)]
        picks = data.draw(st.lists(st.integers(0, len(held) - 1), min_size=1, unique=True), label="picks")
        ids = [held[k] for k in picks]  # a sub-multiset of the held references, in random order
        self.alloc.free(ids)
        self.model.free(ids)

    @precondition(lambda self: self.model.allocated())
    @rule(data=st.data())
    def incref_allocated_pages(self, data) -> None:
        ids = data.draw(
            st.lists(st.sampled_from(self.model.allocated()), min_size=1, max_size=6), label="ids"
        )
        self.alloc.incref(ids)
        self.model.incref(ids)

    @rule(data=st.data())
    def free_of_an_unallocated_page_raises_and_changes_nothing(self, data) -> None:
        unallocated = [i for i, rc in enumerate(self.model.refcount) if rc == 0]
        if not unallocated:
            return
        bad = data.draw(st.sampled_from(unallocated), label="bad")
        ids = self.model.allocated()[:2] + [bad]  # valid ids first: nothing of them may be freed either
        self._bad_call_changes_nothing(self.alloc.free, data.draw(st.permutations(ids), label="ids"))

    @precondition(lambda self: self.model.allocated())
    @rule(data=st.data())
    def free_beyond_refcount_raises_and_changes_nothing(self, data) -> None:
        page = data.draw(st.sampled_from(self.model.allocated()), label="page")
        ids = [page] * (self.model.refcount[page] + 1)
        self._bad_call_changes_nothing(self.alloc.free, data.draw(st.permutations(ids), label="ids"))

    @rule(data=st.data())
    def out_of_range_ids_raise_and_change_nothing(self, data) -> None:
        bad = data.draw(
            st.one_of(st.integers(-(2**40), -1), st.integers(self.model.num_pages, 2**40)), label="bad"
        )
        valid = self.model.allocated()[:1]
        method = data.draw(st.sampled_from([self.alloc.free, self.alloc.incref]), label="method")
        self._bad_call_changes_nothing(method, valid + [bad])

    @rule(data=st.data())
    def incref_of_an_unallocated_page_raises_and_changes_nothing(self, data) -> None:
        unallocated = [i for i, rc in enumerate(self.model.refcount) if rc == 0]
        if not unallocated:
            return
        bad = data.draw(st.sampled_from(unallocated), label="bad")
        self._bad_call_changes_nothing(self.alloc.incref, self.model.allocated()[:2] + [bad])

    @invariant()
    def refcounts_and_free_count_match_the_model(self) -> None:
        if hasattr(self, "model"):
            assert_matches_model(self.alloc, self.model)


TestAllocatorMatchesModel = AllocatorMachine.TestCase
TestAllocatorMatchesModel.settings = settings(
    max_examples=200, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


def test_fresh_allocator_hands_out_ids_in_order():
    alloc = PageAllocator(8)
    assert alloc.num_pages == 8 and alloc.num_free() == 8
    assert alloc.alloc(3) == [0, 1, 2]
    assert alloc.alloc(0) == []
    assert alloc.alloc(2) == [3, 4]
    assert [alloc.refcount(i) for i in range(8)] == [1] * 5 + [0] * 3


def test_freed_pages_are_reused_first_in_the_order_they_were_freed():
    alloc = PageAllocator(8)
    assert alloc.alloc(5) == [0, 1, 2, 3, 4]
    alloc.free([3, 1])
    assert alloc.alloc(1) == [3]
    alloc.free([4])
    assert alloc.alloc(3) == [4, 1, 5]


def test_shared_page_returns_to_the_free_list_only_after_its_last_reference():
    alloc = PageAllocator(4)
    [page] = alloc.alloc(1)
    alloc.incref([page, page])
    assert alloc.refcount(page) == 3
    alloc.free([page, page])
    assert alloc.refcount(page) == 1 and alloc.num_free() == 3
    alloc.free([page])
    assert alloc.refcount(page) == 0 and alloc.num_free() == 4


def test_exhaustion_returns_none_and_takes_nothing():
    alloc = PageAllocator(4)
    held = alloc.alloc(3)
    assert alloc.alloc(2) is None
    assert alloc.num_free() == 1
    assert alloc.alloc(1) == [3]
    assert alloc.alloc(1) is None
    alloc.free(held)
    assert alloc.alloc(4) is None and alloc.num_free() == 3


@pytest.mark.parametrize("num_pages", [0, -1])
def test_non_positive_num_pages_raises(num_pages):
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(num_pages)


def test_negative_alloc_raises():
    alloc = PageAllocator(2)
    with pytest.raises(ValueError, match="n must be"):
        alloc.alloc(-1)
    assert alloc.num_free() == 2


def test_refcount_of_an_out_of_range_id_raises():
    alloc = PageAllocator(2)
    for bad in (-1, 2):
        with pytest.raises(ValueError, match="outside"):
            alloc.refcount(bad)


def test_double_free_raises_and_changes_nothing():
    alloc = PageAllocator(4)
    ids = alloc.alloc(2)
    alloc.free([ids[1]])
    with pytest.raises(ValueError, match="freed more times"):
        alloc.free(ids)
    assert alloc.refcount(ids[0]) == 1 and alloc.num_free() == 3
    assert alloc.alloc(1) == [ids[1]]


def _worker(alloc: PageAllocator, seed: int, ops: int, owned: list[int], errors: list[BaseException]) -> None:
    """Random alloc/free/incref on pages this worker owns; ``owned`` holds one entry per reference."""
    rng = random.Random(seed)
    try:
        for _ in range(ops):
            r = rng.random()
            if r < 0.45:
                ids = alloc.alloc(rng.randint(1, 6))
                if ids is not None:
                    owned.extend(ids)
            elif r < 0.85 and owned:
                rng.shuffle(owned)
                k = rng.randint(1, min(len(owned), 6))
                alloc.free(owned[-k:])
                del owned[-k:]
            elif owned:
                ids = rng.sample(owned, min(len(owned), 3))
                alloc.incref(ids)
                owned.extend(ids)
    except BaseException as e:  # noqa: BLE001 - surfaced by the main thread
        errors.append(e)


def test_two_threads_never_own_the_same_page_and_the_invariant_holds():
    num_pages = 64
    alloc = PageAllocator(num_pages)
    owned: list[list[int]] = [[], []]
    errors: list[BaseException] = []
    threads = [
        threading.Thread(target=_worker, args=(alloc, seed, 5000, owned[seed], errors)) for seed in range(2)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    a, b = Counter(owned[0]), Counter(owned[1])
    assert not set(a) & set(b), "a page is owned by both threads"
    refcounts = [alloc.refcount(i) for i in range(num_pages)]
    assert refcounts == [a[i] + b[i] for i in range(num_pages)]
    assert alloc.num_free() + sum(rc > 0 for rc in refcounts) == num_pages
    alloc.free(owned[0] + owned[1])
    assert alloc.num_free() == num_pages
    assert sorted(alloc.alloc(num_pages)) == list(range(num_pages))


def _waiter_progresses_during(busy_loop, timeout_s: float) -> bool:
    """Whether a thread waiting for the GIL runs while the main thread spins in ``busy_loop`` for up to
    ``timeout_s``.

    With the switch interval far above ``timeout_s``, the interpreter never forces the GIL away from the main
    thread, so the waiter can only run if ``busy_loop`` releases the GIL itself.
    """
    go = threading.Event()
    progressed: list[int] = []

    def waiter() -> None:
        go.wait()
        progressed.append(1)

    old_interval = sys.getswitchinterval()
    thread = threading.Thread(target=waiter)
    thread.start()
    sys.setswitchinterval(100.0)
    try:
        go.set()
        deadline = time.monotonic() + timeout_s
        while not progressed and time.monotonic() < deadline:
            busy_loop()
        result = bool(progressed)
    finally:
        sys.setswitchinterval(old_interval)
        thread.join()
    return result


def test_allocator_calls_release_the_gil():
    num_pages = 100_000
    alloc = PageAllocator(num_pages)

    def alloc_and_free_many() -> None:
        # Freeing 100k pages takes milliseconds of C++ work: a window the waiting thread cannot miss.
        alloc.free(alloc.alloc(num_pages))

    def pure_python() -> None:
        sum(range(100_000))

    # The control shows the harness can tell: a loop that holds the GIL starves the waiting thread.
    assert not _waiter_progresses_during(pure_python, timeout_s=0.3)
    assert _waiter_progresses_during(alloc_and_free_many, timeout_s=30.0)
    assert alloc.num_free() == num_pages
