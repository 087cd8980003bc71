"""KVArena and KVCacheManager: exact page ids, slot mappings, and pages flowing between models."""

from __future__ import annotations

import pytest
import torch

from oppo_engine.cache import KVArena, KVCacheManager, KVSpec

ACTOR = KVSpec(num_layers=4, num_kv_heads=2, head_dim=16, dtype=torch.float32)  # 1024 B/token
REWARD = KVSpec(num_layers=1, num_kv_heads=3, head_dim=20, dtype=torch.bfloat16)  # 240 B/token


def make_arena(num_pages: int = 8, page_size: int = 8) -> KVArena:
    return KVArena({"actor": ACTOR, "reward": REWARD}, page_size=page_size, num_pages=num_pages)


def test_page_geometry_follows_the_largest_model():
    arena = make_arena()
    assert arena.page_bytes == 8 * ACTOR.token_bytes
    assert arena.page_size("actor") == 8
    # 8192 B / 240 B = 34 tokens -> 32, the largest power of two that fits.
    assert arena.page_size("reward") == 32
    view = arena.view("reward")
    assert view.shape == (8, 1, 2, 32, 3, 20)
    assert view.stride(0) == arena.page_bytes // 2
    assert view.untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr()


def test_views_of_two_models_alias_the_same_page_bytes():
    arena = make_arena()
    arena.buffer.zero_()
    arena.view("reward")[3].fill_(1.0)
    pages = arena.page_view()
    assert pages[3].count_nonzero() > 0
    assert pages[2].count_nonzero() == 0 and pages[4].count_nonzero() == 0
    # The reward model's page 3 is exactly the bytes of page 3 of the actor's view.
    actor_page = arena.view("actor")[3]
    assert actor_page.data_ptr() == arena.buffer.data_ptr() + 3 * arena.page_bytes


def test_exact_page_ids_and_slot_mapping():
    arena = make_arena()
    m = KVCacheManager(arena, "actor")
    assert m.append_slots("a", 3) == [0, 1, 2]  # page 0
    assert m.append_slots("b", 10) == [8 + i for i in range(8)] + [16, 17]  # pages 1, 2
    assert m.append_slots("a", 6) == [3, 4, 5, 6, 7, 24]  # fills page 0, opens page 3
    assert m.pages("a") == [0, 3] and m.pages("b") == [1, 2]
    assert m.num_tokens("a") == 9 and m.num_tokens("b") == 10
    table = m.block_tables(["a", "b", "unknown"])
    assert table.dtype == torch.int32
    assert table.tolist() == [[0, 3], [1, 2], [0, 0]]
    m.free("b")
    # LIFO reuse: the freed pages come back first, in the order they were held.
    assert m.append_slots("c", 9) == [8 + i for i in range(8)] + [16]


def test_append_is_all_or_nothing_when_short():
    arena = make_arena(num_pages=3)
    m = KVCacheManager(arena, "actor")
    assert m.append_slots("a", 16) is not None
    assert not m.can_append("b", 9)
    assert m.append_slots("b", 9) is None
    assert "b" not in m and arena.num_free_pages() == 1
    assert m.append_slots("a", 9) is None
    assert m.num_tokens("a") == 16 and m.pages("a") == [0, 1]
    assert m.can_append("b", 8) and m.append_slots("b", 8) == [16 + i for i in range(8)]


def test_page_freed_by_one_model_is_reused_by_the_other():
    arena = make_arena(num_pages=2)
    actor = KVCacheManager(arena, "actor")
    reward = KVCacheManager(arena, "reward")
    actor.append_slots("s", 16)
    assert reward.append_slots("s", 1) is None  # arena full
    actor.free("s")
    slots = reward.append_slots("s", 40)  # 32 tokens per reward page: two pages
    assert reward.pages("s") == [0, 1]
    assert slots[:3] == [0, 1, 2] and slots[32] == 32
    assert arena.num_free_pages() == 0
    reward.free("s")
    assert arena.num_free_pages() == 2


def test_free_is_idempotent_and_invariant_holds():
    arena = make_arena(num_pages=5)
    managers = [KVCacheManager(arena, "actor"), KVCacheManager(arena, "reward")]
    managers[0].append_slots(1, 20)
    managers[1].append_slots(1, 33)
    used = sum(m.num_pages_used for m in managers)
    assert arena.num_free_pages() + used == arena.num_pages
    for m in managers:
        m.free(1)
        m.free(1)
    assert arena.num_free_pages() == arena.num_pages


@pytest.mark.parametrize("page_size", [0, 12])
def test_bad_page_size_raises(page_size):
    with pytest.raises(ValueError, match="page_size"):
        make_arena(page_size=page_size)


def test_kv_cache_bytes_too_small_raises():
    with pytest.raises(ValueError, match="kv_cache_bytes"):
        KVArena({"actor": ACTOR}, page_size=8, kv_cache_bytes=100)


class FakeEvent:
    """Stands in for a CUDA event recorded after a lane's last kernel on the freed pages."""

    def __init__(self) -> None:
        self.done = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.done = True


def check_invariant(arena: KVArena, managers) -> None:
    held = sum(m.num_pages_used for m in managers)
    assert held == sum(arena.pages_held(m.name) for m in managers)
    assert arena.num_free_pages() + held + arena.num_pending_pages == arena.num_pages


def test_a_page_freed_after_an_event_is_not_reused_before_the_event_completes():
    arena = make_arena(num_pages=3)
    actor, reward = KVCacheManager(arena, "actor"), KVCacheManager(arena, "reward")
    events: list[FakeEvent] = []

    def new_event() -> FakeEvent:
        events.append(FakeEvent())
        return events[-1]

    actor.free_event = new_event
    actor.append_slots("a", 16)  # pages 0, 1
    actor.free("a")  # the actor lane's kernels on pages 0, 1 may still run
    check_invariant(arena, [actor, reward])
    assert arena.num_pending_pages == 2 and arena.num_free_pages() == 1
    assert reward.append_slots("r", 33) is None  # two pages: only page 2 is safe to reuse
    assert reward.append_slots("r", 1) == [64]  # page 2 (32 reward tokens per page)
    events[0].done = True
    assert reward.append_slots("r", 32) is not None  # reclaimed at the next allocation
    assert reward.pages("r") == [2, 0] and arena.num_pending_pages == 0
    check_invariant(arena, [actor, reward])


def test_reserves_keep_one_sequence_for_every_model_and_pages_flow_beyond_them():
    arena = make_arena(num_pages=8)
    actor, reward = KVCacheManager(arena, "actor"), KVCacheManager(arena, "reward")
    arena.set_reserve("actor", 3)
    arena.set_reserve("reward", 2)
    # The reward model may take everything but the actor's unmet reserve.
    assert reward.num_available_pages() == 5
    assert reward.append_slots("r", 6 * 32) is None
    assert reward.append_slots("r", 5 * 32) is not None
    assert actor.append_slots("a", 3 * 8) is not None  # the reserve is there
    assert actor.append_slots("b", 1) is None  # and nothing more
    reward.free("r")
    # Once the actor holds its reserve, it may take what the reward model does not need for its own.
    assert actor.num_available_pages() == 5 - 2
    check_invariant(arena, [actor, reward])
    with pytest.raises(ValueError, match="reserves"):
        arena.set_reserve("reward", 6)


def test_concurrent_lanes_under_reserves_never_deadlock_or_leak():
    import threading

    arena = make_arena(num_pages=6)
    arena.set_reserve("actor", 2)
    arena.set_reserve("reward", 1)
    managers = [KVCacheManager(arena, "actor"), KVCacheManager(arena, "reward")]
    per_page = {"actor": 8, "reward": 32}
    errors = []

    def lane(m: KVCacheManager, seed: int) -> None:
        rng = torch.Generator().manual_seed(seed)
        held = 0
        try:
            for i in range(2000):
                want = int(torch.randint(1, 4, (), generator=rng))
                if m.append_slots(i, want * per_page[m.name]) is not None:
                    held += 1
                # A lane can always get its reserve once it holds nothing else.
                if held > 1 or torch.rand((), generator=rng) < 0.5:
                    for j in range(i + 1):
                        m.free(j)
                    held = 0
                    got = m.append_slots("probe", arena._reserve[m.name] * per_page[m.name])
                    assert got is not None, f"{m.name} could not get its reserve"
                    m.free("probe")
            # What the last iterations kept goes back too (which they kept depends on the interleaving).
            for j in range(2000):
                m.free(j)
        except AssertionError as e:  # surfaced by the main thread
            errors.append(e)

    threads = [threading.Thread(target=lane, args=(m, i)) for i, m in enumerate(managers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    check_invariant(arena, managers)
    assert arena.num_free_pages() == arena.num_pages


def two_lanes(arena: KVArena) -> tuple[KVCacheManager, KVCacheManager, list[FakeEvent], list[FakeEvent]]:
    """An actor and a reward manager on two lanes (streams), each lane's frees behind its own events."""
    actor, reward = KVCacheManager(arena, "actor"), KVCacheManager(arena, "reward")
    arena.set_lane("actor", "actor-stream")
    arena.set_lane("reward", "scorer-stream")
    actor_events: list[FakeEvent] = []
    reward_events: list[FakeEvent] = []
    for manager, events in ((actor, actor_events), (reward, reward_events)):
        manager.free_event = lambda events=events: events.append(FakeEvent()) or events[-1]
    return actor, reward, actor_events, reward_events


def test_a_slow_lane_event_does_not_hold_another_lanes_completed_frees():
    arena = make_arena(num_pages=6)
    actor, reward, actor_events, reward_events = two_lanes(arena)
    reward.append_slots("r", 64)  # pages 0, 1 (32 reward tokens per page)
    actor.append_slots("a", 16)  # pages 2, 3
    reward.free("r")  # the scorer lane's event is slow
    actor.free("a")
    actor_events[0].done = True  # the actor's kernels on pages 2, 3 are done
    arena.reclaim()
    assert arena.num_free_pages() == 4 and arena.num_pending_pages == 2
    check_invariant(arena, [actor, reward])
    assert arena.available_pages("actor") == 4  # not the scorer lane's two pending pages
    reward_events[0].done = True
    arena.reclaim()
    assert arena.num_free_pages() == 6
    check_invariant(arena, [actor, reward])


def test_a_lane_takes_back_its_own_pending_pages_without_waiting_and_others_do_not():
    arena = make_arena(num_pages=3)
    actor, reward, actor_events, _ = two_lanes(arena)
    actor.append_slots("a", 16)  # pages 0, 1
    actor.free("a")  # event not complete: the actor lane's kernels may still touch pages 0, 1
    assert arena.num_pending_pages == 2 and arena.available_pages("actor") == 3
    assert arena.available_pages("reward") == 1
    # What each model waits for (a stalled scheduler waits only for pages another lane holds back).
    assert arena.pending_pages_for("actor") == 0 and arena.pending_pages_for("reward") == 2
    assert reward.append_slots("r", 33) is None  # another lane may not have them
    # The actor's own stream orders its next kernels after those on pages 0, 1: no event needed.
    slots = actor.append_slots("b", 24)
    assert slots is not None and sorted(actor.pages("b")) == [0, 1, 2]
    assert arena.num_pending_pages == 0
    check_invariant(arena, [actor, reward])
    assert not actor_events[0].done


def test_reclaim_with_wait_returns_every_pending_free():
    arena = make_arena(num_pages=4)
    actor, reward, _, _ = two_lanes(arena)
    actor.append_slots("a", 8)
    reward.append_slots("r", 1)
    actor.free("a")
    reward.free("r")
    arena.reclaim()
    assert arena.num_free_pages() == 2
    arena.reclaim(wait=True)
    assert arena.num_free_pages() == arena.num_pages and arena.num_pending_pages == 0


def test_a_held_host_buffer_lives_until_its_copy_event_completes():
    import weakref

    arena = make_arena(num_pages=2)
    event = FakeEvent()
    buffer = torch.empty(4, dtype=torch.uint8)
    alive = weakref.ref(buffer)
    arena.hold(buffer, event)
    del buffer
    arena.reclaim()
    assert alive() is not None and arena.num_held_buffers == 1  # the copy may still read it
    event.done = True
    arena.reclaim()
    assert alive() is None and arena.num_held_buffers == 0
