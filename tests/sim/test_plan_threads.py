"""A CPU plan is priced at the thread count it names (``plan(..., cpu_threads=)``, default 1), not at the
predicting process's torch thread count: a script that forgets ``torch.set_num_threads(1)`` used to price a
sequential step's forwards on two threads with the one-thread calibration's costs (two threads' demand on
the cores, no two-thread speed: 1.6x slower on the matrix's gqa8). A count the profile never timed is
refused by name. The profiles hold made-up constants (a test input, not a measurement)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from oppo_engine.sim import plan
from oppo_engine.sim.cost import HostCosts
from oppo_engine.sim.profile import Profile, ThreadCosts

GEMM = {kn: [(1, 2e9), (16, 2e10), (256, 5e10)] for kn in (16384, 1048576)}
ONE = ThreadCosts(GEMM, 1e10, 1e-4, 2e-5, 1e-10, 1e-11, 1e-9, 1e-9, 0.05)
TWO = dataclasses.replace(ONE, gemm={kn: [(m, 1.8 * f) for m, f in v] for kn, v in GEMM.items()})


def _profile(threads: dict, cores: float = 2.0) -> Profile:
    return Profile("cpu:test", "cpu", threads, HostCosts(2e-5, 3e-6, 5e-6), 5e9, cores=cores)


def _s_per_step(profile: Profile, process_threads: int, **kw) -> float:
    saved = torch.get_num_threads()
    torch.set_num_threads(process_threads)
    try:
        result = plan("tiny", reward="rule", device=profile, gpus=1, placement="cpu", batch_size=2, lengths=8,
                      prompt_lengths=8, steps=1, modes=("sequential",), **kw)  # fmt: skip
    finally:
        torch.set_num_threads(saved)
    assert torch.get_num_threads() == saved
    return result.modes["sequential"].s_per_step


def test_a_cpu_plan_is_priced_at_its_cpu_threads_whatever_the_process_runs():
    profile = _profile({1: ONE}, cores=1.25)  # gqa8's fitted cores on the quiet matrix of 2026-12-05
    assert _s_per_step(profile, 2) == _s_per_step(profile, 1)


def test_a_cpu_plan_at_two_threads_prices_the_two_thread_calibration():
    profile = _profile({1: ONE, 2: TWO})
    assert _s_per_step(profile, 1, cpu_threads=2) < _s_per_step(profile, 1, cpu_threads=1)
    assert _s_per_step(profile, 1, cpu_threads=2) == _s_per_step(profile, 2, cpu_threads=2)


@pytest.mark.parametrize("threads, cpu_threads", [({1: ONE}, 2), ({2: TWO}, 2)])
def test_a_cpu_plan_at_a_thread_count_the_profile_never_timed_is_refused(threads, cpu_threads):
    with pytest.raises(ValueError, match=r"calibrated at \[\d\] thread\(s\), not at \[\d\]"):
        _s_per_step(_profile(threads), 1, cpu_threads=cpu_threads)
