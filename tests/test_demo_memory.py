"""``run_modes`` frees each mode's models when the mode ends, for the tasks whose modes run one after the
other (``ONE_MODE_AT_A_TIME``: a real model's trainer holds gigabytes): while a mode steps, no earlier
mode's trainer, actor, critic or reference is alive, and none is once the run returns."""

from __future__ import annotations

import gc
import weakref

from oppo_engine.ppo import demo, tools_task


def test_each_mode_s_models_are_freed_when_it_ends(tmp_path, monkeypatch):
    cache = tools_task.build_tools_task(tmp_path / "task", steps=2, log=lambda _: None)
    refs: dict[str, list[weakref.ref]] = {}
    alive: dict[str, dict[str, int]] = {}  # mode -> {mode built so far: its objects alive at that step}
    make_trainer, one_step = demo.make_trainer, demo._one_step

    def spy_make(mode, *args):
        trainer = make_trainer(mode, *args)
        refs[mode] = [weakref.ref(x) for x in (trainer, trainer.actor, trainer.critic, trainer.reference)]
        return trainer

    def spy_step(trainer, run, *args):
        gc.collect()
        alive[run.mode] = {mode: sum(r() is not None for r in rs) for mode, rs in refs.items()}
        return one_step(trainer, run, *args)

    monkeypatch.setattr(demo, "make_trainer", spy_make)
    monkeypatch.setattr(demo, "_one_step", spy_step)
    opts = demo.DemoOptions(task="tools", modes=("sequential", "oppo"), steps=1, batch_size=2,
                            max_new_tokens=16, out=tmp_path / "out")  # fmt: skip
    (tmp_path / "out").mkdir()
    runs = demo.run_modes(opts, cache, cache, log=lambda _: None)
    assert [len(r.records) for r in runs] == [1, 1]
    assert alive == {"sequential": {"sequential": 4}, "oppo": {"sequential": 0, "oppo": 4}}
    gc.collect()
    assert [r() for rs in refs.values() for r in rs] == [None] * 8
