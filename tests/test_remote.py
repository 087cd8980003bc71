"""Remote scorers (issue 16): a ScorerService rank serves the reward and reference models of two actor ranks.

Spawned processes on gloo (tests/distributed.py). Exactness: tokens, log-probs and policy versions equal
the same engines with colocated scorers; rewards and reference log-probs equal HF's own forward, through a
service arena tight enough to preempt and swap, in ``intra`` and ``oppo`` with groups (n=2). Faults: a
service killed mid-step fails each actor's step naming its rank, rolled back with every prompt kept; a
client killed mid-step has its pages freed while the other is served to the end. Bad input is refused at
connection, naming the mismatch. Actor ranks that also form a data-parallel group (created on every rank, the
service included) are served as colocated scorers would serve them.
"""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
from distributed import run_ranks
from engine_models import EOS, actor_config, make_actor, make_reward, random_prompts
from test_intra import _fail_on_call
from test_ppo_scorers import hf_ref_logprobs, hf_values, make_critic, make_reference

from oppo_engine import EngineConfig, RolloutEngine, SamplingParams

CLIENTS, SERVICE = (0, 1), 2
PAGE = 8
MAX_LEN = 64
# Pages of 4 KiB (the reference's 8 tokens): 14 pages hold one sequence of max_model_len in both models
# (12 pages) and little more, against the two clients' 8-12 sequences in flight, so the service preempts
# (swaps) its younger sequences.
TIGHT_SERVICE_BYTES = 14 * 4096
LIVENESS_S = 30.0


def _config(mode: str, **overrides) -> EngineConfig:
    cfg = dict(batch_size=4, mode=mode, page_size=PAGE, max_model_len=MAX_LEN)
    if mode in ("intra", "oppo"):
        cfg["chunk_size"] = 4
    if mode in ("inter", "oppo"):
        cfg["overcommit"] = 2
    cfg.update(overrides)
    return EngineConfig(**cfg)


def _sampling() -> SamplingParams:
    return SamplingParams(temperature=1.0, max_new_tokens=14, seed=11, n=2)


def _prompts(rank: int) -> list[list[int]]:
    return random_prompts(6, seed=100 + rank, min_len=2, max_len=12)


def _drain(engine: RolloutEngine) -> list[dict]:
    out = []
    while result := engine.step().rollouts:
        out += [_as_dict(r) for r in result]
    return sorted(out, key=lambda r: (r["group_id"], r["sample_index"]))


def _as_dict(r) -> dict:
    keys = ("group_id", "sample_index", "prompt_ids", "response_ids", "logprobs", "policy_versions", "reward",
            "ref_logprobs")  # fmt: skip
    return {k: getattr(r, k) for k in keys}


def _service(pg, kv_cache_bytes=TIGHT_SERVICE_BYTES, **kw):
    from oppo_engine.distributed import ScorerService

    return ScorerService(
        reward=make_reward(), reference=make_reference(), group=pg, kv_cache_bytes=kv_cache_bytes,
        max_model_len=MAX_LEN, page_size=PAGE, liveness_timeout_s=LIVENESS_S, **kw,
    )  # fmt: skip


def _client_engine(pg, mode: str, critic=None, **cfg) -> RolloutEngine:
    from oppo_engine.distributed import RemoteScorers

    remote = RemoteScorers(service_rank=SERVICE, group=pg, liveness_timeout_s=LIVENESS_S)
    return RolloutEngine(actor=make_actor(), reward=remote, critic=critic, config=_config(mode, **cfg),
                         sampling=_sampling(), eos_token_id=EOS)  # fmt: skip


def _exact_rank(rank: int, world_size: int, modes: tuple[str, ...]):
    import torch.distributed as dist

    pg = dist.group.WORLD
    if rank == SERVICE:
        return [_service(pg).serve() for _ in modes]
    out = []
    for mode in modes:
        engine = _client_engine(pg, mode)
        if rank == 0 and mode == "oppo":  # a failed step rolls this client back on the service, once
            _fail_on_call(engine._loop.actor, "forward", k=20)
        engine.add_prompts(_prompts(rank))
        rollouts, retries = [], 0
        while result := engine.step():
            retries += result.metrics.retries
            if not result.rollouts:
                break
            rollouts += [_as_dict(r) for r in result.rollouts]
        stats = engine.cache_stats()
        lane = engine._loop.scorer_lane
        engine.close()
        out.append(dict(rollouts=sorted(rollouts, key=lambda r: (r["group_id"], r["sample_index"])),
                        free=stats.free_pages == stats.total_pages, retries=retries,
                        messages=lane.messages_sent, bytes=lane.bytes_sent))  # fmt: skip
    return out


def _colocated(rank: int, mode: str) -> list[dict]:
    """The same engine as rank ``rank``'s, with the scorers in it, on one thread as the ranks run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _colocated_run(rank, mode)
    finally:
        torch.set_num_threads(threads)


def _colocated_run(rank: int, mode: str) -> list[dict]:
    engine = RolloutEngine(
        actor=make_actor(), reward=make_reward(), reference=make_reference(), config=_config(mode),
        sampling=_sampling(), eos_token_id=EOS,
    )  # fmt: skip
    engine.add_prompts(_prompts(rank))
    out = _drain(engine)
    engine.close()
    return out


def test_remote_scorers_equal_colocated_and_hf_through_a_tight_service_arena():
    """sequential, intra and oppo (n=2, overcommit 2) on two actor ranks: tokens, log-probs and versions equal
    colocated scorers; rewards and ref_logprobs equal HF; streamed, the service preempted (sequential scores
    whole sequences oldest first, which never needs to); every page is free at the end.
    In oppo, rank 0's step fails once (an actor forward) and is retried: the service dropped that client's
    sequences and scored them again, and rank 1 was untouched."""
    modes = ("sequential", "intra", "oppo")
    values = run_ranks(_exact_rank, 3, modes, timeout_s=300)
    # Whether a given step preempts depends on how the lanes interleave; over the streamed runs it does.
    streamed = [values[SERVICE][m] for m, mode in enumerate(modes) if mode != "sequential"]
    assert sum(s.preemptions for s in streamed) > 0 and sum(s.swapped_tokens for s in streamed) > 0
    reward, reference = make_reward(), make_reference()
    for m, mode in enumerate(modes):
        stats = values[SERVICE][m]
        assert stats.free_pages == stats.total_pages, stats
        assert sorted(stats.closed) == list(CLIENTS) and not stats.lost
        for rank in CLIENTS:
            got = values[rank][m]
            assert got["free"]
            assert got["retries"] == (1 if rank == 0 and mode == "oppo" else 0)
            want = _colocated(rank, mode)
            _assert_equals_colocated(got["rollouts"], want, _prompts(rank), reward, reference)
            assert got["messages"] > 0 and got["bytes"] > 0


def _assert_equals_colocated(got: list[dict], want: list[dict], prompts, reward, reference) -> None:
    """Every prompt exactly once (n=2 samples each), with the colocated run's tokens, log-probs, versions and
    rewards, and HF's own rewards and reference log-probs."""
    assert [(r["group_id"], r["sample_index"]) for r in got] == [
        (g, j) for g in range(len(prompts)) for j in range(2)
    ]
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g["prompt_ids"] == w["prompt_ids"] == prompts[g["group_id"]]
        assert g["response_ids"] == w["response_ids"]
        assert g["logprobs"] == w["logprobs"]
        assert g["policy_versions"] == w["policy_versions"]
        assert g["reward"] == pytest.approx(w["reward"], abs=1e-5)
        _assert_equals_hf(g, reward, reference)


@torch.inference_mode()
def _assert_equals_hf(r: dict, reward, reference) -> None:
    ids = torch.tensor([r["prompt_ids"] + r["response_ids"]])
    assert r["reward"] == pytest.approx(reward(ids).logits[0, 0].item(), abs=1e-5)
    want = hf_ref_logprobs(reference, r["prompt_ids"], r["response_ids"], 1.0)
    torch.testing.assert_close(torch.tensor(r["ref_logprobs"]), want, atol=1e-5, rtol=0)


def _dp_run(engine: RolloutEngine, dp, rank: int) -> dict:
    """Step every actor rank until no rank of ``dp`` returns anything (a data-parallel trainer's loop); what
    each step's timeline shows of the scorers, and what the switch-cost profiler measures of them."""
    import torch.distributed as dist

    from oppo_engine.sched.profiler import SwitchCostProfiler

    engine.add_prompts(_prompts(rank))
    rollouts, spans, profiles = [], [], []
    profiler = SwitchCostProfiler("actor", ["reward", "reference"])
    while True:
        result = engine.step()
        rollouts += [_as_dict(r) for r in result.rollouts]
        step_spans = engine.timeline.spans()
        decode = [s for s in step_spans if s.lane == "actor"]
        for s in step_spans:
            if s.lane in ("reward", "reference"):
                beside = any(d.start_s < s.end_s and s.start_s < d.end_s for d in decode)
                spans.append((s.lane, s.name, s.args.get("tokens"), s.end_s > s.start_s, beside))
        profiles.append(profiler.observe(step_spans, 4, result.metrics.tokens_generated, []))
        count = torch.tensor([len(result.rollouts)])
        dist.all_reduce(count, group=dp)
        if count.item() == 0:
            break
    stats = engine.cache_stats()
    out = dict(rollouts=sorted(rollouts, key=lambda r: (r["group_id"], r["sample_index"])),
               delta=engine.delta_history, chunk=engine.chunk_history,
               free=stats.free_pages == stats.total_pages, spans=spans,
               profiled=any(p is not None for p in profiles))  # fmt: skip
    engine.close()
    return out


def _data_parallel_rank(rank: int, world_size: int):
    import torch.distributed as dist

    from oppo_engine.distributed import RemoteScorers

    pg = dist.group.WORLD  # the service and its clients
    dp = dist.new_group(list(CLIENTS), backend="gloo")  # the actors' data-parallel group: made on every rank
    if rank == SERVICE:
        return _service(pg).serve()
    remote = RemoteScorers(service_rank=SERVICE, group=pg, liveness_timeout_s=LIVENESS_S)
    engine = RolloutEngine(actor=make_actor(), reward=remote, config=_config("oppo"), sampling=_sampling(),
                           eos_token_id=EOS, process_group=dp)  # fmt: skip
    got = _dp_run(engine, dp, rank)
    engine = RolloutEngine(actor=make_actor(), reward=make_reward(), reference=make_reference(),
                           config=_config("oppo"), sampling=_sampling(), eos_token_id=EOS,
                           process_group=dp)  # fmt: skip
    return got, _dp_run(engine, dp, rank)


def test_remote_scorers_serve_a_data_parallel_group_of_actor_ranks_as_colocated_scorers_would():
    """oppo (n=2, fixed chunk size and overcommit) on two actor ranks whose engines form a data-parallel group
    (created on all three ranks, the service included): the ranks' Δ and chunk histories agree, and tokens,
    log-probs and versions equal the same 2-rank group with colocated scorers; every page is free at the end
    on the actors and on the service."""
    values = run_ranks(_data_parallel_rank, 3, timeout_s=300)
    stats = values[SERVICE]
    assert stats.free_pages == stats.total_pages, stats
    assert sorted(stats.closed) == list(CLIENTS) and not stats.lost and stats.sequences_scored == 24
    (remote0, colocated0), (remote1, colocated1) = values[0], values[1]
    assert remote0["delta"] == remote1["delta"] and remote0["chunk"] == remote1["chunk"]
    assert colocated0["delta"] == colocated1["delta"] and colocated0["chunk"] == colocated1["chunk"]
    assert len(remote0["delta"]) > 1
    # The service's forwards are on each client's timeline, as a local lane's prefills are, beside its decode:
    # the switch-cost profiler measures them (chunk_size="auto" sees what streaming to the service costs).
    for got in (remote0, remote1, colocated0):
        lanes = {lane for lane, name, tokens, ok, _ in got["spans"] if name == "prefill" and tokens and ok}
        assert lanes == {"reward", "reference"}, got["spans"]
        assert any(beside for *_, beside in got["spans"]) and got["profiled"]
    reward, reference = make_reward(), make_reference()
    for rank, (got, want) in enumerate([(remote0, colocated0), (remote1, colocated1)]):
        assert got["free"] and want["free"]
        _assert_equals_colocated(got["rollouts"], want["rollouts"], _prompts(rank), reward, reference)


def _in_flight_keys(state: dict, n: int) -> set[tuple[int, int]]:
    """(group, sample) of every prompt ``state`` holds: carried, given back, and still queued."""
    keys = {
        (d["prompt_index"], d["sample_index"]) for d in [*state["carried"], *state["prompts"]["requeued"]]
    }
    first = state["prompts"]["next_prompt_index"]
    for i in range(len(state["prompts"]["pending"])):
        keys |= {(first + i, j) for j in range(n)}
    return keys


def _wait_until_every_client_is_mid_run(service) -> None:
    """Until some sequences are scored and every client has sequences in flight on the service: neither can
    finish its run without it (however the two clients' speeds differ on a loaded machine)."""
    while not (
        service.stats.sequences_scored >= 4
        and len(service._clients) == len(CLIENTS)
        and all(client.seqs for client in list(service._clients.values()))
    ):
        time.sleep(0.001)


def _kill_service_rank(rank: int, world_size: int):
    import torch.distributed as dist

    pg = dist.group.WORLD
    # The clients start stepping together: one whose process came up seconds before the other's could
    # otherwise finish its whole run before the other connects, and the service would never see both mid-run.
    clients = dist.new_group(list(CLIENTS))  # every rank of the world takes part in making a group
    if rank == SERVICE:
        service = _service(pg)

        def die_mid_step():
            _wait_until_every_client_is_mid_run(service)
            os._exit(17)

        threading.Thread(target=die_mid_step, daemon=True).start()
        service.serve()
        return None
    engine = _client_engine(pg, "oppo")
    engine.add_prompts(_prompts(rank))
    dist.barrier(group=clients)
    returned, error = [], None
    for _ in range(20):
        try:
            result = engine.step()
        except Exception as e:  # noqa: BLE001 - what the test looks at
            error = (type(e).__name__, str(e))
            break
        returned += [(r.group_id, r.sample_index) for r in result.rollouts]
    state = engine.state_dict()
    again = None
    try:
        engine.step()
    except Exception as e:  # noqa: BLE001
        again = type(e).__name__
    stats = engine.cache_stats()
    engine.close()
    return dict(error=error, returned=returned, state=_in_flight_keys(state, 2), again=again,
                free=stats.free_pages == stats.total_pages)  # fmt: skip


def test_a_killed_service_fails_each_actor_step_naming_its_rank_and_keeps_every_prompt():
    outcomes = run_ranks(_kill_service_rank, 3, timeout_s=240, check=False)
    assert not outcomes[SERVICE].ok and outcomes[SERVICE].exitcode == 17
    for rank in CLIENTS:
        assert outcomes[rank].ok, outcomes[rank].error
        got = outcomes[rank].value
        assert got["error"] is not None, "the step in flight should have failed"
        kind, message = got["error"]
        assert kind == "ScorerServiceLost" and f"rank {SERVICE}" in message
        # Rolled back: what was returned before and what the state holds are every prompt, exactly once.
        assert not set(got["returned"]) & got["state"]
        assert set(got["returned"]) | got["state"] == {(g, j) for g in range(6) for j in range(2)}
        assert len(got["returned"]) + len(got["state"]) == 12
        assert got["again"] == "ScorerServiceLost"
        assert got["free"]


def _kill_client_rank(rank: int, world_size: int):
    import torch.distributed as dist

    pg = dist.group.WORLD
    if rank == SERVICE:
        return _service(pg).serve()
    engine = _client_engine(pg, "oppo", critic=make_critic() if rank == 0 else None)
    engine.add_prompts(_prompts(rank))
    if rank == 1:
        engine.step()  # the service now holds this client's carried sequences
        lane = engine._loop.scorer_lane
        original = lane.remote.send

        def die(message):  # mid-step, between two hand-offs
            original(message)
            os._exit(23)

        lane.remote.send = die
        engine.step()
        raise AssertionError("rank 1 should have died in its second step")
    rollouts = []
    while result := engine.step().rollouts:  # the service keeps reward and reference KV across updates
        rollouts += [{**_as_dict(r), "values": r.values} for r in result]
        engine.update_policy()
    engine.close()
    return sorted(rollouts, key=lambda r: (r["group_id"], r["sample_index"]))


def test_a_killed_client_is_dropped_and_the_other_served_to_the_end_with_every_page_freed():
    outcomes = run_ranks(_kill_client_rank, 3, timeout_s=240, check=False)
    assert not outcomes[1].ok and outcomes[1].exitcode == 23
    assert outcomes[0].ok, outcomes[0].error
    assert outcomes[SERVICE].ok, outcomes[SERVICE].error
    stats = outcomes[SERVICE].value
    assert stats.closed == [0] and list(stats.lost) == [1] and "rank 1" in stats.lost[1]
    assert stats.free_pages == stats.total_pages
    rollouts = outcomes[0].value
    assert [(r["group_id"], r["sample_index"]) for r in rollouts] == [
        (g, j) for g in range(6) for j in range(2)
    ]
    # Carried sequences kept their reward and reference KV across update_policy(): nothing recomputed.
    assert stats.recomputed_tokens == 0 and stats.swapped_tokens > 0
    reward, reference, critic = make_reward(), make_reference(), make_critic()
    for r in rollouts:
        _assert_equals_hf(r, reward, reference)
        want = hf_values(critic, r["prompt_ids"], r["response_ids"])  # the critic stayed local
        torch.testing.assert_close(torch.tensor(r["values"]), want, atol=1e-5, rtol=0)
    assert any(v > 0 for r in rollouts for v in r["policy_versions"])


def _bad_input_rank(rank: int, world_size: int):
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from oppo_engine.distributed import RemoteScorers

    pg = dist.group.WORLD
    if rank == SERVICE:
        first = _service(pg).serve()
        second = _service(pg).serve()
        return first, second
    errors = []
    for bad in (3, -1, rank, "2"):  # not a rank of the group, this rank: at once, no collective
        t0 = time.monotonic()
        with pytest.raises(ValueError, match="service_rank") as e:
            RemoteScorers(service_rank=bad, group=pg)
        errors.append((str(e.value), time.monotonic() - t0))
    # First round: rank 0's actor has another vocabulary, rank 1 a longer max_model_len.
    remote = RemoteScorers(service_rank=SERVICE, group=pg, liveness_timeout_s=LIVENESS_S)
    if rank == 0:
        torch.manual_seed(0)
        actor = AutoModelForCausalLM.from_config(actor_config(vocab_size=256), dtype=torch.float32).eval()
        cfg = _config("intra")
    else:
        actor, cfg = make_actor(), _config("intra", max_model_len=2 * MAX_LEN)
    with pytest.raises(ValueError) as e:
        RolloutEngine(actor=actor, reward=remote, config=cfg, sampling=_sampling(), eos_token_id=EOS)
    refused = str(e.value)
    # Second round: rank 0 passes a local reference while the service holds one; rank 1 connects fine.
    remote = RemoteScorers(service_rank=SERVICE, group=pg, liveness_timeout_s=LIVENESS_S)
    local_reference = None
    if rank == 0:
        with pytest.raises(ValueError) as e:
            RolloutEngine(actor=make_actor(), reward=remote, reference=make_reference(),
                          config=_config("intra"), sampling=_sampling(), eos_token_id=EOS)  # fmt: skip
        local_reference = str(e.value)
    else:
        RolloutEngine(actor=make_actor(), reward=remote, config=_config("intra"), sampling=_sampling(),
                      eos_token_id=EOS).close()  # fmt: skip
    return errors, refused, local_reference


def test_bad_input_is_refused_at_once_or_at_connection_naming_the_mismatch():
    values = run_ranks(_bad_input_rank, 3, timeout_s=240)
    for rank in CLIENTS:
        errors, refused, local_reference = values[rank]
        assert all(elapsed < 5 for _, elapsed in errors), errors
        assert "is not a rank of the group" in errors[0][0] and "is this rank" in errors[2][0]
        if rank == 0:
            assert "vocabulary mismatch" in refused and "256" in refused and "128" in refused
            assert "reference" in local_reference and "holds a reference" in local_reference
        else:
            assert f"max_model_len={2 * MAX_LEN} exceeds" in refused and str(MAX_LEN) in refused
    first, second = values[SERVICE]
    assert sorted(first.refused) == list(CLIENTS) and not first.closed and not first.lost
    assert sorted(second.closed) == list(CLIENTS) and not second.lost
    assert first.free_pages == first.total_pages and second.free_pages == second.total_pages


def _cli_rank(rank: int, world_size: int, init: str, folder: str):
    from oppo_engine.cli import main
    from oppo_engine.distributed import RemoteScorers, stateless_group

    if rank == 1:  # the service: a process of its own, hosting the group's TCPStore
        return main(
            [
                "serve-scorers",
                "--reward",
                f"{folder}/reward",
                "--reference",
                f"{folder}/reference",
                "--init",
                init,
                "--world",
                "2",
                "--max-model-len",
                str(MAX_LEN),
                "--page-size",
                str(PAGE),
            ]
        )
    group = stateless_group(init, rank=0, world_size=2)  # beside no default group at all
    engine = RolloutEngine(actor=make_actor(), reward=RemoteScorers(service_rank=1, group=group),
                           config=_config("oppo"), sampling=_sampling(), eos_token_id=EOS)  # fmt: skip
    engine.add_prompts(_prompts(0))
    rollouts = _drain(engine)
    engine.close()
    return rollouts


def test_serve_scorers_cli_serves_actor_ranks_that_join_through_a_tcp_store(tmp_path):
    make_reward().save_pretrained(tmp_path / "reward")
    make_reference().save_pretrained(tmp_path / "reference")
    from distributed import free_port

    init = f"tcp://127.0.0.1:{free_port()}"
    rollouts, code = run_ranks(_cli_rank, 2, init, str(tmp_path), backend=None, timeout_s=180)
    assert code == 0
    assert [(r["group_id"], r["sample_index"]) for r in rollouts] == [
        (g, j) for g in range(6) for j in range(2)
    ]
    reward, reference = make_reward(), make_reference()
    for r in rollouts:
        _assert_equals_hf(r, reward, reference)


def _silent_service_rank(rank: int, world_size: int):
    import torch.distributed as dist

    from oppo_engine.distributed import RemoteScorers

    pg = dist.group.WORLD
    if rank == SERVICE:
        service = _service(pg)

        def fall_silent():  # mid-step: no more results nor heartbeats; exit long after the clients noticed
            _wait_until_every_client_is_mid_run(service)
            service.transport._send = lambda peer, message: time.sleep(3600)
            time.sleep(SILENT_LIVENESS_S * 3)
            os._exit(19)

        threading.Thread(target=fall_silent, daemon=True).start()
        service.serve()
        return None
    remote = RemoteScorers(
        service_rank=SERVICE, group=pg, heartbeat_s=0.5, liveness_timeout_s=SILENT_LIVENESS_S
    )
    engine = RolloutEngine(actor=make_actor(), reward=remote, config=_config("oppo"), sampling=_sampling(),
                           eos_token_id=EOS)  # fmt: skip
    engine.add_prompts(_prompts(rank))
    returned = []
    t0 = None
    for _ in range(20):
        t0 = time.monotonic()
        try:
            returned += [(r.group_id, r.sample_index) for r in engine.step().rollouts]
        except Exception as e:  # noqa: BLE001 - what the test looks at
            state = _in_flight_keys(engine.state_dict(), 2)
            engine.close()
            return dict(error=(type(e).__name__, str(e)), elapsed=time.monotonic() - t0, returned=returned,
                        state=state)  # fmt: skip
    return None


SILENT_LIVENESS_S = 6.0


@pytest.mark.slow
def test_a_silent_service_fails_each_actor_step_after_the_liveness_timeout():
    outcomes = run_ranks(_silent_service_rank, 3, timeout_s=240, check=False)
    for rank in CLIENTS:
        assert outcomes[rank].ok, outcomes[rank].error
        got = outcomes[rank].value
        kind, message = got["error"]
        assert kind == "ScorerServiceLost" and f"rank {SERVICE} was silent" in message
        assert got["elapsed"] < 3 * SILENT_LIVENESS_S  # the liveness timeout, not the gloo group's
        assert set(got["returned"]) | got["state"] == {(g, j) for g in range(6) for j in range(2)}


def _prompt_first_rank(rank: int, world_size: int):
    import torch.distributed as dist

    from oppo_engine.distributed import RemoteScorers

    pg = dist.group.WORLD
    if rank == 1:
        return _service(pg, kv_cache_bytes=None).serve().forwards
    remote = RemoteScorers(service_rank=1, group=pg, liveness_timeout_s=LIVENESS_S)
    engine = RolloutEngine(actor=make_actor(), reward=remote, config=_config("intra", chunk_size=64),
                           sampling=SamplingParams(temperature=1.0, max_new_tokens=14, seed=3),
                           eos_token_id=EOS)  # fmt: skip
    prompts = _prompts(0)[:4]
    want = sum(len(p) for p in prompts)
    original, calls, waited = engine._loop.actor.forward, [0], {}

    def prefilled() -> dict[str, int]:
        got: dict[str, int] = {}
        for span in engine.timeline.spans():
            if span.args.get("remote"):
                got[span.lane] = got.get(span.lane, 0) + span.args["tokens"]
        return got

    def forward(*args, **kwargs):  # the first decode waits until the service reports the prompts prefilled
        calls[0] += 1
        if calls[0] == 2:
            deadline = time.monotonic() + 30.0
            while prefilled() != {"reward": want, "reference": want} and time.monotonic() < deadline:
                time.sleep(0.01)
            waited.update(prefilled())
        return original(*args, **kwargs)

    engine._loop.actor.forward = forward
    engine.add_prompts(prompts)
    rollouts = engine.step().rollouts
    engine.close()
    return dict(want=want, before_decode=waited, rollouts=len(rollouts))


def test_the_service_prefills_each_prompt_before_any_response_token_arrives():
    """The prompt is handed off when a step starts: the service prefills it beside the actor's own prefill
    and decode, not only once the first chunk (here, with a chunk of 64, the whole response) arrives."""
    client, forwards = run_ranks(_prompt_first_rank, 2, timeout_s=180)
    assert client["before_decode"] == {"reward": client["want"], "reference": client["want"]}
    assert client["rollouts"] == 4 and forwards >= 4  # the prompts' forwards, then the responses'


def _last_message_rank(rank: int, world_size: int):
    import torch.distributed as dist

    from oppo_engine.distributed.transport import BYE, HEARTBEAT, GlooTransport, Message

    got, done = [], threading.Event()

    def on_message(peer, message):
        got.append(message.kind)
        if message.kind == BYE:
            done.set()

    transport = GlooTransport(dist.group.WORLD, [1 - rank], heartbeat_s=0.05, liveness_timeout_s=30.0)
    transport.start(on_message)
    if rank == 0:
        time.sleep(0.3)  # heartbeats flow meanwhile
        transport.send_last(1, Message(BYE))
        t0 = time.monotonic()
        # The heartbeat thread's send racing the BYE, made certain: the peer receives nothing after its BYE,
        # so a send now would wait for the group's 24-hour timeout.
        transport._send(1, Message(HEARTBEAT))
        elapsed = time.monotonic() - t0
        time.sleep(0.3)  # the heartbeat thread, had it not stopped, would send (and block) meanwhile
        return dict(elapsed=elapsed, beating=any(t.name == "oppo-heartbeat" and t.is_alive()
                                                 for t in threading.enumerate()))  # fmt: skip
    assert done.wait(30.0)
    transport.close(0)
    time.sleep(2.0)  # alive, as a client that goes on training: a send blocked on us would stay blocked
    return dict(kinds=got)


def test_nothing_is_sent_after_the_last_message_so_no_heartbeat_blocks_the_sender():
    """After a peer's BYE its receiving thread stops, and a gloo send completes only against a posted
    receive: a heartbeat sent after the BYE would block the one heartbeat thread that serves every peer (a
    service's other clients would then fall silent). ``send_last`` closes the peer first, under its lock."""
    from oppo_engine.distributed.transport import BYE

    sender, receiver = run_ranks(_last_message_rank, 2, timeout_s=120)
    assert sender["elapsed"] < 1.0 and not sender["beating"]
    assert receiver["kinds"] == [BYE]  # heartbeats are not delivered; the BYE is, last


def test_protocol_round_trips_hand_offs_and_results_exactly():
    from oppo_engine.distributed import protocol

    ints, floats = [5], []
    protocol.encode_add(ints, floats, protocol.AddItem(7, 3, 2, [9, 8, 7], 0.7))
    protocol.encode_tokens(ints, protocol.TokensItem(7, 5, False, [4, 4]))
    protocol.encode_tokens(ints, protocol.TokensItem(7, 5, True, []))
    items = list(protocol.decode_handoffs(ints, floats))
    assert items == [protocol.AddItem(7, 3, 2, [9, 8, 7], 0.7), protocol.TokensItem(7, 5, False, [4, 4]),
                     protocol.TokensItem(7, 5, True, [])]  # fmt: skip
    results = [(7, -1.2345678901234567, [-0.1, -2.5e-30]), (8, 3.0, [])]
    ints, floats = protocol.encode_results(5, [(7, results[0][1], results[0][2]), (8, 3.0, None)])
    assert ints[0] == 5 and list(protocol.decode_results(ints, floats)) == results
    spans = [(0, 12, 1.25, 1.5), (1, 3, 1.5, 1.625)]
    ints, floats = protocol.encode_spans(5, spans)
    assert ints[0] == 5 and list(protocol.decode_spans(ints, floats)) == [
        ("reward", 12, 1.25, 1.5),
        ("reference", 3, 1.5, 1.625),
    ]
    with pytest.raises(ValueError, match="unknown item"):
        list(protocol.decode_handoffs([0, 9, 1], []))
