"""The quarantine policy on its own (sched/quarantine.py), over opaque groups and fake runs.

A fake step fails while its groups include a poisoned one; every run is recorded, so the tests prove which
groups each retry and probe ran, not only the outcome.
"""

from __future__ import annotations

import pytest

from oppo_engine.sched.quarantine import describe, failed_in, is_retryable, model_call, run_quarantined


class Poison(RuntimeError):
    pass


class Runs:
    """A fake step over groups (ints): it fails (marked as the reward's) if it holds a poisoned group, or on
    the runs listed in ``flaky`` (0-based, counting attempts and probes together)."""

    def __init__(self, poisoned=(), flaky=(), error=Poison, role="reward") -> None:
        self.poisoned, self.flaky, self.error, self.role = set(poisoned), set(flaky), error, role
        self.log: list[tuple[str, list[int]]] = []

    def _run(self, kind: str, groups: list[int]) -> list[int]:
        self.log.append((kind, list(groups)))
        bad = sorted(self.poisoned & set(groups))
        if bad or len(self.log) - 1 in self.flaky:
            with model_call(self.role):
                raise self.error(f"bad group {bad}")
        return list(groups)

    def attempt(self, groups):
        return self._run("attempt", groups)

    def probe(self, groups):
        self._run("probe", groups)


def test_a_clean_step_runs_once():
    runs = Runs()
    out = run_quarantined(list(range(8)), runs.attempt, runs.probe)
    assert out.result == list(range(8)) and out.failed == [] and out.retries == 0
    assert runs.log == [("attempt", list(range(8)))]


def test_a_failure_that_does_not_reproduce_is_absorbed_by_one_retry():
    runs = Runs(flaky={0})
    out = run_quarantined(list(range(8)), runs.attempt, runs.probe)
    assert out.result == list(range(8)) and out.failed == [] and out.retries == 1
    assert [kind for kind, _ in runs.log] == ["attempt", "attempt"]


@pytest.mark.parametrize("culprit", [0, 3, 6])
def test_a_reproducing_failure_is_pinned_on_its_group_by_halving(culprit):
    runs = Runs(poisoned={culprit})
    groups = list(range(7))
    out = run_quarantined(groups, runs.attempt, runs.probe)
    assert [q.group for q in out.failed] == [culprit]
    assert isinstance(out.failed[0].error, Poison)
    assert out.result == [g for g in groups if g != culprit]  # the rest of the batch goes on
    probes = [g for kind, g in runs.log if kind == "probe"]
    assert len(probes) <= 2 * 3 + 1  # at most two halves per level of a 7-group bisection, one confirmation
    assert probes.count([culprit]) == 2  # the culprit failed alone, twice
    assert out.retries == len(runs.log) - 1


def test_a_group_that_fails_alone_only_once_is_not_quarantined():
    # Runs 0 and 1 (attempt, retry) fail, then the probe of [0] (run 2): flaky, not a culprit.
    runs = Runs(flaky={0, 1, 2})
    with pytest.raises(Poison):
        run_quarantined([0, 1], runs.attempt, runs.probe)
    assert runs.log == [("attempt", [0, 1]), ("attempt", [0, 1]), ("probe", [0]), ("probe", [0])]


def test_a_group_that_fails_in_whichever_model_meets_it_first_is_quarantined():
    # A poison prompt fails in every model with the same type; under streamed scoring which model meets it
    # first depends on the schedule. "The same way" is the exception type (issue 19), not the role.
    class Roles(Runs):
        def _run(self, kind, groups):
            self.log.append((kind, list(groups)))
            if 3 in groups:
                with model_call(("actor", "reward", "critic")[len(self.log) % 3]):
                    raise Poison("bad group 3")
            return list(groups)

    runs = Roles()
    out = run_quarantined(list(range(4)), runs.attempt, runs.probe)
    assert [q.group for q in out.failed] == [3] and out.result == [0, 1, 2]


def test_two_poisoned_groups_are_both_quarantined():
    runs = Runs(poisoned={1, 5})
    out = run_quarantined(list(range(8)), runs.attempt, runs.probe)
    assert sorted(q.group for q in out.failed) == [1, 5]
    assert out.result == [0, 2, 3, 4, 6, 7]


def test_a_failure_no_single_group_explains_propagates():
    class Pair(Runs):
        def _run(self, kind, groups):  # fails only when groups 0 and 5 run together
            self.log.append((kind, list(groups)))
            if {0, 5} <= set(groups):
                with model_call("actor"):
                    raise Poison("0 and 5 together")
            return list(groups)

    runs = Pair()
    with pytest.raises(Poison, match="together"):
        run_quarantined(list(range(8)), runs.attempt, runs.probe)


def test_a_retry_failing_with_another_type_propagates_the_second():
    class Twice(Runs):
        def _run(self, kind, groups):
            self.log.append((kind, list(groups)))
            with model_call("actor"):
                raise (Poison if len(self.log) == 1 else ValueError)("failed")

    runs = Twice()
    with pytest.raises(ValueError):
        run_quarantined(list(range(4)), runs.attempt, runs.probe)
    assert len(runs.log) == 2


def test_a_probe_that_fails_another_way_is_inconclusive_and_the_steps_error_propagates():
    # A probe that fails another way (here an error the engine raises itself) pins nothing on its groups.
    class Stalls(Runs):
        def _run(self, kind, groups):
            self.log.append((kind, list(groups)))
            if kind == "probe":
                raise RuntimeError("actor scheduler made no progress")
            with model_call("actor"):
                raise Poison("failed")

    runs = Stalls()
    with pytest.raises(Poison):
        run_quarantined(list(range(4)), runs.attempt, runs.probe)
    assert [kind for kind, _ in runs.log] == ["attempt", "attempt", "probe", "probe"]


@pytest.mark.parametrize(
    "error", [KeyboardInterrupt, MemoryError, lambda msg: RuntimeError("CUDA out of memory. " + msg)]
)
def test_interrupts_and_out_of_memory_are_never_retried(error):
    runs = Runs(poisoned={2}, error=error)
    with pytest.raises(BaseException) as info:
        run_quarantined(list(range(4)), runs.attempt, runs.probe)
    assert not isinstance(info.value, Poison)
    assert len(runs.log) == 1


def test_an_error_the_engine_raised_itself_is_not_retried():
    def attempt(groups):
        raise RuntimeError("actor scheduler made no progress")  # not inside model_call

    with pytest.raises(RuntimeError, match="no progress"):
        run_quarantined([0, 1], attempt, lambda groups: None)


def test_model_call_marks_the_role_and_keeps_the_exception():
    with pytest.raises(Poison) as info, model_call("critic"):
        raise Poison("x")
    assert failed_in(info.value) == "critic" and is_retryable(info.value)
    assert describe(info.value) == "critic: Poison: x"
    with pytest.raises(KeyboardInterrupt), model_call("actor"):  # BaseExceptions pass unmarked
        raise KeyboardInterrupt
