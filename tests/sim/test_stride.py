"""Decode in strides (``oppo_engine/sim/stride.py``) is exact with respect to the per-step model: a strided
world and an unstrided one give equal step records, lane timelines and switch profiles, in every mode and
placement, with preemption (an arena too small for every sequence) and with sampled groups."""

from __future__ import annotations

import dataclasses

import pytest

from oppo_engine import EngineConfig
from oppo_engine.control import ChunkControl
from oppo_engine.sim.cost import CostModel, HostCosts, roofline
from oppo_engine.sim.devices import device
from oppo_engine.sim.lengths import parse_lengths
from oppo_engine.sim.profile import Calibrated, Profile, ThreadCosts
from oppo_engine.sim.shapes import model_shape
from oppo_engine.sim.twin import Setting, World

H100 = roofline(device("h100"))


def _cpu_cost() -> CostModel:
    """A CPU profile with made-up constants (a test input, not a measurement), as test_twin's, and a switch
    after another model's forward (so a strided decode after a scorer's start must be charged as the
    engine's own)."""
    gemm = {kn: [(1, 2e9), (16, 2e10), (256, 5e10)] for kn in (16384, 1048576)}
    switched = [(4.0 * 2**20, 1e-4), (32.0 * 2**20, 3e-4)]
    costs = ThreadCosts(gemm, 1e10, 1e-4, 2e-5, 1e-10, 1e-11, 1e-9, 1e-9, 0.05, switched=switched)
    return CostModel(
        Calibrated(Profile("cpu:test", "cpu", {1: costs}, HostCosts(2e-5, 3e-6, 5e-6), 5e9, cores=2))
    )


def _setting(placement: str, **changes) -> Setting:
    shapes = {"actor": model_shape("0.5b", name="actor"), "reward": model_shape("0.5b", head="score"),
              "critic": model_shape("0.5b", head="value"), "reference": model_shape("0.5b")}  # fmt: skip
    values = dict(
        shapes=shapes, cost=H100, placement=placement, gpus=2, batch_size=8,
        lengths=parse_lengths("lognormal:median=60,sigma=0.9,cap=300"), prompt_lengths=parse_lengths(24),
        config=EngineConfig(chunk=ChunkControl(candidates=(16, 64))),
    )  # fmt: skip
    values.update(changes)
    return Setting(**values)


def _run(setting: Setting, mode: str, chunk, stride: bool, steps: int = 3):
    world = World(setting, mode, chunk_size=chunk, steps=steps, stride=stride)
    try:
        records = world.run(steps)
        profiler = world.engines[0]._profiler
        profile = profiler.profile() if profiler is not None else None
        strided = sum(e._loop.actor.stride.forwards for e in world.engines) if stride else 0
        preempted = sum(e._loop.actor_sched.num_preemptions for e in world.engines)
        spans = world.timeline()
        metrics = [dataclasses.replace(r) for r in records]
    finally:
        world.close()
    return metrics, spans, profile, strided, preempted


CASES = [
    ("7+1", "sequential", None, {}),
    ("7+1", "inter", None, {}),
    ("colocated", "intra", 16, {}),
    ("colocated", "oppo", 64, {}),
    ("7+1", "oppo", "auto", {}),
    ("colocated", "inter", None, {"group_size": 4, "batch_size": 8, "arena_pages": 90}),
    ("colocated", "sequential", None, {"arena_pages": 90}),
    ("cpu", "oppo", 16, {"gpus": 1, "cost": "cpu", "cores": 2}),
]


@pytest.mark.parametrize(("placement", "mode", "chunk", "changes"), CASES)
def test_a_strided_world_equals_the_unstrided_one(placement, mode, chunk, changes):
    if changes.get("cost") == "cpu":
        changes = {**changes, "cost": _cpu_cost()}
        changes["shapes"] = {r: model_shape("small", head=h, name=r).with_head(h, 4)
                             for r, h in (("actor", "lm"), ("reward", "score"))}  # fmt: skip
    setting = _setting(placement, **changes)
    plain = _run(setting, mode, chunk, stride=False)
    strided = _run(setting, mode, chunk, stride=True)
    assert strided[3] > 0  # it strided
    assert plain[4] == strided[4]
    assert (plain[4] > 0) == ("arena_pages" in changes)  # a small arena preempts
    for a, b in zip(plain[0], strided[0], strict=True):
        assert dataclasses.asdict(a) == dataclasses.asdict(b)
    # rank 0's lane spans, forward by forward (a strided forward's are recorded when the stride ends)
    assert sorted(plain[1]) == sorted(strided[1])
    assert plain[2] == strided[2]  # the switch profile the engine's profiler measured
