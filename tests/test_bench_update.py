"""bench/bench_update.py: each arm runs the configuration it names, whichever arm ran before it."""

import itertools
from types import SimpleNamespace

from bench import bench_update
from oppo_engine.ppo import PPOConfig


def test_each_arm_configures_the_trainer_as_named_whatever_ran_before():
    trainer = SimpleNamespace(config=PPOConfig())
    expected = {
        "padded": (False, None),
        "grouped": (True, None),
        "packed": (False, 528),
    }
    for before, arm in itertools.product(bench_update.ARMS, repeat=2):
        bench_update._configure(trainer, before, 528)
        bench_update._configure(trainer, arm, 528)
        got = (trainer.config.group_by_length, trainer.config.max_tokens_per_microbatch)
        assert got == expected[arm], (before, arm)


def test_one_packed_arm_per_budget_and_the_others_once():
    assert bench_update.expand_arms(["padded", "packed"], None) == [
        ("padded", "padded", None),
        ("packed", "packed", None),
    ]
    assert bench_update.expand_arms(["packed", "grouped"], [528, 2048]) == [
        ("packed@528", "packed", 528),
        ("packed@2048", "packed", 2048),
        ("grouped", "grouped", None),
    ]
