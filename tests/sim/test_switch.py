"""A forward right after another model's on its device: the cache the two share held the other's weights, so
it reads its own again from memory (``ThreadCosts.switched``, profile format version 10). The twin
charges that excess exactly where another model's forward started on the device since this model's last
one did; the contention pairs are read with the share of their calls it falls on; the calibration times it
as the difference of the two orders. Made-up costs and sleeps stand in for measurements (test inputs)."""

from __future__ import annotations

import math
import time

import pytest

from oppo_engine import EngineConfig
from oppo_engine.sim import calibration
from oppo_engine.sim.calibration import _alternating, _switch_excess, _time_switch
from oppo_engine.sim.cost import CostModel, HostCosts, Work
from oppo_engine.sim.lengths import parse_lengths
from oppo_engine.sim.profile import Calibrated, Profile, ThreadCosts
from oppo_engine.sim.shapes import model_shape
from oppo_engine.sim.twin import Setting, World

MIB = 1 << 20
ACTOR = model_shape("tiny", dtype_bytes=4, name="actor")
REWARD = model_shape("tiny", head="score", dtype_bytes=4, name="reward")


def _profile(rate: float = 0.0) -> Profile:
    """A made-up profile whose switch costs ``rate`` seconds a byte up to 32 MiB, flat past it."""
    gemm = {kn: [(1, 2e9), (16, 2e10), (256, 5e10)] for kn in (16384, 1048576)}
    table = [(4.0 * MIB, rate * 4 * MIB), (32.0 * MIB, rate * 32 * MIB)] if rate else []
    costs = ThreadCosts(gemm, 1e10, 1e-4, 2e-5, 1e-10, 1e-11, 1e-9, 1e-9, 0.05, switched=table)
    return Profile("cpu:test", "cpu", {1: costs}, HostCosts(2e-5, 3e-6, 5e-6), 5e9, cores=2)


def _world(profile: Profile, mode: str = "sequential", steps: int = 3, packed: bool = True) -> World:
    setting = Setting(
        shapes={"actor": ACTOR, "reward": REWARD}, cost=CostModel(Calibrated(profile)), placement="cpu",
        gpus=1, batch_size=4, lengths=parse_lengths([12, 30, 7, 20]), prompt_lengths=parse_lengths(8),
        config=EngineConfig(packed_weights=packed),
    )  # fmt: skip
    chunk = 8 if mode in ("intra", "oppo") else None
    return World(setting, mode, chunk_size=chunk, steps=steps)


def test_the_excess_is_read_from_the_swept_sizes_in_log_bytes_and_held_flat_past_them():
    costs = _profile(4e-11).threads[1]
    assert costs.switched_s(4 * MIB) == pytest.approx(4e-11 * 4 * MIB)
    assert costs.switched_s(2 * MIB) == pytest.approx(4e-11 * 2 * MIB)  # below the smallest: per byte
    assert costs.switched_s(70 * MIB) == pytest.approx(4e-11 * 32 * MIB)  # past the largest: flat
    middle = costs.switched_s(math.sqrt(4 * 32) * MIB)  # halfway in log bytes
    assert middle == pytest.approx(4e-11 * (4 + 32) / 2 * MIB)
    assert _profile().threads[1].switched_s(12 * MIB) == 0.0  # not measured: nothing


def test_a_forward_is_charged_only_after_another_models_start_on_its_device():
    world = _world(_profile(1e-9))
    work = Work(0.0, 0.0, ((0.0, 1e-3),), 1)
    try:
        order = ["actor", "actor", "reward", "actor", "reward", "reward", "actor"]
        charged = [len(world._switch(role, "cpu", work, 1).phases) == 2 for role in order]
        assert charged == [False, False, True, True, True, False, True]
        # another device's forwards are another cache's
        assert len(world._switch("reward", "cpu:1", work, 1).phases) == 1
        assert len(world._switch("actor", "cpu", work, 1).phases) == 1
        excess = world._switch("reward", "cpu", work, 1).phases[-1]
        assert excess == (0.0, pytest.approx(1e-9 * REWARD.weight_bytes))
        # work of the actor not priced so (its repacking) is its start all the same
        assert len(world._switch("actor", "cpu", work, 1, charge=False).phases) == 1
        assert len(world._switch("actor", "cpu", work, 1).phases) == 1
    finally:
        world.close()


@pytest.mark.parametrize("packed", [False, True])
def test_a_sequential_step_pays_one_switch_per_model_and_the_first_step_the_scorers_only(packed):
    """In ``sequential`` the models run one after the other: the step's first actor forward follows the
    last step's scoring and its first reward forward follows the decodes; nothing overlaps, so each switch
    adds its excess to the step exactly. A packed actor repacks after each update, before its first
    forward: the repacking is its start, uncharged, so its forward after it is not switched."""
    rate = 2e-9
    rollouts = {}
    for k in (0.0, rate):
        world = _world(_profile(k), packed=packed)
        try:
            rollouts[k] = [r.rollout_s for r in world.run(3)]
        finally:
            world.close()
    extra = [b - a for a, b in zip(rollouts[0.0], rollouts[rate], strict=True)]
    assert extra[0] == pytest.approx(rate * REWARD.weight_bytes, rel=1e-9)
    actor = 0 if packed else ACTOR.weight_bytes
    for step in extra[1:]:
        assert step == pytest.approx(rate * (actor + REWARD.weight_bytes), rel=1e-9)


def test_a_streamed_step_pays_more_switches_than_a_sequential_one():
    """``oppo`` alternates the models within the step: it pays the switch more often than ``sequential``."""
    added = {}
    for mode in ("sequential", "oppo"):
        times = []
        for k in (0.0, 2e-9):
            world = _world(_profile(k), mode)
            try:
                times.append(sum(r.rollout_s for r in world.run(3)))
            finally:
                world.close()
        added[mode] = times[1] - times[0]
    assert added["oppo"] > 2 * added["sequential"] > 0


def test_a_contention_pair_is_read_with_the_share_of_its_calls_that_follow_the_other():
    """A decode looped beside a chunk three times as long in the pair (1.2 ms beside 3.6): a third of the
    decodes follow a chunk's start, every chunk a decode's; the measured slowdowns (against the forwards back
    to back) are scaled to the switched ones."""
    cost = CostModel(Calibrated(_profile(1e-9)))
    wa, wb = Work(0.0, 0.0, ((0.0, 1e-3),), 1), Work(0.0, 0.0, ((0.0, 3e-3),), 1)
    ca, cb, s_a, s_b = _alternating(cost, wa, wb, ACTOR, REWARD, 1.2, 1.2)
    ea, eb = 1e-9 * ACTOR.weight_bytes, 1e-9 * REWARD.weight_bytes
    assert ca.alone_s == pytest.approx(1e-3 + ea / 3) and cb.alone_s == pytest.approx(3e-3 + eb)
    assert s_a == pytest.approx(1.2e-3 / ca.alone_s) and s_b == pytest.approx(3.6e-3 / cb.alone_s)
    # nothing measured: the pair as it was
    plain = CostModel(Calibrated(_profile()))
    assert _alternating(plain, wa, wb, ACTOR, REWARD, 1.3, 1.1) == (wa, wb, 1.3, 1.1)


@pytest.mark.parametrize("cold", [0.004, 0.0005])
def test_the_calibration_times_the_two_orders_difference_never_below_zero(cold):
    """A stand-in sweep that sleeps 1 ms after itself and ``cold`` after the other's (sleeps: a stand-in,
    not a measurement)."""
    last: dict = {}

    def sweep(name: str, hot: float, after_other: float):
        def run() -> None:
            time.sleep(after_other if last.get("name") not in (None, name) else hot)
            last["name"] = name

        return run

    got = _switch_excess(sweep("own", 0.001, cold), sweep("other", 0.001, 0.001), 7)
    if cold < 0.001:
        assert got == 0.0
    else:
        assert 0.002 < got < 0.004  # 3 ms, give or take the sleeps


def test_the_calibrations_sweeps_are_of_the_sizes_it_names(monkeypatch):
    monkeypatch.setattr(calibration, "SWITCH_MB", (2, 4))
    monkeypatch.setattr(calibration, "SWITCH_REPEATS", 1)
    import torch

    assert [b for b, _ in _time_switch(torch.device("cpu"), torch.float32)] == [2.0 * MIB, 4.0 * MIB]
    assert [b for b, _ in _time_switch(torch.device("cpu"), torch.bfloat16)] == [2.0 * MIB, 4.0 * MIB]


def test_the_profile_keeps_the_switch_through_its_json(tmp_path):
    profile = _profile(4e-11)
    path = profile.save(tmp_path / "p.json")
    loaded = Profile.load(path)
    assert loaded == profile and loaded.threads[1].switched == profile.threads[1].switched != []


def test_the_chunk_prior_prices_a_decode_beside_chunks_with_the_switch_and_not_alone():
    """The controller's prior reads a decode beside a scorer's chunk as the pairs are read: each forward
    after the other model's start pays the switch, so its slowdowns grow with the table; its decode alone
    (``decode_iter_s``, back to back) does not."""
    from oppo_engine.sim.prior import predicted_profile

    def prior(rate: float):
        cost = CostModel(Calibrated(_profile(rate)))
        return predicted_profile(cost, {"actor": ACTOR, "reward": REWARD}, (8, 32), batch_size=4, running=4,
                                 prompt_len=16, response_len=16, local={"reward"})  # fmt: skip

    plain, switched = prior(0.0), prior(1e-8)
    assert switched.decode_iter_s == plain.decode_iter_s
    for c in (8, 32):
        assert switched.slowdown[c] > plain.slowdown[c]
