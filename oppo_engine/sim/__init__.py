"""The twin: the real engine on a virtual clock.

``executor`` holds the virtual clock and the lane executors that run the engine's lanes one at a time
(greenlets, so a schedule replays exactly), ``standin`` the stand-in models that replace the model
arithmetic (seeded tokens, fingerprints written and read through the real KV pages). The deterministic
simulator (``tests/sim/``) runs the engine on them; nothing here is a branch of the engine: the engine
reads its time and starts its lanes through ``sched/runtime.py``, which these replace.

Needs the ``sim`` extra (greenlet); matplotlib is imported only where a plot is drawn.
"""
