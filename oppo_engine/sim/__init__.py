"""The twin: the real engine on a cost model's clock.

``plan`` predicts a PPO run (s/step per mode and its split, the chunk size and Δ, memory per GPU);
``calibrate`` times the local device into a ``Profile``, which ``plan`` (and the chunk controller's prior)
price work with. Inside: the cost model (``cost``, ``devices``, ``profile``), the virtual clock and lane
executors (``executor``, ``world``), the stand-in models (``standin`` for the deterministic simulator of
``tests/sim/``, ``models`` for the twin) and the runs (``twin``, ``plan``). Nothing here is a branch of the
engine: it reads its time and starts its lanes through ``sched/runtime.py``, which the twin replaces.

Needs the ``sim`` extra (greenlet); matplotlib is imported only where a plot is drawn.
"""

from __future__ import annotations

__all__ = ["Plan", "Profile", "calibrate", "plan"]


def __getattr__(name: str):
    # NOTE: lazy, so that importing a module of this package (the engine imports sim.prior) imports
    # neither the twin nor the engine it runs.
    if name in ("plan", "Plan"):
        from oppo_engine.sim import planner  # noqa: PLC0415

        return getattr(planner, name)
    if name == "calibrate":
        from oppo_engine.sim.calibration import calibrate  # noqa: PLC0415

        return calibrate
    if name == "Profile":
        from oppo_engine.sim.profile import Profile  # noqa: PLC0415

        return Profile
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
