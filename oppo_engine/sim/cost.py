"""The time of each piece of work of a PPO step, on a device.

A forward is priced from the model's shape and the batch's composition: the chunks it runs (new tokens and
the context each reaches), the rows its head reads, whether its kernels are captured in a graph, and how
many CPU threads run them. The result is a :class:`Work`: what the forward costs when it runs alone, split
into the terms the contention rule (``sim/world.py``) needs -- host time on the lane's thread, kernel
launch latency, and per class of kernels a compute term and a memory term.

Two sources price the classes:

- :class:`Roofline` (a device of ``sim/devices.py``): each GEMM, attention and elementwise class takes
  ``max(FLOPs / (peak * achieved), bytes / (bandwidth * achieved))`` with the cited achieved fractions, a
  GEMM plus the share of its shorter term its kernel does not hide (:func:`ridge_gemm`, fitted to published
  GEMM timings), the elementwise kernels a floor each besides their bytes (:meth:`Roofline.elementwise`,
  fitted to published kernel timings); an eager forward cannot take less than its kernel launches; the
  host's per-iteration time
  (scheduler, sampler, metadata) is the engine's own, measured (:data:`HOST`).
- :class:`Calibrated` (a :class:`~oppo_engine.sim.profile.Profile` from ``oppo-engine calibrate``): GEMM
  FLOP/s interpolated against GEMM size from timed bare GEMMs, attention and elementwise costs per pair,
  per KV byte and per token, fixed costs per forward and per layer, host time per iteration: device-level
  constants, so the profile prices models it never ran.

The PPO update (actor and critic forward and backward over each rank's share of each minibatch, padded
to its longest row or packed, and the optimizer), FSDP's collectives and the weight sync of the rollout
replicas are priced in seconds by :meth:`CostModel.update`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from oppo_engine.sim.devices import Device
from oppo_engine.sim.shapes import ModelShape, attention_pairs

# Kernels one eager Qwen2 decoder layer launches: the aten ops its forward dispatches, views aside
# (``tests/sim/test_twin.py::test_kernels_per_layer_is_what_a_qwen2_layer_launches`` counts them).
KERNELS_PER_LAYER = 38

# The elementwise kernels of a decoder layer as vLLM, sarathi and TensorRT-LLM run them, fused: two RMSNorms,
# the rotary embedding (q and k in place), the gated activation (SiLU and multiply) and two residual adds.
ELEMENTWISE_KERNELS = 6


def elementwise_bytes(shape: ModelShape) -> int:
    """Bytes a decoder layer's elementwise kernels read and write per token: each norm reads and writes
    the hidden state (2 h elements), the rotary embedding q and k (2 (q + kv)), the gated activation reads
    gate and up and writes their product (3 I), each residual add reads two hidden states and writes one
    (3 h)."""
    per_token = 10 * shape.hidden + 2 * shape.q_width + 2 * shape.kv_width + 3 * shape.intermediate
    return per_token * shape.dtype_bytes


@dataclass(frozen=True, slots=True)
class HostCosts:
    """The engine's host time per forward: ``per_forward_s`` plus ``per_row_s`` per sequence in it (the
    scheduler's pass, the sampler's bookkeeping, the runner's metadata), and ``handoff_s`` per hand-off of
    a chunk to the scorers. ``per_step_s``: per step, outside its forwards (the step's start -- the
    sequences' snapshots, the admissions, the models' attention switched -- and its commit and metrics; 0
    in a profile written before it). ``interpreter_penalty``: how much longer two interpreter-bound threads
    of one process take together than one after the other (the GIL's hand-overs; 1 would be a clean
    serialisation). ``interpreter_handover``: the seconds a thread waits for the interpreter per second of
    its own Python and per unit of the interpreter share of the other threads of its process running
    beside it, at any demand (:func:`handover_load`; 0: none, as in a profile written before it)."""

    per_forward_s: float
    per_row_s: float
    handoff_s: float
    interpreter_penalty: float = 1.0
    interpreter_handover: float = 0.0
    per_step_s: float = 0.0


def interpreter_load(demand: float, penalty: float) -> float:
    """The oversubscription of a process's interpreter under a total ``demand`` of its threads (the rule of
    ``sim/world.py``): none up to one; past it, ``demand`` with the measured ``penalty`` phased in as the
    threads overlap more."""
    if demand <= 1.0:
        return 1.0
    return demand * (1.0 + (penalty - 1.0) * min(1.0, demand - 1.0))


def handover_load(demand: float, others: float, handover: float) -> float:
    """How much longer a work takes for its waits on the interpreter (the rule of ``sim/world.py``), whose
    interpreter ``demand`` (its Python over its time alone) runs beside other threads of its process of
    total interpreter demand ``others``, at ``handover`` seconds of waiting per second of its Python and per
    unit of the others' interpreter share. A thread of the engine takes the GIL back after each of its ops;
    when another thread holds it, it waits, and the holder, whose own ops are short, takes it back before the
    waiter wakes: the waits grow with the holder's share, from demand 0, long before the demands sum to one
    (two lanes of ``tiny`` slowed each other 1.3-3.7x at demands summing to 0.7-1.3, on two cores that two
    processes of them shared without slowing: docs/twin.md). With each lane's share of its own stretched
    time, ``python / (alone * g)``, two lanes ``A`` and ``B`` take ``g`` times their time alone, both the
    same ``g``, the root of ``g**2 - g = handover * a_A * a_B``; beside several threads ``others`` sums
    theirs (the same root, exact for two)."""
    x = handover * demand * others
    if x <= 0.0:
        return 1.0
    return (1.0 + math.sqrt(1.0 + 4.0 * x)) / 2.0


# Measured on the development machine (2 cores, Python 3.11) with the engine's real scheduler and runner
# bookkeeping around forwards that cost nothing: ``python -m bench.bench_twin --host``. A GPU host's CPU is
# another; its interpreter penalty (two lanes' Python interleaving) is not measured for the roofline: 1, a
# clean serialisation. A profile calibrated on the GPU's host measures both.
HOST = HostCosts(per_forward_s=2.3e-5, per_row_s=2.7e-6, handoff_s=3.8e-5)


@dataclass(frozen=True, slots=True)
class Work:
    """One piece of work as it would run alone. ``host_s``: Python on the lane's thread before its kernels
    (it holds the GIL); ``launch_s``: launching the kernels, also under the GIL, while they run (the device
    part takes at least this long); ``phases``: per class of kernels ``(compute_s, memory_s)``, taking
    ``max`` of the two alone; ``threads``: CPU threads its kernels occupy (1 on a GPU)."""

    host_s: float
    launch_s: float
    phases: tuple[tuple[float, float], ...]
    threads: int = 1

    def kernels_s(self, compute_slowdown: float = 1.0, memory_slowdown: float = 1.0) -> float:
        """The kernels' time with the device's arithmetic and bandwidth oversubscribed by these factors."""
        return sum(max(f * compute_slowdown, m * memory_slowdown) for f, m in self.phases)

    def duration(
        self, compute: float = 1.0, memory: float = 1.0, interpreter: float = 1.0, cores: float = 1.0
    ) -> float:
        """Its time with the device's arithmetic, its bandwidth, the process's interpreter and (a CPU's)
        cores oversubscribed by these factors (each at least 1). On a CPU the Python runs on its cores too,
        and a kernel holds its core while it waits on memory as while it computes: its memory-bound phases
        stretch with the cores' oversubscription as well as with the bandwidth's."""
        python = max(interpreter, cores)
        return self.host_s * python + max(self.launch_s * python, self.kernels_s(compute, max(memory, cores)))

    def device_s(self) -> float:
        """The part of its time the device is busy with it, alone."""
        return self.kernels_s()

    @property
    def alone_s(self) -> float:
        return self.duration()

    @property
    def compute_s(self) -> float:
        return sum(f for f, _ in self.phases)

    @property
    def memory_s(self) -> float:
        return sum(m for _, m in self.phases)


def demands(work: Work, cores: float = 1.0, cpu: bool = False) -> tuple[float, float, float]:
    """What ``work`` demands over its duration alone, of its device's arithmetic (of ``cores``), of its
    memory bandwidth and of its process's interpreter: ``(a_f, a_m, a_h)`` (the contention rule of
    ``sim/world.py``). On a ``cpu`` every part runs on the cores: its kernels on ``threads`` of them, its
    Python on one; and its memory terms were priced at the bandwidth its ``threads`` draw (the streaming
    sweep's), of which the ``cores`` together draw ``cores / threads`` times as much."""
    alone = work.alone_s
    if alone <= 0:
        return 0.0, 0.0, 0.0
    python = work.host_s + work.launch_s
    if cpu:
        # A work of more threads than the fitted cores ran its timed ``alone_s`` on what it had: it demands
        # at most all of them (alone it is never stretched).
        threads = min(work.threads, cores)
        busy = threads * work.kernels_s() + python
        # NOTE: a core's bandwidth is bound by its own outstanding misses, not the memory's: two one-thread
        # decodes on two cores each stream at their timed speed (calibrate's contention pairs, measured).
        return busy / (cores * alone), threads * work.memory_s / (cores * alone), python / alone
    busy = work.threads * work.compute_s
    return busy / (cores * alone), work.memory_s / alone, python / alone


def contended_s(
    work: Work,
    others: list[tuple[Work, bool]],
    cores: float = 1.0,
    penalty: float = 1.0,
    cpu: bool = False,
    handover: float = 0.0,
) -> float:
    """How long ``work`` takes while ``others`` run beside it on its device throughout: ``(work, same
    process)`` pairs (the contention rule of ``sim/world.py``)."""
    a_f, a_m, own = demands(work, cores, cpu)
    a_h = own
    for other, same_process in others:
        f, m, h = demands(other, cores, cpu)
        a_f, a_m = a_f + f, a_m + m
        a_h += h if same_process else 0.0
    s_f, s_m, cores_s = max(1.0, a_f), max(1.0, a_m), max(1.0, a_f) if cpu else 1.0
    stretched = work.duration(s_f, s_m, interpreter_load(a_h, penalty), cores_s)
    # The hand-overs' waits include the interpreter's serialisation past a demand of one: the larger one.
    return max(stretched, work.duration(s_f, s_m, 1.0, cores_s) * handover_load(own, a_h - own, handover))


@dataclass(frozen=True, slots=True)
class Batch:
    """A forward's composition: per sequence ``(new tokens, context after them)``, the rows its head reads
    and, for the actor, the rows it samples."""

    chunks: tuple[tuple[int, int], ...]
    head_rows: int
    sampled: int = 0

    @property
    def tokens(self) -> int:
        return sum(n for n, _ in self.chunks)


def ridge_gemm(compute_s: float, memory_s: float, unhidden: float) -> tuple[float, float]:
    """A GEMM's ``(compute, memory)`` terms with ``unhidden`` of the shorter added to the longer, so that
    its time alone, their ``max``, is ``max(c, m) + unhidden * min(c, m)``: the bare roofline's ``max`` far
    from the ridge (the shorter term vanishes), ``1 + unhidden`` times either term on it, where a real
    kernel reaches neither roof. The shorter term is left as it is: what the GEMM demands of that resource
    under contention (``sim/world.py``) is what it moves or computes."""
    stretch = unhidden * min(compute_s, memory_s)
    if compute_s >= memory_s:
        return compute_s + stretch, memory_s
    return compute_s, memory_s + stretch


class Roofline:
    """Prices a forward's kernels on a table device (module docstring)."""

    kind = "gpu"

    def __init__(self, device: Device, host: HostCosts = HOST) -> None:
        self.device, self.host = device, host
        f = device.fractions
        self._flops = device.bf16_flops * f.gemm
        self._stream = device.hbm_bandwidth * f.stream
        self._kv = device.hbm_bandwidth * f.decode_attention
        self._attn_flops = device.bf16_flops * f.prefill_attention
        self._elementwise = device.hbm_bandwidth * f.elementwise

    @property
    def name(self) -> str:
        return self.device.key

    def gemm(
        self,
        m: int,
        k: int,
        n: int,
        dtype_bytes: int,
        threads: int = 1,
        working_set: float = 0.0,
        packed: bool = False,
    ) -> tuple[float, float]:
        # ``packed`` (the CPU's prepacked weights) does not apply to a GPU: the same price.
        flops = 2.0 * m * k * n
        moved = (k * n + m * k + m * n) * dtype_bytes
        return ridge_gemm(flops / self._flops, moved / self._stream, self.device.fractions.gemm_unhidden)

    def attention(self, shape: ModelShape, batch: Batch, threads: int = 1) -> tuple[float, float]:
        flops = moved = 0.0
        kv = shape.kv_width * 2 * shape.dtype_bytes
        for new, ctx in batch.chunks:
            flops += 4.0 * shape.q_width * attention_pairs(new, ctx)
            # Each tile of 128 queries reads the context's K and V once.
            moved += kv * ctx * math.ceil(new / 128)
        return flops / self._attn_flops, moved / self._kv

    def elementwise_kernels_s(self, kernels: int, nbytes: float) -> float:
        """Device time of ``kernels`` elementwise kernels moving ``nbytes`` together: a floor each (however
        few its tokens, a kernel takes a few microseconds on the device) plus the bytes at the elementwise
        bandwidth (``Fractions.elementwise_floor_s`` and ``elementwise``, fitted to Vidur's profiled kernels:
        ``bench/published.py::elementwise_fit``)."""
        return kernels * self.device.fractions.elementwise_floor_s + nbytes / self._elementwise

    def elementwise(self, shape: ModelShape, tokens: int, logit_rows: int, threads: int = 1) -> float:
        # Each layer's norms, rotary embedding, gated activation and residual adds: ELEMENTWISE_KERNELS
        # kernels, a floor each plus the bytes they move; the sampler or log-softmax reads the logits a few
        # times, at the streaming bandwidth. The floors are the kernels' device time, what a profiler's trace
        # times: a captured forward pays them (a graph removes launches, not kernels' durations). An eager
        # forward's launches are host time, priced in ``fixed()``; ``Work`` takes the larger of the launches
        # and the kernels' device time, never their sum, so neither is counted twice. The floors are booked
        # in this memory term: under contention they stretch as the bandwidth does (an upper bound: a floor
        # is a latency, not a share of the bandwidth).
        layers = 0.0
        if tokens:
            nbytes = tokens * elementwise_bytes(shape)
            layers = shape.layers * self.elementwise_kernels_s(ELEMENTWISE_KERNELS, nbytes)
        return layers + 3 * logit_rows * shape.vocab * 4 / self._stream

    def fixed(
        self,
        shape: ModelShape,
        captured: bool,
        threads: int = 1,
        *,
        actor: bool = False,
        packed: bool = False,
    ) -> tuple[float, float]:
        """(host seconds, launch seconds) of one forward (an ``actor``'s as any: its launches count)."""
        kernels = 1 if captured else shape.layers * KERNELS_PER_LAYER + 4
        return 0.0, kernels * self.device.launch_s

    def host_s(self, rows: int) -> float:
        return self.host.per_forward_s + self.host.per_row_s * rows

    def repack_s(self, shape: ModelShape, threads: int = 1) -> float:
        """Nothing: a GPU's actor multiplies by its own weights (the engine packs on the CPU only)."""
        return 0.0

    def switched_s(self, shape: ModelShape, threads: int = 1) -> float:
        """Nothing: a GPU streams a decode's weights from its memory whichever model ran before (its L2, 50 MB
        on an H100, holds no 7B model's weights; a small model's refill after another's is not priced)."""
        return 0.0

    def training_s(self, flops: float) -> float:
        return flops / (self.device.bf16_flops * self.device.fractions.training_mfu)

    def collective_s(self, nbytes: float, gpus: int) -> float:
        if gpus <= 1:
            return 0.0
        # A ring all-gather or reduce-scatter moves (n - 1) / n of the data through each GPU's links.
        return nbytes * (gpus - 1) / gpus / self.device.fractions.collective_busbw

    def stream_s(self, nbytes: float) -> float:
        return nbytes / self._stream


class CostModel:
    """The time of each piece of work of a PPO step from one source (:class:`Roofline` or
    :class:`~oppo_engine.sim.profile.Calibrated`)."""

    def __init__(self, source) -> None:
        self.source = source
        self._gemms: dict[tuple, tuple] = {}  # (shape, tokens, head rows, threads, packed) -> GEMM phases

    @property
    def kind(self) -> str:
        """``"gpu"`` or ``"cpu"``: what the source prices."""
        return self.source.kind

    def forward(
        self,
        shape: ModelShape,
        batch: Batch,
        *,
        captured: bool = False,
        threads: int = 1,
        packed: bool = False,
        actor: bool = False,
    ) -> Work:
        """One packed forward of ``shape`` over ``batch`` (its host bookkeeping included). ``packed``: its
        ``nn.Linear`` weights are packed once into oneDNN's layout, as the engine's actor has them on the
        CPU (``EngineConfig.packed_weights``); the scorers' are not. ``actor``: the engine's actor's forward
        (``ActorWorker``: its packs' bookkeeping, its sampler), whose fixed costs a calibrated profile
        prices apart from the scorers' (``ThreadCosts.actor_forward_s``, ``actor_layer_s``)."""
        src = self.source
        tokens = batch.tokens
        key = (shape, tokens, batch.head_rows, threads, packed)
        gemms = self._gemms.get(key)
        if gemms is None:  # the GEMMs depend on the token and head-row counts only (a source is immutable)
            gemms = []
            weights = shape.weight_bytes  # what a forward streams through: the cache it does not fit in
            for k, n in shape.layer_gemms(grouped=packed):  # packed: grouped products too (model/packed.py)
                f, m = src.gemm(tokens, k, n, shape.dtype_bytes, threads, weights, packed)
                gemms.append((shape.layers * f, shape.layers * m))
            if batch.head_rows:
                k, n = shape.head_gemm()
                gemms.append(src.gemm(batch.head_rows, k, n, shape.dtype_bytes, threads, weights, packed))
            logit_rows = batch.head_rows if shape.head == "lm" else 0
            gemms.append((0.0, src.elementwise(shape, tokens, logit_rows, threads)))
            gemms = self._gemms[key] = tuple(gemms)
        f, m = src.attention(shape, batch, threads)
        phases = (*gemms, (shape.layers * f, shape.layers * m))
        host, launch = src.fixed(shape, captured, threads, actor=actor, packed=packed)
        return Work(host + src.host_s(len(batch.chunks)), launch, phases, threads)

    def repack(self, shape: ModelShape, threads: int = 1) -> Work:
        """Packing the actor's weights again at its first forward after a weight update, where the engine
        packs them (the CPU: ``model/packed.py``): a memory-bound reorder on the actor's threads."""
        return Work(0.0, 0.0, ((0.0, self.source.repack_s(shape, threads)),), threads)

    def switched(self, work: Work, shape: ModelShape, threads: int = 1, share: float = 1.0) -> Work:
        """``work``, a forward of ``shape``, when another model's forward started on its device since the
        last forward of ``shape``'s model did: its weights are read again from memory, not the cache
        (``ThreadCosts.switched_s``), a memory-bound part of its kernels. ``share``: the expected share of
        such calls, where a loop of them runs beside another model's (``calibration.py::_alternating``)."""
        seconds = share * self.source.switched_s(shape, threads)
        if seconds <= 0.0:
            return work
        return Work(work.host_s, work.launch_s, (*work.phases, (0.0, seconds)), work.threads)

    def handoff(self) -> Work:
        """The actor's host time for one hand-off of a chunk to the scorers."""
        return Work(self.source.host.handoff_s, 0.0, (), 1)

    # -- the update and its collectives -------------------------------------------------------------------

    def update(
        self,
        trained: list[ModelShape],
        minibatches: list[list[list[int]]],
        *,
        gpus: int,
        epochs: int,
        checkpointing: bool = False,
        packed: bool = False,
        budget: int | None = None,
        recompute: list[list[list[int]]] = (),
    ) -> float:
        """Seconds of the PPO update on each training GPU.

        ``minibatches``: per minibatch, per rank, the lengths of the rows of that rank's share (the trainer
        cuts a global minibatch into one slice per rank: ``ppo/ranks.py``). A rank's share is padded to its
        own longest row (``packed=False``: ``PPOTrainer`` today) or packed without padding into micro-batches
        (``packed=True``: ``max_tokens_per_microbatch``, ``budget`` tokens a pack, the attention priced as
        the batched pack attention runs it, :func:`pack_attention_pairs`, or with ``checkpointing`` as the
        dense mask the trainer falls back to then, :func:`dense_pack_pairs`); FSDP's collectives make every
        rank wait for the slowest share of each minibatch. ``epochs`` passes over them of forward and
        backward of the ``trained`` models (actor, critic), FLOPs counted in the convention of the run the
        training MFU comes from (:func:`training_flops`); ``checkpointing`` recomputes a forward. Per
        minibatch an all-gather of the weights for the forward and one for the backward and a
        reduce-scatter of the gradients, hidden behind compute where shorter; the optimizer once per
        minibatch; then the all-gather that refreshes the rollout replicas. ``recompute``: the chunks (per
        rank, row lengths) of stale rows whose log-probs one actor forward recomputes first
        (``off_policy="recompute"``).
        """
        src = self.source
        passes = 4.0 if checkpointing else 3.0  # forward + backward (2 forwards' worth) [+ the recompute]

        def slowest(chunks, shapes, n) -> float:
            """FLOPs of the slowest rank of each chunk, summed over the chunks."""
            return sum(
                max(
                    (
                        sum(training_flops(s, rank, n, packed, budget, dense=checkpointing) for s in shapes)
                        for rank in chunk
                    ),
                    default=0.0,
                )
                for chunk in chunks
            )

        total = epochs * slowest(minibatches, trained, passes)
        total += slowest(list(recompute), trained[:1], 1.0)
        compute = src.training_s(total)
        steps = len(minibatches) * epochs
        params = sum(s.params for s in trained)
        gather = src.collective_s(sum(s.weight_bytes for s in trained), gpus)
        comm = 3 * gather * steps
        # Adam: read the bf16 gradient, read and write both fp32 moments and the bf16 weight, per parameter.
        optimizer = steps * src.stream_s(params / gpus * (2 + 16 + 4))
        return max(compute, comm) + optimizer + gather


def training_flops(
    shape: ModelShape,
    lengths,
    passes: float,
    packed: bool = False,
    budget: int | None = None,
    *,
    dense: bool = False,
) -> float:
    """FLOPs of ``passes`` forwards' worth (1: a forward; 3: forward and backward; 4: with a recomputed
    forward) over rows of ``lengths``, counted as torchtitan counts them for its MFU
    (``torchtitan/utils.py::get_num_flop_per_token`` @0413364: ``6 N + 12 L H q T`` per token for forward
    and backward, attention over the whole row, causal sparsity not subtracted, recomputation not counted):
    per forward ``2 N`` per token plus ``4 L q`` per attention pair. Padded rows (``packed=False``) all take
    the longest row's width: ``w^2`` pairs each. Packed rows in packs of ``budget`` tokens take the pairs
    the batched pack attention computes (:func:`pack_attention_pairs`), or with ``dense`` those of the
    dense mask over each pack (:func:`dense_pack_pairs`: the trainer's choice where a model has activation
    checkpointing on); with no ``budget``, each its own ``w^2``."""
    lengths = list(lengths)
    if not lengths:
        return 0.0
    if packed:
        tokens = sum(lengths)
        if not budget:
            attention = sum(w * w for w in lengths)
        else:
            attention = (dense_pack_pairs if dense else pack_attention_pairs)(lengths, budget)
    else:
        width = max(lengths)
        tokens = len(lengths) * width
        attention = len(lengths) * width * width
    per_forward = 2.0 * shape.params * tokens + 4.0 * shape.layers * shape.q_width * attention
    return passes * per_forward


# ``ppo/pack_attention.py``'s bucket ratio (tests/sim/test_plan_terms.py checks the two agree).
PACK_BUCKET_RATIO = 2.0


def pack_attention_pairs(lengths, budget: int) -> int:
    """The attention pairs (query, key) the trainer's batched pack attention computes over rows of
    ``lengths`` packed ``budget`` tokens a pack (``PPOConfig.pack_attention``, batched: its default where a
    model's probe passes). The packs are ``ppo/packing.py::plan_sorted_packs``'s: the rows sorted longest
    first, each pack a run of them as long as the budget allows; each pack's rows are cut into buckets
    (``ppo/pack_attention.py::bucket_lengths``: a new bucket where a row is shorter than its bucket's
    longest over :data:`PACK_BUCKET_RATIO`), and each bucket is one call over a batch right-padded to its
    longest: ``rows x longest^2`` pairs, at most 4x the rows' own squares. Torch-free mirrors of those two
    functions (``tests/sim/test_plan_terms.py`` checks them against the trainer's)."""
    total, room, head, count = 0, 0, 0, 0
    for n in sorted(lengths, reverse=True):
        if n > budget:
            raise ValueError(f"a sequence of {n} tokens exceeds max_tokens_per_microbatch={budget}")
        if n > room or n * PACK_BUCKET_RATIO < head:  # a new pack, or a new bucket within the pack
            total += count * head * head
            head, count = n, 0
            if n > room:
                room = budget
        count += 1
        room -= n
    return total + count * head * head


def dense_pack_pairs(lengths, budget: int) -> int:
    """The attention pairs of the dense ``T x T`` mask over each pack of rows of ``lengths`` packed
    ``budget`` tokens a pack, as the trainer packs them for the dense mask (``ppo/packing.py::plan_packs``:
    first-fit decreasing, the longest first, each into the first pack with room; ``pack_attention="dense"``,
    and ``"auto"`` for a model with activation checkpointing on). A torch-free mirror of that function
    (``tests/sim/test_plan_terms.py`` checks it against the trainer's)."""
    room: list[int] = []
    for n in sorted(lengths, reverse=True):
        if n > budget:
            raise ValueError(f"a sequence of {n} tokens exceeds max_tokens_per_microbatch={budget}")
        slot = next((k for k, r in enumerate(room) if r >= n), None)
        if slot is None:
            room.append(budget - n)
        else:
            room[slot] -= n
    return sum((budget - r) ** 2 for r in room)


def roofline(device: Device) -> CostModel:
    """A cost model over a table device."""
    return CostModel(Roofline(device))
