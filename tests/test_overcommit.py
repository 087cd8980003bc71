"""Bookkeeping of the inter-step overlap, with exact ids: the overcommit buffer and the batch cut, cache
truncation (rollback), and pages to host memory and back (release, scorer preemption)."""

from __future__ import annotations

import torch
from test_kv_cache import check_invariant, make_arena

from oppo_engine.cache import KVCacheManager
from oppo_engine.cache.swap import swap_in, swap_in_seq, swap_out, swap_out_seq
from oppo_engine.config import SamplingParams
from oppo_engine.sched.overcommit import BatchCut, OvercommitBuffer, deferral_bound
from oppo_engine.sched.sequence import SeqStatus, Sequence


def seqs(*deferred: int) -> list[Sequence]:
    return [
        Sequence(i, i, [5, 6], SamplingParams(), seed=i, deferred_steps=d) for i, d in enumerate(deferred)
    ]


def test_fill_takes_carried_sequences_first_then_new_ones_up_to_b_plus_delta():
    buffer = OvercommitBuffer()
    buffer.carried = seqs(2, 1)
    new = iter(seqs(0, 0, 0, 0, 0)[2:])
    asked = []

    def take(n):
        asked.append(n)
        return [next(new) for _ in range(n)]

    got = buffer.fill(take, in_flight=4)
    assert [s.seq_id for s in got] == [0, 1, 2, 3] and asked == [2] and len(buffer) == 0
    buffer.carried = seqs(1, 1, 1)
    assert [s.seq_id for s in buffer.fill(take, in_flight=2)] == [0, 1, 2]  # Δ shrank: none dropped
    assert asked == [2]


def test_carry_keeps_the_rest_in_order_and_counts_a_deferral_each():
    buffer = OvercommitBuffer()
    step = seqs(1, 0, 0, 0)
    buffer.carry(step, batch=[step[2], step[0]])
    assert [(s.seq_id, s.deferred_steps) for s in buffer.carried] == [(1, 1), (3, 1)]
    buffer.put_back(seqs(5)[:1])
    assert [s.seq_id for s in buffer.carried] == [0, 1, 3]


def test_the_cut_reserves_places_for_due_sequences_and_takes_the_first_others_to_finish():
    step = seqs(2, 2, 0, 0, 0)  # two due (max_deferrals=2), B = 3
    cut = BatchCut(step, batch_size=3, max_deferrals=2)
    for i in (3, 4, 2):  # three fresh ones finish first: only one place is theirs
        cut.finished(step[i])
    assert [s.seq_id for s in cut.batch] == [3] and not cut.determined
    cut.finished(step[1])
    cut.finished(step[0])
    assert [s.seq_id for s in cut.batch] == [3, 1, 0] and cut.determined and not cut.scored()
    for s in cut.batch:
        s.status = SeqStatus.SCORED
    assert cut.scored()


def test_more_due_sequences_than_b_go_oldest_first():
    step = seqs(3, 3, 3, 0)
    cut = BatchCut(step, batch_size=2, max_deferrals=3)
    for s in reversed(step):
        cut.finished(s)
    assert [s.seq_id for s in cut.batch] == [1, 0]


def test_without_overcommit_the_batch_is_every_sequence_and_fewer_than_b_is_all_of_them():
    step = seqs(0, 0, 0)
    for cut in (BatchCut(step, None, None), BatchCut(step, batch_size=5, max_deferrals=1)):
        for s in step:
            cut.finished(s)
        assert cut.determined and len(cut.batch) == 3


def test_deferral_bound():
    assert deferral_bound(8, 4, 8) == 4  # Δ <= B: exact
    assert deferral_bound(8, 4, 9) == 5
    assert deferral_bound(2, 1, 5) == 3


def test_truncate_frees_the_pages_past_the_kept_tokens():
    arena = make_arena(num_pages=8)
    actor = KVCacheManager(arena, "actor")  # 8 tokens per page
    actor.append_slots("a", 20)
    pages = actor.pages("a")
    assert len(pages) == 3
    actor.truncate("a", 9)
    assert actor.pages("a") == pages[:2] and actor.num_tokens("a") == 9
    assert actor.append_slots("a", 1) == [pages[1] * 8 + 1]  # the next token goes right after
    actor.truncate("a", 30)  # more than it holds: nothing happens
    assert actor.num_tokens("a") == 10
    actor.truncate("a", 0)
    assert "a" not in actor
    check_invariant(arena, [actor])
    assert arena.num_free_pages() == 8


def _fill(arena, cache, seq_id, n):
    cache.append_slots(seq_id, n)
    view = arena.page_view()
    for p in cache.pages(seq_id):
        view[p] = torch.randint(0, 256, (arena.page_bytes,), dtype=torch.uint8)


def test_release_and_rebuild_bring_every_page_back_byte_for_byte_under_new_ids():
    arena = make_arena(num_pages=8)
    caches = {"actor": KVCacheManager(arena, "actor"), "reward": KVCacheManager(arena, "reward")}
    caches["actor"].append_slots("gap", 8)  # a page that will not come back: new ids differ
    _fill(arena, caches["actor"], "a", 17)
    _fill(arena, caches["reward"], "a", 40)
    caches["actor"].free("gap")
    before = {
        n: (c.pages("a"), c.num_tokens("a"), arena.page_view()[c.pages("a")].clone())
        for n, c in caches.items()
    }
    host = swap_out(arena, caches)
    assert host.num_pages() == 5 and host.num_tokens() == {"actor": 17, "reward": 40}
    assert all(c.num_sequences == 0 for c in caches.values())
    arena.release()
    assert arena.released
    arena.rebuild()
    assert swap_in(host, arena, caches) == {"actor": 17, "reward": 40}
    for name, (_, n, data) in before.items():
        assert caches[name].num_tokens("a") == n
        assert torch.equal(arena.page_view()[caches[name].pages("a")], data)
    assert caches["actor"].pages("a") != before["actor"][0]
    check_invariant(arena, list(caches.values()))


def test_one_sequence_swapped_out_and_back_keeps_its_bytes_and_frees_its_pages_meanwhile():
    arena = make_arena(num_pages=4)
    reward = KVCacheManager(arena, "reward")
    _fill(arena, reward, "r", 40)
    data = arena.page_view()[reward.pages("r")].clone()
    host = swap_out_seq(reward, "r")
    assert "r" not in reward and arena.num_free_pages() == 4
    other = KVCacheManager(arena, "actor")
    other.append_slots("x", 8 * 3)  # the pool is now short for "r"
    assert swap_in_seq(reward, "r", host) is None and "r" not in reward
    other.free("x")
    assert swap_in_seq(reward, "r", host) == 40
    assert torch.equal(arena.page_view()[reward.pages("r")], data)
    check_invariant(arena, [reward, other])
