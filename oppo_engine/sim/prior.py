"""The chunk controller's prior: the switch-cost profile a cost model predicts before any step is run.

``predicted_profile`` prices what the switch-cost profiler (``sched/profiler.py``) would measure -- one
decode iteration alone and beside a scorer prefill of each candidate chunk size (by the contention rule of
``sim/world.py``), the scorers' cost per prefilled token and per hand-off -- for a workload guessed from the
engine's settings. ``engine_prior`` is what the engine asks for (``sched/online.py``): the prior of its own
models on its own device, from the roofline table (a GPU the table knows) or from a profile this machine
calibrated (``oppo-engine calibrate``), or None where neither exists (the controller then starts from its
candidate list). Everything here is plain Python; the controller receives plain numbers.
"""

from __future__ import annotations

import logging

from oppo_engine.control import SwitchProfile
from oppo_engine.sim.cost import Batch, CostModel, Roofline, contended_s
from oppo_engine.sim.devices import DEVICES
from oppo_engine.sim.profile import Calibrated, Profile, default_profile_path, local_device_id
from oppo_engine.sim.shapes import ModelShape, model_shape

logger = logging.getLogger(__name__)

ACTOR = "actor"  # the engine's role names (model/roles.py)
HEADS = {"actor": "lm", "reference": "lm", "reward": "score", "critic": "value"}
# GPU names (torch.cuda.get_device_name) to table keys; GH200 before H200, which its name contains.
_GPU_NAMES = (("GH200", "gh200"), ("H200", "h200"), ("H100", "h100"), ("A100", "a100-80gb"))


def predicted_profile(
    cost: CostModel,
    shapes: dict[str, ModelShape],
    candidates: tuple[int, ...],
    *,
    batch_size: int,
    running: int,
    prompt_len: float,
    response_len: float,
    local: set[str],
    captured: bool = False,
    threads: int = 1,
    cores: float = 1.0,
    packed: bool = False,
) -> SwitchProfile:
    """The profile ``cost`` predicts for ``shapes`` (by role; the actor's under ``"actor"``) with ``running``
    sequences in flight of which ``batch_size`` are returned per step, prompts of ``prompt_len`` and
    responses of ``response_len`` tokens. ``local``: the scorers on the actor's device (the others do not
    contend with it); ``threads``: the CPU threads each streamed lane runs on; ``packed``: the actor's
    weights are packed (the engine's CPU default, ``EngineConfig.packed_weights``)."""
    actor = shapes[ACTOR]
    ctx = int(prompt_len + response_len / 2)
    decode = cost.forward(actor, Batch(tuple((1, ctx) for _ in range(running)), running, running),
                          captured=captured, threads=threads, packed=packed, actor=True)  # fmt: skip
    scorers = [role for role in shapes if role != ACTOR]

    def prefill(role: str, chunk: int):
        rows = 1 if role == "reward" else chunk
        batch = Batch(tuple((chunk, ctx) for _ in range(running)), rows * running)
        return cost.forward(shapes[role], batch, threads=threads)

    small, large = 16, 256
    t_small = sum(prefill(r, small).alone_s for r in scorers)
    t_large = sum(prefill(r, large).alone_s for r in scorers)
    per_token = max(0.0, (t_large - t_small) / ((large - small) * running))
    handoff = max(0.0, t_small - per_token * small * running) + cost.handoff().alone_s
    alone = decode.alone_s
    slowdown = {}
    beside_actor = [r for r in scorers if r in local]  # the scorers that contend with the actor's decode
    for c in candidates:
        beside = [(prefill(r, c), True) for r in beside_actor]
        host = cost.source.host
        # Streamed, the two alternate on the device's cache: a decode follows a chunk's start in the share
        # of its time the chunks start in, and every chunk follows a decode (``CostModel.switched``, read as
        # the calibration's pairs are: ``calibration.py::_alternating``); none on a GPU.
        chunks = sum(w.alone_s for w, _ in beside)
        switched = cost.switched(decode, actor, threads, share=min(1.0, alone / chunks)) if chunks else decode
        beside = [(cost.switched(w, shapes[r], threads), same)
                  for (w, same), r in zip(beside, beside_actor, strict=True)]  # fmt: skip
        contended = contended_s(switched, beside, cores, host.interpreter_penalty, cost.kind == "cpu",
                                host.interpreter_handover)  # fmt: skip
        slow = contended / alone if beside else 1.0
        slowdown[c] = slow - 1.0
    return SwitchProfile(
        handoff_s=handoff,
        prefill_s_per_token=per_token,
        decode_iter_s=alone,
        slowdown=slowdown,
        running_seqs=float(running),
        # NOTE: which sequences end last depends on the length law, unknown here: one is assumed; the first
        # streamed step measures it.
        tail_seqs=1.0,
        tokens_per_step=max(1.0, batch_size * response_len),
        scored_tokens_per_step=batch_size * (prompt_len + response_len),
    )


def cost_model_for(device) -> CostModel | None:
    """The cost model of a torch ``device``: the roofline of a table GPU, or the profile calibrated on this
    machine at ``default_profile_path``; None when there is neither (or the profile is unusable, which is
    logged)."""
    import torch  # noqa: PLC0415

    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for part, key in _GPU_NAMES:
            if part in name:
                return CostModel(Roofline(DEVICES[key]))
    ident = local_device_id(device)
    path = default_profile_path(ident)
    if not path.exists():
        return None
    try:
        return CostModel(Calibrated(Profile.load(path, device=ident)))
    except ValueError as e:
        logger.warning("chunk prior: %s; the chunk controller starts from its candidate list", e)
        return None


def engine_prior(config, models: dict, *, max_new_tokens: int, remote: bool = False) -> SwitchProfile | None:
    """The prior of an engine built with ``config`` over ``models`` (HF modules by role, the actor under
    ``"actor"``), or None where no cost model of its device exists. The workload is a guess: prompts of 128
    tokens (at most an eighth of ``max_model_len``) and responses of half ``max_new_tokens``; the engine's
    measured steps replace it."""
    from oppo_engine.model.packed import packed_enabled  # noqa: PLC0415

    actor = models[ACTOR]
    device = next(actor.parameters()).device
    cost = cost_model_for(device)
    if cost is None:
        return None
    shapes = {}
    for role, m in models.items():
        itemsize = next(m.parameters()).dtype.itemsize
        shapes[role] = model_shape(m, head=HEADS.get(role, "lm"), dtype_bytes=itemsize, name=role)
    max_len = config.max_model_len or 4096
    gpu = device.type == "cuda"
    delta = config.delta.resolve(config.batch_size).init if config.mode in ("inter", "oppo") else 0
    if isinstance(config.overcommit, int) and config.mode in ("inter", "oppo"):
        delta = config.overcommit
    return predicted_profile(
        cost, shapes, config.chunk.candidates, batch_size=config.batch_size,
        running=config.batch_size + delta, prompt_len=min(128, max_len / 8),
        response_len=max(1, max_new_tokens / 2), local=set() if remote else set(shapes) - {ACTOR},
        captured=gpu and config.graph in ("auto", True), threads=1,
        cores=1 if gpu else cost.source.profile.cores, packed=packed_enabled(config.packed_weights, device),
    )  # fmt: skip
