"""The twin (``oppo_engine/sim``): the cost model's sanity bounds, the contention rule and the scorer
service, the real engine on the twin's clock, plans (extrapolated against full runs, bad input refused,
nothing half-written), profiles, and the chunk controller's prior."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from oppo_engine import EngineConfig
from oppo_engine.control import OFF, ChunkControl, ChunkSizeController, SwitchProfile
from oppo_engine.sim import Profile, plan
from oppo_engine.sim.cost import KERNELS_PER_LAYER, Batch, CostModel, HostCosts, Work, roofline
from oppo_engine.sim.devices import DEVICES, device
from oppo_engine.sim.lengths import parse_lengths
from oppo_engine.sim.profile import Calibrated, ThreadCosts, default_profile_path, local_device_id
from oppo_engine.sim.shapes import model_shape
from oppo_engine.sim.twin import Setting, World
from oppo_engine.sim.world import Fabric, ScorerService

H200 = roofline(device("h200"))
SEVEN_B = model_shape("7b")


def _cpu_profile(device_id: str = "cpu:test") -> Profile:
    """A profile with made-up constants (a test input, not a measurement)."""
    gemm = {kn: [(1, 2e9), (16, 2e10), (256, 5e10)] for kn in (16384, 1048576)}
    costs = ThreadCosts(gemm, 1e10, 1e-4, 2e-5, 1e-10, 1e-11, 1e-9, 1e-9, 0.05)
    return Profile(device_id, "cpu", {1: costs}, HostCosts(2e-5, 3e-6, 5e-6), 5e9, cores=2)


# -- the cost model -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("context", [1, 512, 4096])
def test_a_7b_bf16_decode_step_on_an_h200_is_never_faster_than_reading_its_weights(context):
    floor = SEVEN_B.weight_bytes / device("h200").hbm_bandwidth
    for captured in (True, False):
        work = H200.forward(SEVEN_B, Batch(((1, context),), 1, 1), captured=captured)
        assert work.alone_s >= floor
        assert work.alone_s < 3 * floor  # and it is bound by the weights, not by a stray term


def test_a_4096_token_prefill_is_never_faster_than_its_flops_at_peak():
    for key, dev in DEVICES.items():
        cost = roofline(dev)
        for shape in (SEVEN_B, model_shape("0.5b"), model_shape("3b")):
            work = cost.forward(shape, Batch(((4096, 4096),), 1))
            flops = 2 * shape.params * 4096 + 4 * shape.layers * shape.q_width * 4096 * 4097 / 2
            assert work.alone_s >= flops / dev.bf16_flops, (key, shape.name)


@pytest.mark.parametrize("source", ["roofline", "calibrated"])
def test_costs_are_monotone_in_rows_tokens_and_context(source):
    cost = H200 if source == "roofline" else CostModel(Calibrated(_cpu_profile()))
    shape = model_shape("0.5b") if source == "roofline" else model_shape("small")

    def t(rows, new, ctx):
        return cost.forward(shape, Batch(tuple((new, ctx) for _ in range(rows)), rows, rows)).alone_s

    for rows in (1, 2, 7, 16, 64):
        for new in (1, 3, 16, 100):
            for ctx in (new, new + 50, new + 900):
                here = t(rows, new, ctx)
                assert t(rows + 1, new, ctx) >= here
                assert t(rows, new + 1, ctx + 1) >= here
                assert t(rows, new, ctx + 100) >= here


def test_kernels_per_layer_is_what_a_qwen2_layer_launches():
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import AutoModelForCausalLM, Qwen2Config

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    model = AutoModelForCausalLM.from_config(config).eval()
    ids, pos = torch.randint(0, 64, (1, 8)), torch.arange(8)[None]
    views = ("aten.view", "aten._unsafe_view", "aten.t.", "aten.expand", "aten.transpose",
             "aten.unsqueeze", "aten.slice", "aten.select", "aten.reshape", "aten.detach", "aten._to_copy",
             "aten.alias")  # fmt: skip
    with torch.inference_mode():
        hidden = model.model.embed_tokens(ids)
        rope = model.model.rotary_emb(hidden, pos)
        with Count() as count:
            model.model.layers[0](hidden, position_embeddings=rope, attention_mask=None, position_ids=pos)
    assert len([op for op in count.ops if not op.startswith(views)]) == KERNELS_PER_LAYER


def test_the_update_grows_with_padded_tokens_and_shrinks_with_gpus():
    shapes = [SEVEN_B, SEVEN_B.with_head("value")]

    def mb(width, ranks=7):
        return [[[width] * 8 for _ in range(ranks)]]

    one = H200.update(shapes, mb(600), gpus=7, epochs=2)
    assert H200.update(shapes, mb(1200), gpus=7, epochs=2) > one
    assert H200.update(shapes, mb(600), gpus=7, epochs=4) > one
    assert H200.update(shapes, [[[600] * 56]], gpus=1, epochs=2) > one


# -- contention and the scorer service ----------------------------------------------------------------------


class _Lane:
    pass


def test_a_decode_beside_a_prefill_slows_each_by_the_others_demand_on_its_bottleneck():
    decode = Work(0.0, 0.0, ((0.1, 1.0),))  # memory-bound: a_f = 0.1, a_m = 1
    prefill = Work(0.0, 0.0, ((1.0, 0.2),))  # compute-bound: a_f = 1, a_m = 0.2
    fabric = Fabric({"gpu": 1})
    a, b = _Lane(), _Lane()
    fabric.submit(a, decode, "gpu", "p", 0.0)
    fabric.submit(b, prefill, "gpu", "p", 0.0)
    # S_f = 1.1, S_m = 1.2: the decode's memory term stretches by 1.2, the prefill's compute term by 1.1.
    ends = sorted((it.end, it.lane is a) for it in fabric.items)
    assert ends == [(pytest.approx(1.1), False), (pytest.approx(1.2), True)]
    assert fabric.fire(1.1 + 1e-9) == [b]
    # Alone again, the decode finishes what is left of it at its own pace.
    assert fabric.items[0].end == pytest.approx(1.1 + (1 - 1.1 / 1.2) * 1.0)


def test_on_one_cpu_core_a_memory_bound_decode_beside_a_prefill_waits_for_the_core():
    # The same pair as on the GPU above, on a CPU of one core: a kernel stalled on memory still holds its
    # core, so the cores' oversubscription (a_f = 1 + 1 = 2) stretches the decode's memory term too.
    decode = Work(0.0, 0.0, ((0.1, 1.0),))
    prefill = Work(0.0, 0.0, ((1.0, 0.2),))
    fabric = Fabric({"cpu": 1}, cpus=frozenset({"cpu"}))
    a, b = _Lane(), _Lane()
    fabric.submit(a, decode, "cpu", "p", 0.0)
    fabric.submit(b, prefill, "cpu", "p", 0.0)
    assert sorted(it.end for it in fabric.items) == pytest.approx([2.0, 2.0])


def test_two_decodes_share_the_bandwidth_and_lanes_of_different_devices_do_not_contend():
    decode = Work(0.0, 0.0, ((0.0, 1.0),))
    fabric = Fabric({"gpu0": 1, "gpu1": 1})
    fabric.submit(_Lane(), decode, "gpu0", "p0", 0.0)
    fabric.submit(_Lane(), decode, "gpu0", "p0", 0.0)
    fabric.submit(_Lane(), decode, "gpu1", "p1", 0.0)
    assert sorted(it.end for it in fabric.items) == pytest.approx([1.0, 2.0, 2.0])


def test_one_process_shares_its_interpreter_and_two_processes_do_not():
    python = Work(1.0, 0.0, ())
    fabric = Fabric({"gpu0": 1, "gpu1": 1})
    fabric.submit(_Lane(), python, "gpu0", "rank0", 0.0)
    fabric.submit(_Lane(), python, "gpu0", "rank0", 0.0)
    fabric.submit(_Lane(), python, "gpu1", "rank1", 0.0)
    assert sorted(it.end for it in fabric.items) == pytest.approx([1.0, 2.0, 2.0])


def test_the_scorer_service_runs_every_rank_queued_at_once_in_one_forward_per_model():
    priced = []

    def price(role, batch):
        priced.append((role, batch.chunks))
        return Work(0.0, 0.0, ((float(batch.tokens), 0.0),))

    service = ScorerService(price, ("reward", "reference"))
    lanes = [_Lane() for _ in range(3)]
    for i, lane in enumerate(lanes):
        service.submit(lane, "reward", Batch(((i + 1, i + 1),), 1), 0.0)
    service.submit(lanes[0], "reference", Batch(((4, 4),), 4), 0.0)
    assert service.next_time() == 0.0
    assert service.fire(0.0) == []  # the round starts now, with all four
    assert priced == [("reward", ((1, 1), (2, 2), (3, 3))), ("reference", ((4, 4),))]
    assert service.fire(6.0) == lanes  # the reward's forward (6 tokens) ends at 6
    late = _Lane()
    service.submit(late, "reward", Batch(((1, 1),), 1), 7.0)  # queued during the round: the next one
    assert service.fire(10.0) == [lanes[0]] and service.next_time() == 10.0
    assert service.fire(10.0) == [] and service.fire(11.0) == [late]


# -- the engine on the twin's clock -------------------------------------------------------------------------


def _setting(**changes) -> Setting:
    shapes = {"actor": model_shape("0.5b"), "reward": model_shape("0.5b", head="score"),
              "critic": model_shape("0.5b", head="value")}  # fmt: skip
    values = dict(shapes=shapes, cost=roofline(device("h100")), placement="7+1", gpus=3, batch_size=8,
                  lengths=parse_lengths([40, 90, 20, 160, 60, 30, 75, 110]), prompt_lengths=parse_lengths(16),
                  config=EngineConfig(chunk=ChunkControl(candidates=(16, 32, 64))))  # fmt: skip
    values.update(changes)
    return Setting(**values)


@pytest.mark.parametrize("mode", ["sequential", "intra", "inter", "oppo"])
def test_every_rank_returns_its_batch_each_step_and_every_prompt_once(mode):
    setting = _setting()
    world = World(setting, mode, chunk_size=16 if mode in ("intra", "oppo") else None, steps=4)
    seen = []
    try:
        for _ in range(4):
            record = world.run(1)[0]
            assert len(record.rows) == setting.batch_size
            assert record.rollout_s > 0 and record.update_s > 0 and 0 < record.busy_s <= record.gpu_seconds
        for rank, engine in enumerate(world.engines):
            for seq in engine._buffer.carried:
                seen.append((rank, seq.prompt_index))
    finally:
        world.close()
    assert len(seen) == len(set(seen))


def test_the_stand_in_actor_ends_each_response_at_its_drawn_length():
    setting = _setting(gpus=2)
    world = World(setting, "sequential", steps=1)
    try:
        engine = world.engines[0]
        result = engine.step()
        for r in result.rollouts:
            assert len(r.response_ids) == setting.lengths[r.group_id]
    finally:
        world.close()


# -- plans --------------------------------------------------------------------------------------------------


SHORT = dict(reward="0.5b", critic="0.5b", device="h100", batch_size=8, prompt_lengths=16,
             lengths=[40, 90, 20, 160, 60, 30, 75, 110], sweep=(16, 64),
             config=EngineConfig(chunk=ChunkControl(candidates=(16, 64))))  # fmt: skip


def test_the_extrapolated_plan_agrees_with_a_full_run_on_a_short_plan():
    kw = dict(SHORT, gpus=2, placement="7+1", steps=12)
    short, full = plan("0.5b", extrapolate=True, **kw), plan("0.5b", extrapolate=False, **kw)
    for mode in ("sequential", "intra", "inter", "oppo"):
        a, b = short.modes[mode], full.modes[mode]
        assert a.s_per_step == pytest.approx(b.s_per_step, rel=0.05), mode
        assert a.rollout_s == pytest.approx(b.rollout_s, rel=0.08), mode
        assert a.update_s == pytest.approx(b.update_s, rel=0.08), mode
    assert short.modes["sequential"].speedup == 1.0


def test_a_7p1_placement_never_exposes_more_scoring_than_colocated_on_the_same_gpu_work():
    """The same actor rank, its frozen scorers moved to a GPU of their own (1 + 1) or beside it (colocated):
    off the actor's device they run the same work without contending, so no more of it is exposed."""
    kw = dict(SHORT, steps=6)
    split = plan("0.5b", gpus=2, placement="7+1", **kw)
    shared = plan("0.5b", gpus=1, placement="colocated", **kw)
    for mode, alone in split.modes.items():
        beside = shared.modes[mode]
        assert alone.exposed_scoring_s <= beside.exposed_scoring_s * 1.001 + 1e-9, mode
        for c in alone.chunk_sweep:  # and not at any chunk size either
            assert alone.chunk_sweep[c] <= beside.chunk_sweep[c] * 1.001, (mode, c)


def test_a_plan_reports_memory_and_says_it_does_not_fit_without_raising():
    p = plan("7b", reward="7b", critic="7b", reference="7b", device="a100-80gb", gpus=1,
             placement="colocated", batch_size=4, lengths=64, prompt_lengths=16, steps=2,
             modes=("sequential",))  # fmt: skip
    assert not p.fits
    assert set(p.memory_per_gpu) == {"weights", "grads", "optimizer", "kv", "activations"}
    assert p.memory_per_gpu["optimizer"] == 8 * (SEVEN_B.params + SEVEN_B.with_head("value").params)
    assert "actor GPU needs" in p.why and "over by" in p.why and "of 80.0 GB" in p.why
    assert "DOES NOT FIT" in p.table()
    fits = plan("0.5b", reward="0.5b", device="h200", gpus=2, batch_size=4, lengths=64, prompt_lengths=16,
                steps=2, modes=("sequential",))  # fmt: skip
    assert fits.fits and fits.why is None


def test_unknown_device_lists_the_known_ones():
    with pytest.raises(ValueError, match="unknown device 'b300'") as info:
        plan("0.5b", device="b300", steps=1)
    assert all(key in str(info.value) for key in DEVICES)


def test_a_malformed_lengths_file_names_its_line(tmp_path):
    path = tmp_path / "lengths.txt"
    path.write_text("# lengths\n120\n88\nabc\n5\n")
    with pytest.raises(ValueError, match=r"lengths\.txt: line 4: 'abc' is not a length"):
        plan("0.5b", lengths=str(path), steps=1)
    path.write_text("120\n0\n")
    with pytest.raises(ValueError, match="line 2"):
        parse_lengths(path)
    records = tmp_path / "records.json"
    records.write_text(json.dumps([{"response_len": 4}, {"response_ids": [1, 2]}]))
    assert [parse_lengths(records)[i] for i in range(3)] == [4, 2, 4]


@pytest.mark.parametrize(
    ("lengths", "match"),
    [("lognormal:median=250,sigma=0.9", "needs cap"), ("zipf:a=2", "unknown law 'zipf'"),
     ("uniform:low=9,high=3", "low <= high"), ([3, 0], r"lengths\[1\]"), ([], "empty")],
)  # fmt: skip
def test_a_bad_length_law_is_refused_naming_what_is_wrong(lengths, match):
    with pytest.raises(ValueError, match=match):
        parse_lengths(lengths)


def test_a_profile_from_another_version_or_device_is_refused(tmp_path):
    path = _cpu_profile().save(tmp_path / "p.json")
    assert Profile.load(path) == _cpu_profile()
    with pytest.raises(ValueError, match="calibrated on 'cpu:test', not on this device"):
        Profile.load(path, device="cpu:another")
    data = json.loads(path.read_text())
    path.write_text(json.dumps({**data, "version": 99}))
    with pytest.raises(ValueError, match="format version 99"):
        Profile.load(path)
    with pytest.raises(ValueError, match=r"cannot plan placement '7\+1'"):
        plan("small", device=_cpu_profile(), gpus=2, placement="7+1", steps=1)
    with pytest.raises(ValueError, match="placement 'cpu' plans with a calibrated CPU Profile"):
        plan("small", device="h200", placement="cpu", steps=1)


def test_nothing_is_half_written_when_saving_fails(tmp_path, monkeypatch):
    path = _cpu_profile().save(tmp_path / "p.json")
    before = path.read_text()
    monkeypatch.setattr(json, "dumps", lambda *a, **k: (_ for _ in ()).throw(OSError("disk full")))
    with pytest.raises(OSError, match="disk full"):
        dataclasses.replace(_cpu_profile(), device="cpu:other").save(path)
    assert path.read_text() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["p.json"]


def test_the_plan_command_writes_its_json_and_pngs_and_refuses_bad_input(tmp_path, capsys):
    from oppo_engine.cli import main

    out = tmp_path / "out"
    with pytest.raises(SystemExit) as info:
        main(["plan", "--device", "b300", "--out", str(out)])
    assert info.value.code == 2 and "unknown device 'b300'" in capsys.readouterr().err
    assert not out.exists()
    code = main(["plan", "--actor", "0.5b", "--device", "h100", "--gpus", "2", "--batch-size", "4",
                 "--lengths", "uniform:low=8,high=40", "--prompt-lengths", "8", "--steps", "6",
                 "--chunk-candidates", "8,16", "--sweep", "8,16", "--out", str(out)])  # fmt: skip
    assert code == 0
    text = capsys.readouterr().out
    assert "PREDICTED by the twin" in text and "speed-up" in text
    data = json.loads((out / "plan.json").read_text())
    assert data["prediction"] is True and set(data["modes"]) == {"sequential", "intra", "inter", "oppo"}
    assert all(key.isdigit() for key in data["modes"]["oppo"]["chunk_sweep"])
    assert (out / "plan_step.png").stat().st_size > 1000 and (out / "plan_chunks.png").stat().st_size > 1000


# -- the chunk controller's prior ---------------------------------------------------------------------------


def _prior(best: int) -> SwitchProfile:
    """A predicted profile whose cost model puts the optimum at ``best`` (C* = sqrt(N h / (k p)), N = 1000
    iterations, k = 1 tail sequence, p = 1e-4 s per token) and makes "off" (all the scoring exposed)
    hopeless."""
    return SwitchProfile(handoff_s=best * best * 1e-4 / 1000, prefill_s_per_token=1e-4, decode_iter_s=1e-4,
                         slowdown={}, running_seqs=10.0, tail_seqs=1.0, tokens_per_step=10_000.0,
                         scored_tokens_per_step=10_000.0)  # fmt: skip


def test_under_a_prior_the_first_exploration_is_the_predicted_best_and_its_neighbours():
    control = ChunkControl(candidates=(4, 8, 16, 32, 64, 128, 256), off=True, warmup_steps=0)
    ctrl = ChunkSizeController(control)
    ctrl.set_prior(_prior(64))
    first = []
    while len(first) < 3:
        arm = ctrl.chunk_size()
        first.append(arm)
        ctrl.observe(arm, 1.0 if arm == 64 else 1.2, 1000)
    assert sorted(first) == [32, 64, 128]
    assert ctrl.incumbent == 64
    without = ChunkSizeController(control)  # today's list: "off" first, then around the middle candidate
    assert [without.chunk_size()] == [OFF]


def test_a_measured_profile_keeps_the_priors_slowdowns_for_chunk_sizes_not_run():
    ctrl = ChunkSizeController(ChunkControl(candidates=(16, 32, 64)))
    ctrl.set_prior(dataclasses.replace(_prior(32), slowdown={16: 0.1, 32: 0.2, 64: 0.4}))
    measured = dataclasses.replace(_prior(32), slowdown={32: 0.05}, tail_seqs=0.0)
    ctrl.set_profile(measured)
    model = ctrl.model()
    assert model.slowdown == {16: 0.1, 32: 0.05, 64: 0.4}
    assert model.tail_seqs == 0.0  # measured on a streamed step (it has a slowdown): kept
    ctrl.set_profile(dataclasses.replace(measured, slowdown={}))
    assert ctrl.model().tail_seqs == 1.0  # no streamed step measured yet: the prior's


def _engine(tmp_path, monkeypatch, **config):
    from oppo_engine import RolloutEngine, SamplingParams
    from tests.sim.models import EOS, sim_models

    monkeypatch.setenv("OPPO_ENGINE_PROFILES", str(tmp_path))
    m = sim_models()
    cfg = EngineConfig(batch_size=4, mode="oppo", max_model_len=64, **config)
    return RolloutEngine(actor=m.actor, reward=m.reward, config=cfg, eos_token_id=EOS,
                         sampling=SamplingParams(max_new_tokens=32))  # fmt: skip


def test_on_a_cpu_without_a_calibrated_profile_the_prior_is_the_candidate_list(tmp_path, monkeypatch):
    engine = _engine(tmp_path, monkeypatch)
    try:
        assert engine.config.chunk.prior == "model"
        assert engine._chunk_control.prior is None
        assert engine._chunk_control.chunk_size() == OFF  # today's first arm
    finally:
        engine.close()


def test_with_a_profile_calibrated_on_this_cpu_the_prior_comes_from_it(tmp_path, monkeypatch):
    ident = local_device_id("cpu")
    monkeypatch.setenv("OPPO_ENGINE_PROFILES", str(tmp_path))
    dataclasses.replace(_cpu_profile(ident)).save(default_profile_path(ident))
    engine = _engine(tmp_path, monkeypatch)
    try:
        ctrl = engine._chunk_control
        assert ctrl.prior is not None and set(ctrl.prior.slowdown) == set(engine.config.chunk.candidates)
        ranked = [a for a in ctrl.ranking() if a != OFF]
        assert set(ctrl._plan) <= ctrl._neighbourhood(ranked)
    finally:
        engine.close()
    listed = _engine(tmp_path, monkeypatch, chunk=ChunkControl(prior="list"))
    try:
        assert listed._chunk_control.prior is None
    finally:
        listed.close()


def test_a_stale_profile_where_the_engine_looks_is_refused_with_a_warning(tmp_path, monkeypatch, caplog):
    ident = local_device_id("cpu")
    monkeypatch.setenv("OPPO_ENGINE_PROFILES", str(tmp_path))
    path = _cpu_profile(ident).save(default_profile_path(ident))
    path.write_text(json.dumps({**json.loads(path.read_text()), "version": 0}))
    with caplog.at_level("WARNING"):
        engine = _engine(tmp_path, monkeypatch)
    try:
        assert engine._chunk_control.prior is None
        assert "format version 0" in caplog.text
    finally:
        engine.close()


def test_calibrate_writes_a_profile_of_this_device_that_prices_other_models(tmp_path, monkeypatch):
    from oppo_engine.presets import build_models
    from oppo_engine.sim import calibrate, calibration

    actor, reward = build_models("tiny", torch.float32, "cpu", 0)
    path = tmp_path / "profile.json"
    saved = torch.get_num_threads()
    benches = []

    class Bench(calibration._RoleBench):  # records how each role's forwards were timed
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            benches.append(self)

    monkeypatch.setattr(calibration, "_RoleBench", Bench)
    interpreted = []  # the pairs whose streamed step the interpreter penalty was fitted to
    fit_interpreter = calibration._fit_interpreter

    def record(a, r, profile):
        interpreted.append((a, r))
        return fit_interpreter(a, r, profile)

    monkeypatch.setattr(calibration, "_fit_interpreter", record)
    try:
        profile = calibrate(actor, reward, path=path, threads=(1,))
    finally:
        torch.set_num_threads(saved)
    # The interpreter penalty from a streamed step of the one-layer copies (mostly Python), not the models'.
    pairs = [
        (type(a), type(r), a.config.num_hidden_layers, r.config.num_hidden_layers) for a, r in interpreted
    ]
    assert pairs == [(type(actor), type(reward), 1, 1)]
    assert interpreted[0][0] is not actor and interpreted[0][1] is not reward
    # The actor's forwards were timed as the engine runs them on the CPU: its weights packed (and used:
    # packs exist after the timed forwards); the reward's not. The packed GEMMs and streaming were timed
    # over the same grids as the unpacked ones.
    packs = calibration.packing(torch.device("cpu"), torch.float32)
    assert {b.role: b.runner.packed is not None for b in benches} == {"actor": packs, "reward": False}
    # The fixed costs were fitted from shrunk copies of both models, of their classes, at depths 1 and 4
    # (the models' 2, twice), over the shrunk grid's small forwards, the actor's packed as the actor's are;
    # the one-layer copies ran again in pairs for the interpreter's hand-overs (``HANDOVER_PAIRS``).
    copies = [b for b in benches if b.model is not actor and b.model is not reward]
    assert sorted((b.role, b.model.config.num_hidden_layers) for b in copies) == [
        ("actor", 1), ("actor", 1), ("actor", 4), ("reward", 1), ("reward", 1), ("reward", 4)
    ]  # fmt: skip
    assert all(type(b.model) is type({"actor": actor, "reward": reward}[b.role]) for b in copies)
    assert all(b.model.config.hidden_size == 4 * calibration.SHRUNK_HEAD_DIM for b in copies)
    if packs:
        assert all(b.runner.packed.nbytes > 0 for b in benches if b.role == "actor")
        ts = profile.threads[1]
        assert ts.packed and set(ts.gemm_packed) == set(ts.gemm)
        assert [(w, r) for w, r, _ in ts.streaming_packed] == [(w, r) for w, r, _ in ts.streaming]
        assert ts.repack_s + ts.repack_byte_s > 0  # packing the actor's weights again: timed, priced
    else:
        assert profile.threads[1].repack_s == profile.threads[1].repack_byte_s == 0
    assert torch.get_num_threads() == saved
    assert Profile.load(path, device=local_device_id("cpu")) == profile
    assert profile.kind == "cpu" and set(profile.threads) == {1} and 1.0 <= profile.cores
    # The host time of a forward is positive; how it splits into a per-forward and a per-row part is a
    # fit of two noisy points (the fit clips a negative part to 0 on a loaded machine).
    host = profile.host
    assert min(host.per_forward_s, host.per_row_s) >= 0 and host.per_forward_s + 4 * host.per_row_s > 0
    assert host.interpreter_penalty >= 1.0 and host.interpreter_handover >= 0.0
    costs = profile.threads[1]
    # Every feature was in the timed forwards (a vocabulary head among them): nothing is unfitted, whatever
    # the fit made of the small terms under this machine's load (it zeroed pair_s at load 14).
    assert costs.unfitted == {}
    rows = (1, 3, 15, 63, 300)
    assert all(costs.gemm_s(m + 1, kn) >= costs.gemm_s(m, kn) for kn in costs.gemm for m in rows)
    # A model it never timed (another width and depth) gets a price that grows with its size.
    cost = CostModel(Calibrated(profile))
    small, large = model_shape("small", dtype_bytes=4), model_shape("0.5b", dtype_bytes=4)
    batch = Batch(tuple((1, 64) for _ in range(4)), 4, 4)
    assert 0 < cost.forward(small, batch).alone_s < cost.forward(large, batch).alone_s


def test_the_calibrate_command_refuses_an_unknown_model(capsys, tmp_path):
    from oppo_engine.cli import main

    with pytest.raises(SystemExit) as info:
        main(["calibrate", "--actor", "nonexistent", "--out", str(tmp_path / "p.json")])
    assert info.value.code == 2 and "nonexistent" in capsys.readouterr().err
    assert not (tmp_path / "p.json").exists()


def test_measuring_host_costs_with_no_repeat_is_refused():
    from oppo_engine.sim.twin import measure_host_costs

    with pytest.raises(ValueError, match="repeats must be >= 1"):
        measure_host_costs(repeats=0)
    with pytest.raises(ValueError, match="0 < short < long"):
        measure_host_costs(tokens=(96, 16))


def test_the_twins_prompts_share_no_prefix_as_the_benches_random_prompts_do():
    """The real engine forks a prompt prefix two prompts have alike (``share_prompt_prefix``, on by default);
    the twin's synthetic prompts must not begin alike, or it prices prefill the measured engine does (random
    prompts) and a user's workload does not get. 96 prompts of 128 tokens: once the twin's prompts repeated
    every 59, and the actor forked ~9,400 tokens a step."""
    setting = _setting(placement="colocated", gpus=1, batch_size=96, lengths=parse_lengths(40),
                       prompt_lengths=parse_lengths(128))  # fmt: skip
    assert setting.config.share_prompt_prefix  # the default the twin's engines run with
    world = World(setting, "sequential", steps=2)
    try:
        world.run(2)
        forked = world.engines[0]._loop.actor_sched.cache.shared_tokens
    finally:
        world.close()
    assert forked == 0


def test_the_host_fit_recovers_a_steps_own_cost_apart_from_its_forwards():
    """Steps made from known costs: the fit finds each of them, the per-step cost not spread over the
    forwards (a long step alone would price a short one without most of it)."""
    from oppo_engine.sim.twin import fit_host_costs

    per_step, base, per_row, handoff = 4e-4, 2e-5, 3e-6, 6e-6

    def step(rows: int, forwards: int, handoffs: int = 0) -> tuple[float, int, int]:
        return per_step + forwards * (base + per_row * rows) + handoffs * handoff, forwards, handoffs

    seq = {4: step(4, 96), 16: step(16, 96)}
    intra = {4: step(4, 96, 24), 16: step(16, 96, 30)}
    got = fit_host_costs(seq, step(4, 16), intra)
    assert got.per_step_s == pytest.approx(per_step)
    assert got.per_forward_s == pytest.approx(base)
    assert got.per_row_s == pytest.approx(per_row)
    assert got.handoff_s == pytest.approx(handoff)
    # no short step (or one as long): nothing per step, as before the term
    assert fit_host_costs(seq, seq[4], intra).per_step_s == 0.0


@pytest.mark.parametrize("mode", ["sequential", "inter", "oppo"])
def test_the_twin_charges_a_steps_own_host_time_once_a_step(mode):
    """``HostCosts.per_step_s`` adds itself to every step's rollout, once, in every mode; the steps' work is
    otherwise the same (the clock moves before the step begins, where no lane has work)."""
    rollouts = {}
    for per_step in (0.0, 0.05):
        profile = _cpu_profile()
        profile = dataclasses.replace(profile, host=dataclasses.replace(profile.host, per_step_s=per_step))
        setting = _setting(
            shapes={"actor": model_shape("tiny"), "reward": model_shape("tiny", head="score")},
            cost=CostModel(Calibrated(profile)), placement="cpu", gpus=1,
        )  # fmt: skip
        chunk = 16 if mode == "oppo" else None
        world = World(setting, mode, chunk_size=chunk, delta=4 if mode != "sequential" else None, steps=3)
        try:
            rollouts[per_step] = [r.rollout_s for r in world.run(3)]
        finally:
            world.close()
    for without, with_ in zip(rollouts[0.0], rollouts[0.05], strict=True):
        assert with_ - without == pytest.approx(0.05, rel=1e-9, abs=1e-12)
