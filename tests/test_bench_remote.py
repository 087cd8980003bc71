"""bench/bench_remote.py runs end to end on the tiny preset (this process as the actor rank, a spawned one as
the scorer service): both blocks run every arm, only the remote arms send messages, the CPU accounting
covers both processes, and every machine-readable ratio is printed (no timing is asserted).
``bench/device_check.sh`` runs it on the GPU, where a crash would cost device time."""

from __future__ import annotations

import math
import re

from bench import bench_remote


def test_bench_remote_runs_every_arm_of_both_blocks(capsys):
    ratios = bench_remote.main(
        ["--actor", "tiny", "--scorer", "tiny", "--rounds", "1", "--steps", "2", "--turn", "1",
         "--batch-size", "4", "--overcommit", "2", "--prompt-len", "8", "--max-new-tokens", "6"]
    )  # fmt: skip
    out = capsys.readouterr().out

    blocks = re.findall(r"^round 0 block (remote-\w+): (.*) rollouts/s$", out, re.M)
    assert sorted(b for b, _ in blocks) == ["remote-intra", "remote-oppo"]
    for remote, rates in blocks:
        assert [r.split()[0] for r in rates.split(", ")] == [*bench_remote.COLOCATED, remote]

    row = r"^\s*(\S+)" + r"\s+([\d.]+)" * 6 + r"\s+(\d+)$"  # the table: arm, then seven numbers
    rows = {m[0]: [float(x) for x in m[1:]] for m in re.findall(row, out, re.M)}
    assert set(rows) == {*bench_remote.COLOCATED, *bench_remote.REMOTE}
    for arm, (rps, _, _, cpu, cores, messages, sent) in rows.items():
        assert rps > 0 and cpu > 0 and cores > 0, arm
        # A colocated arm sends nothing; a remote arm at least its hand-offs every step.
        assert (messages > 0 and sent > 0) if arm in bench_remote.REMOTE else messages == sent == 0, arm
    assert "service -> client per step: remote-intra" in out

    assert set(ratios) == {
        "remote_intra_vs_sequential",
        "remote_intra_exposed_vs_sequential",
        "remote_oppo_vs_colocated_oppo",
        "remote_oppo_cpu_vs_colocated_oppo",
        "remote_intra_cores",
        "sequential_scoring_share",
    }
    assert all(math.isfinite(v) and v >= 0 for v in ratios.values()), ratios
    for key, value in ratios.items():
        assert f"{key}={value:.2f}" in out
