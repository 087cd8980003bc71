"""bench/bench_groups.py runs end to end on a tiny preset: both sides give the same rollouts, and the shared
side runs fewer tokens through every model (no timing is asserted)."""

from __future__ import annotations

import re

from bench import bench_groups


def test_bench_groups_runs_and_shares_the_prompt(capsys):
    bench_groups.main(
        [
            "--preset",
            "tiny",
            "--n",
            "4",
            "--groups",
            "2",
            "--prompt-len",
            "40",
            "--response-len",
            "3",
            "--rounds",
            "1",
        ]
    )
    out = capsys.readouterr().out
    assert "identical responses: True" in out
    ratios = dict(re.findall(r"(\w+)=([\d.]+)x", out.split("unshared / shared:")[1].splitlines()[0]))
    assert set(ratios) == {"actor", "reward"}
    # 2 prompts of 40 tokens, 4 samples each: unshared runs every prompt token 4 times, shared about once.
    assert all(float(r) > 2.5 for r in ratios.values()), ratios
    assert re.search(r"speedup_shared_vs_unshared=\d+\.\d\d", out)
