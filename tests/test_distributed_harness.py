"""The multi-process harness itself: values come back in rank order, and failures are reported, not hung."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from tests.distributed import RanksFailed, run_ranks


def _sum_ranks(rank, world_size):
    t = torch.tensor([float(rank + 1)])
    dist.all_reduce(t)
    return rank, t.item()


def _rank1_raises(rank, world_size):
    if rank == 1:
        raise RuntimeError("boom on rank 1")
    return rank


def _rank1_dies_rank0_waits(rank, world_size):
    if rank == 1:
        os._exit(7)
    t = torch.zeros(1)
    dist.all_reduce(t)  # its peer is gone: gloo raises within the group's timeout
    return rank


def _rank0_sleeps(rank, world_size):
    if rank == 0:
        time.sleep(600)
    return rank


def test_values_in_rank_order():
    assert run_ranks(_sum_ranks, 2) == [(0, 3.0), (1, 3.0)]


def test_a_raising_rank_is_reported_with_its_traceback():
    with pytest.raises(RanksFailed, match="boom on rank 1"):
        run_ranks(_rank1_raises, 2)


def test_a_dead_peer_makes_the_collective_raise():
    out = run_ranks(_rank1_dies_rank0_waits, 2, pg_timeout_s=10, check=False)
    assert out[1].exitcode == 7 and not out[1].ok
    assert not out[0].ok and out[0].error is not None


def test_a_stuck_rank_is_killed_at_the_deadline():
    t0 = time.monotonic()
    out = run_ranks(_rank0_sleeps, 2, timeout_s=20, backend=None, check=False)
    assert time.monotonic() - t0 < 60
    assert out[1].ok and not out[0].ok and "did not finish" in out[0].error
