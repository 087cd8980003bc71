"""A calibrated profile of a device: what ``calibrate`` (``sim/calibration.py``) found, and ``Calibrated``,
which prices work from it (``sim/cost.py``).

A profile records its device and format version; ``Profile.load`` refuses a version it cannot read (it
reads ``READS``: a version-1 profile loads as version 2 with nothing unfitted), and a profile
is refused where another device's is expected (``device=``). ``default_profile_path`` is where
``oppo-engine calibrate`` writes a device's profile and where the engine looks for it (the chunk
controller's prior): ``$OPPO_ENGINE_PROFILES`` or ``~/.cache/oppo_engine/profiles``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from oppo_engine.sim.cost import Batch, HostCosts
from oppo_engine.sim.shapes import ModelShape, attention_pairs, log_interp

# 2: ThreadCosts.unfitted (version 1 profiles still load, with nothing unfitted). 3: the packed weights'
# GEMMs and streaming (``ThreadCosts.gemm_packed``, ``streaming_packed``; a version 1 or 2 profile loads
# without them, and prices the actor's packed projections as unpacked: ``Profile.from_json`` warns). 4: the
# actor's repacking (``repack_s``, ``repack_byte_s``), and forwards fitted with the packed actor's grouped
# products (``model/packed.py``); a version 3 CPU profile loads with no repacking and its fixed costs fitted
# around ungrouped products (``Profile.from_json`` warns). 5: the actor's own fixed costs beside the scorers'
# (``actor_forward_s``, ``actor_layer_s``); a version 4 CPU profile loads with them 0, the actor's forwards
# priced with the fixed costs of every role's copies together (``Profile.from_json`` warns). 6: how much
# longer a packed product takes inside the actor's forward than its bare price (``packed_in_forward``); a
# version 5 CPU profile loads without it, pricing the packed products at their bare, hot-loop time
# (``Profile.from_json`` warns). 7: the interpreter's hand-overs between two lanes of one process
# (``HostCosts.interpreter_handover``, fitted with the cores); a version 6 CPU profile loads with none, its
# cores fitted with the hand-overs read as missing cores (``Profile.from_json`` warns). 8: the weights'
# streaming by product size (``streaming_products``, ``streaming_products_packed``) and the fixed costs'
# excess after a forward's weights stream through the caches (``evicted``); a version 7 CPU profile loads
# without them, pricing large products' reads at the small ones' rate and the fixed costs hot
# (``Profile.from_json`` warns). 9: the engine's host time per step outside its forwards
# (``HostCosts.per_step_s``), the repacking timed after a weight update's stream through the caches, and
# the cores fitted in twentieths; a version 8 CPU profile loads with no cost per step, its steps priced
# short by it (``Profile.from_json`` warns). 10: a forward's excess right after another model's on its
# device (``switched``: ``calibration.py::_time_switch``), charged in every mode (it matters where ``intra``
# and ``oppo`` alternate the models); a version 9 CPU profile loads without it, pricing every forward as if
# its weights were still in the cache (``Profile.from_json`` warns). 11: the timed forwards run on rows made
# once per point (``calibration.py::_RoleBench._rows``), not made and freed inside each timed call; a
# version 10 CPU profile loads as written, its per-context constants fitted with that bookkeeping read as
# attention (``Profile.from_json`` warns). 12: each timing the median of its rounds, not the fastest
# (``calibration.py::ROUND_STATISTIC``); a version 11 CPU profile loads as written, pricing the machine at
# its fastest moments (``Profile.from_json`` warns).
VERSION = 12
READS = (1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, VERSION)
ROLES = ("actor", "reward", "reference", "critic")

# The per-forward constants a calibration fits (``ThreadCosts``) and what each is charged per, as an amount
# of the model's shape: the feature a refusal names, and how much of it a shape has (per token or per
# forward). A constant whose feature none of the calibration's timed forwards had (its column zero in every
# one, so no coefficient could show in them) is recorded with the largest amount among the calibration's
# models (``ThreadCosts.unfitted``): a shape with more of that feature is refused (``Profile.check_shape``).
# A constant the fit put at zero is not marked: NNLS zeroes small terms under timing noise, and a refusal
# that depends on the machine's load would misfire.
FEATURES: dict[str, tuple[str, Callable[[ModelShape], float]]] = {
    "layer_s": ("the fixed cost per layer (layers)", lambda s: s.layers),
    "pair_s": ("attention per query-key pair (layers x query width)", lambda s: s.layers * s.q_width),
    "kv_byte_s": (
        "the KV cache read per context token (layers x KV bytes)",
        lambda s: s.layers * s.kv_width * 2 * s.dtype_bytes,
    ),
    "token_hidden_s": ("elementwise work per token (layers x hidden)", lambda s: s.layers * s.hidden),
    "logit_s": ("logit post-processing per row (vocabulary)", lambda s: s.vocab if s.head == "lm" else 0),
}


def _table_at(table: list[tuple[float, int, float]], size: float, rows: int) -> float:
    """A ``[(size, rows, value), ...]`` table at ``size`` and ``rows``: interpolated in log size at each
    timed row count, then in log rows; held flat past the ends."""
    by_rows: dict[int, list[tuple[float, float]]] = {}
    for at, r, value in table:
        by_rows.setdefault(r, []).append((at, value))
    at_rows = [(r, log_interp(sorted(points), max(1.0, size))) for r, points in sorted(by_rows.items())]
    return log_interp(at_rows, max(1, rows))


@dataclass(frozen=True, slots=True)
class ThreadCosts:
    """The fitted constants at one thread count. ``gemm``: ``{K*N: [(M, FLOP/s), ...]}`` timed with the
    weights in cache; ``streaming``: ``[(working set bytes, rows, bytes/s), ...]``, the bandwidth at which a
    forward's projections of that many rows read weights out of a working set of that many bytes (more
    than stays in cache); ``bandwidth``: bytes/s of a
    large copy; per-unit costs in seconds (see ``sim/calibration.py``); ``gemm_scale``: how much longer the
    projections take inside a forward than the bare GEMMs predict (fitted); ``fit_error``: the median
    relative error of the fit over the timed forwards; ``unfitted``: the constants the calibration could
    not fit (``FEATURES``: no timed forward had their feature, so the value was never measured), each
    with the largest amount of its feature among the calibration's models. ``gemm_packed`` and
    ``streaming_packed``: the same two tables timed with the weights packed once into oneDNN's layout, as
    the engine's actor multiplies by them on the CPU (``EngineConfig.packed_weights``,
    ``oppo_engine/model/packed.py``; ``F.linear`` repacks the weights at every call); empty where the
    calibration did not pack (a GPU, a dtype oneDNN cannot pack here, a profile older than version 3):
    packed projections are then priced by the unpacked tables. ``repack_s`` and ``repack_byte_s``: seconds per
    packed tensor and per byte of them to pack the actor's weights again (after every weight update:
    ``update_policy()`` drops the packs, the next forward makes them), fitted to the actor's own repacking and
    its shrunk copies'; 0 where the calibration did not pack (a profile written before it was timed prices
    no repacking). ``actor_forward_s`` and ``actor_layer_s``: what the actor's forward costs per forward and
    per layer beyond ``forward_s`` and ``layer_s`` (the scorers'), as the engine runs the actor here -- its
    packs' bookkeeping and per-call dispatch around every packed product (``model/packed.py``: refreshed,
    installed and removed per module per forward), its sampler -- fitted from the actor's shrunk copies
    against the scorers' (``calibration.py::_fixed_costs``; signed); charged to forwards priced as the actor's
    unless the profile packed and the actor runs unpacked (``Calibrated.fixed``). 0 where no copies were
    timed (a GPU) or in a profile written before (version 4 and older). ``packed_in_forward``: ``{K*N:
    [(rows, ratio), ...]}``, how much longer a packed product of that weight size and that many rows takes
    inside the actor's forward than its bare price from ``gemm_packed`` (timed in a loop of that one product,
    its weights and oneDNN's code and state hot in the core's caches and predictors; inside a forward the
    interpreter's work between two products has taken them), measured on the products of the actor's own
    forwards and its shrunk copies' where the bare price is the product's compute term
    (``calibration.py::_packed_in_forward``); it scales that term (linear in rows at a size, in log size
    across sizes, held flat past the ends; a product larger than every size measured is charged the largest
    one's excess in seconds, grown with the square root of its weights: ``Calibrated._in_forward_s``). Empty
    where the calibration did not pack or in a profile written before (version 5 and older): the bare price.
    ``streaming_products`` (``streaming_products_packed``: packed once, as above): ``[(product bytes, rows,
    bytes/s), ...]``, the bandwidth at which a sweep of products of one size and that many rows reads their
    weights out of a working set far larger than the cache; a product streams at least that fast
    (``streaming_bandwidth``): the ``streaming`` tables sweep a layer's mix of small products, and a product
    of many megabytes reads its weights faster (measured 2026-12-07: 19 GB/s at 0.56 MiB, 40-44 at 16-32 MiB,
    one row, one thread). ``evicted``: ``[(bytes, per forward s, per layer s, deepest layers), ...]``, how
    much longer the actor's shrunk copies' forwards take (their fixed costs: the interpreter, dispatch) after
    that many bytes streamed through the caches than hot, fitted over their two depths
    (``calibration.py::_time_evicted``); a forward's fixed costs are charged it at its model's weight bytes
    (``evicted_s``; the embedding's included, which a forward does not stream: past the largest size timed,
    128 MiB, the charge is flat anyway), since its products stream them between its Python. Measured on the
    actor's copies and charged to every role's forward: the scorers' copies were not timed after a stream (an
    assumption, stated). Empty where not timed (a GPU; version 7 and older): nothing charged. ``switched``:
    ``[(bytes, seconds), ...]``, how much longer a sweep of a decode's products over that many bytes of
    weights takes right after a sweep over as many other bytes than back to back
    (``calibration.py::_time_switch``): charged to a forward when another model's forward started on its
    device since its own model's last one did (``switched_s`` at its weight bytes; the twin's
    ``World._switch``), in every mode; it matters where ``intra`` and ``oppo`` alternate the models on a
    shared cache. Empty where not timed (a GPU; version 9 and older): nothing charged."""

    gemm: dict[int, list[tuple[int, float]]]
    bandwidth: float
    forward_s: float
    layer_s: float
    pair_s: float
    kv_byte_s: float
    token_hidden_s: float
    logit_s: float
    fit_error: float
    streaming: list[tuple[float, int, float]] = field(default_factory=list)
    gemm_scale: float = 1.0
    unfitted: dict[str, float] = field(default_factory=dict)
    gemm_packed: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    streaming_packed: list[tuple[float, int, float]] = field(default_factory=list)
    repack_byte_s: float = 0.0
    repack_s: float = 0.0
    actor_forward_s: float = 0.0
    actor_layer_s: float = 0.0
    packed_in_forward: dict[int, list[tuple[int, float]]] = field(default_factory=dict)
    streaming_products: list[tuple[float, int, float]] = field(default_factory=list)
    streaming_products_packed: list[tuple[float, int, float]] = field(default_factory=list)
    evicted: list[tuple[float, float, float, int]] = field(default_factory=list)
    switched: list[tuple[float, float]] = field(default_factory=list)

    def switched_s(self, weight_bytes: float) -> float:
        """How much longer a forward of a model of ``weight_bytes`` takes when another model's forward started
        on its device since its own last one did, the other's weights having taken the shared cache
        (``switched``: ``[(weight bytes, seconds), ...]``, a sweep of products of that many bytes right after
        a sweep of as many other bytes against back to back; interpolated in log bytes, held flat past the
        largest, in proportion to the bytes below the smallest). 0 where not measured."""
        if not self.switched or weight_bytes <= 0.0:
            return 0.0
        points = sorted(self.switched)
        if weight_bytes < points[0][0]:
            return max(0.0, points[0][1]) * weight_bytes / points[0][0]
        return max(0.0, log_interp(points, weight_bytes))

    def evicted_s(self, weight_bytes: float, layers: int) -> float:
        """The fixed costs' excess in a forward of ``layers`` layers whose products stream ``weight_bytes``
        of weights (``evicted``: per forward and per layer, each interpolated in log bytes, held flat past the
        largest; below the smallest, in proportion to the bytes; the per-layer part charged up to the
        deepest copy measured, not extrapolated past it; never negative). 0 where not measured."""
        if not self.evicted or weight_bytes <= 0:
            return 0.0
        points = sorted(self.evicted)
        charged = min(layers, min(depth for *_, depth in points))
        if weight_bytes < points[0][0]:
            _, per_forward, per_layer, _ = points[0]
            return max(0.0, per_forward + per_layer * charged) * weight_bytes / points[0][0]
        per_forward = log_interp([(b, f) for b, f, _, _ in points], weight_bytes)
        per_layer = log_interp([(b, lay) for b, _, lay, _ in points], weight_bytes)
        return max(0.0, per_forward + per_layer * charged)

    def in_forward(self, m: int, kn: int) -> float:
        """How much longer a packed ``[m, K] @ [K, N]`` product (``K * N = kn``) takes inside the actor's
        forward than its bare price (``packed_in_forward``; 1 where nothing was measured)."""
        if not self.packed_in_forward:
            return 1.0
        measured, held = [], []  # sizes measured at rows around m; sizes whose rows end short of m
        for size, points in sorted(self.packed_in_forward.items()):
            points = sorted(points)
            if not points:
                continue
            rows = [r for r, _ in points]
            if m < rows[0]:
                held.append((rows[0] / m, size, points[0][1]))
            elif m > rows[-1]:
                held.append((m / rows[-1], size, points[-1][1]))
            elif m == rows[-1]:
                measured.append((size, points[-1][1]))
            else:
                i = next(i for i, r in enumerate(rows) if r > m)
                w = (m - rows[i - 1]) / (rows[i] - rows[i - 1])
                measured.append((size, points[i - 1][1] + w * (points[i][1] - points[i - 1][1])))
        # Interpolated across sizes from the sizes measured at these rows. A size's value held past its
        # measured rows (the LM head is called only at the rows sampled) only where no size was measured
        # there, and then only the sizes measured nearest these rows.
        if not measured and held:
            nearest = min(far for far, _, _ in held)
            measured = [(size, v) for far, size, v in held if far == nearest]
        return log_interp(measured, max(1.0, float(kn))) if measured else 1.0

    @property
    def packed(self) -> bool:
        """Whether the calibration timed packed weights (and so whether it timed the actor's forwards
        packed, as the engine runs them)."""
        return bool(self.gemm_packed)

    def streaming_bandwidth(
        self, working_set: float, rows: int = 1, packed: bool = False, product_bytes: float = 0.0
    ) -> float:
        """Bytes/s at which projections of ``rows`` rows read weights out of a working set of
        ``working_set`` bytes (interpolated in log size and log rows); ``packed``: weights packed once
        (the packed table where the calibration timed one). ``product_bytes``: the product's own weight
        bytes, which read at least as fast as a sweep of products of that size out of memory
        (``streaming_products``, where timed, interpolated in log size and held flat past the largest; a
        product smaller than the smallest timed reads at the working-set table's rate alone)."""
        table = self.streaming_packed if packed and self.streaming_packed else self.streaming
        base = _table_at(table, working_set, rows) if table else self.bandwidth
        sizes = self.streaming_products_packed if packed and self.streaming_products_packed else None
        sizes = sizes or self.streaming_products
        if not sizes or product_bytes < min(size for size, _, _ in sizes):
            return base  # no sweep of its size or smaller was timed: the working-set table's
        return max(base, _table_at(sizes, product_bytes, rows))

    def gemm_s(self, m: int, kn: int, packed: bool = False) -> float:
        """Seconds of an ``[m, K] @ [K, N]`` GEMM with ``K * N = kn``: at each timed weight size, the timed
        rows' seconds made non-decreasing and interpolated linearly in ``m`` (past the last, at its
        FLOP/s); across sizes, seconds per weight element interpolated in log size. Never less for more
        rows. ``packed``: weights packed once (the packed table where the calibration timed one)."""
        table = self.gemm_packed if packed and self.gemm_packed else self.gemm
        per_element = [(size, self._at(table, size, m) / size) for size in sorted(table)]
        return log_interp(per_element, kn) * kn

    @staticmethod
    def _at(table: dict[int, list[tuple[int, float]]], size: int, m: int) -> float:
        points = sorted(table[size])
        rows = [r for r, _ in points]
        seconds, slowest = [], 0.0
        for r, flops in points:
            slowest = max(slowest, 2.0 * r * size / flops)
            seconds.append(slowest)
        if m >= rows[-1]:
            return seconds[-1] * m / rows[-1]
        if m <= rows[0]:
            return seconds[0]
        i = next(i for i, r in enumerate(rows) if r >= m)
        w = (m - rows[i - 1]) / (rows[i] - rows[i - 1])
        return seconds[i - 1] + w * (seconds[i] - seconds[i - 1])


@dataclass(frozen=True, slots=True)
class Profile:
    """A device's calibrated constants (``calibrate``). ``device``: what ``local_device_id`` called it;
    ``kind``: ``"cpu"`` or ``"gpu"``; ``threads``: :class:`ThreadCosts` per thread count (``{1: ...}`` on a
    GPU); ``host``: the engine's host time per forward; ``training_flops``: achieved FLOP/s of a training
    step; ``cores``: the cores two busy lanes of the engine got when it was timed (fitted to pairs of its
    forwards run at once: ``calibration.py::_fit_contention``; on a CPU their bandwidth too, a core's being
    its own; at most the CPU's, 1 on a GPU); ``models``: the shapes it was timed on (a record, not used to
    price)."""

    device: str
    kind: str
    threads: dict[int, ThreadCosts]
    host: HostCosts
    training_flops: float
    cores: float = 1.0
    torch_version: str = ""
    created: str = ""
    models: dict[str, dict] = field(default_factory=dict)
    version: int = VERSION

    def check_shape(self, shape: ModelShape, role: str) -> None:
        """``ValueError`` naming the feature if ``shape`` (the ``role`` model's) has more of a feature than
        the models this profile was calibrated on had when none of their timed forwards had that feature (its
        constant was never measured, ``ThreadCosts.unfitted``): the profile is too small to price it."""
        for threads, costs in sorted(self.threads.items()):
            for name, reach in costs.unfitted.items():
                feature, amount = FEATURES[name]
                need = amount(shape)
                if need > reach:
                    raise ValueError(
                        f"device: the profile of {self.device!r} could not fit {feature}, constant {name} "
                        f"({threads} thread(s)): no forward it timed had that feature (at most "
                        f"{reach:,.0f} of it among its models); the {role} model "
                        f"({shape.name}) has {need:,.0f}: the profile is too small to price it; calibrate "
                        "on a model at least that large (oppo-engine calibrate)"
                    )

    def costs_at(self, threads: int) -> ThreadCosts:
        """The constants of the nearest calibrated thread count."""
        best = min(self.threads, key=lambda t: (abs(t - threads), -t))
        return self.threads[best]

    def to_json(self) -> dict:
        out = dataclasses.asdict(self)
        out["threads"] = {
            str(t): {
                **dataclasses.asdict(c),
                "gemm": {str(k): v for k, v in c.gemm.items()},
                "gemm_packed": {str(k): v for k, v in c.gemm_packed.items()},
                "packed_in_forward": {str(k): v for k, v in c.packed_in_forward.items()},
            }
            for t, c in self.threads.items()
        }
        return out

    @classmethod
    def from_json(cls, data: dict, where: str = "profile") -> Profile:
        if not isinstance(data, dict) or data.get("version") not in READS:
            found = data.get("version") if isinstance(data, dict) else type(data).__name__
            raise ValueError(
                f"{where}: profile format version {found!r}, this oppo_engine reads version {VERSION}; "
                "calibrate again (oppo-engine calibrate)"
            )
        try:
            threads = {
                int(t): ThreadCosts(
                    **{
                        **c,
                        "gemm": {int(k): [tuple(p) for p in v] for k, v in c["gemm"].items()},
                        "streaming": [(float(w), int(r), float(b)) for w, r, b in c.get("streaming", [])],
                        "gemm_packed": {
                            int(k): [tuple(p) for p in v] for k, v in c.get("gemm_packed", {}).items()
                        },
                        "streaming_packed": [
                            (float(w), int(r), float(b)) for w, r, b in c.get("streaming_packed", [])
                        ],
                        "packed_in_forward": {
                            int(k): [(int(m), float(r)) for m, r in v]
                            for k, v in c.get("packed_in_forward", {}).items()
                        },
                        "streaming_products": [
                            (float(w), int(r), float(b)) for w, r, b in c.get("streaming_products", [])
                        ],
                        "streaming_products_packed": [
                            (float(w), int(r), float(b)) for w, r, b in c.get("streaming_products_packed", [])
                        ],
                        "evicted": [
                            (float(b), float(f), float(lay), int(d)) for b, f, lay, d in c.get("evicted", [])
                        ],
                        "switched": [(float(b), float(t)) for b, t in c.get("switched", [])],
                    }
                )
                for t, c in data["threads"].items()
            }
            profile = cls(
                device=data["device"], kind=data["kind"], threads=threads, host=HostCosts(**data["host"]),
                training_flops=data["training_flops"], cores=data.get("cores", 1),
                torch_version=data.get("torch_version", ""),
                created=data.get("created", ""), models=data.get("models", {}), version=VERSION,
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{where}: not a profile written by oppo-engine calibrate ({e!r})") from None
        if profile.kind == "cpu":  # what an older CPU profile prices differently, newest change first
            packed = any(c.packed for c in threads.values())
            for message in _older_cpu_profile(data["version"], packed):
                warnings.warn(
                    f"{where}: {message}; calibrate again (oppo-engine calibrate)", UserWarning, stacklevel=2
                )
        return profile

    def save(self, path: str | Path) -> Path:
        """Write the profile as JSON; the file appears whole or not at all."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        try:
            tmp.write_text(json.dumps(self.to_json(), indent=1))
            os.replace(tmp, path)
        finally:
            tmp.unlink(missing_ok=True)
        return path

    @classmethod
    def load(cls, path: str | Path, *, device: str | None = None) -> Profile:
        """The profile at ``path``; ``ValueError`` if it is of another format version, or (``device``
        given) was calibrated on another device."""
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            where = str(path)
            raise ValueError(f"profile {where!r} does not exist (oppo-engine calibrate writes one)") from None
        except json.JSONDecodeError as e:
            raise ValueError(f"profile {str(path)!r} is not JSON ({e})") from None
        profile = cls.from_json(data, where=f"profile {str(path)!r}")
        if device is not None and profile.device != device:
            raise ValueError(
                f"profile {str(path)!r} was calibrated on {profile.device!r}, not on this device "
                f"({device!r}); calibrate this device (oppo-engine calibrate)"
            )
        return profile


# How a packed product's in-forward excess in seconds grows with its weights past the largest size a profile
# measured it at (``Calibrated._in_forward_s``): excess ~ (K*N) ** this. Measured: the slope of log excess
# against log size over the in-forward ratios of products of 64 K-4 M weights at 128, 256 and 512 rows
# (where they are compute-bound and measured), one fit per profile and row count: 76 fits over the 27
# profiles of gqa8, mid and small in three 3-run matrix sets on a Xeon (2026-12-07; tiny's products are all
# smaller): median 0.475, quartiles 0.25 and 0.63 (by row count gqa8's medians 0.62-0.72, mid's 0.33-0.58,
# small's 0.22-0.39); ``bench/results/twin_in_forward_sizes_xeon_2026-12-07.txt``. Applied at every row
# count, decode rows included, where no large product is compute-bound to measure it.
EXCESS_SIZE_EXPONENT = 0.5


class Calibrated:
    """Prices a forward's kernels from a :class:`Profile` (``sim/cost.py``)."""

    def __init__(self, profile: Profile) -> None:
        self.profile = profile
        self.kind = profile.kind
        self.host = profile.host
        # Per (thread costs, K*N): the in-forward price's running maximum over rows 1.. up to the last rows
        # a ratio was measured at (``_in_forward_s``).
        self._floors: dict[tuple[int, int], list[float]] = {}
        self._tops: dict[int, tuple[int, int]] = {}  # per thread costs: its ratios' last rows and size

    @property
    def name(self) -> str:
        return self.profile.device

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
        c = self.profile.costs_at(threads)
        # The timed GEMMs kept their weights in cache; a forward through ``working_set`` bytes of weights
        # reads them at the streaming bandwidth of that working set. ``packed``: the weights packed once,
        # as the engine's actor has them on the CPU (the packed tables, where the calibration timed them).
        moved = k * n * dtype_bytes / c.streaming_bandwidth(working_set, m, packed, k * n * dtype_bytes)
        if packed and c.packed and c.packed_in_forward:
            compute = self._in_forward_s(c, m, k * n)  # as the actor's forward calls it
        else:
            compute = c.gemm_s(m, k * n, packed)
        return c.gemm_scale * compute, c.gemm_scale * moved

    def _in_forward_s(self, c: ThreadCosts, m: int, kn: int) -> float:
        """A packed product's compute term as the actor's forward calls it: its bare price scaled by
        ``in_forward``, never less for more rows. The ratio falls with rows faster than the bare price grows
        at a few rows (measured: 1.2-2.0x at 1-32 rows, 1.04-1.2x at 128-512), so the product alone can
        price four rows below one; the running maximum over the rows up to ``m`` keeps the order ``gemm_s``
        keeps. Past the last rows a ratio was measured at, the ratio is held and the product grows.

        A product larger than every size the ratio was measured at (another model's, say) is charged the
        excess in seconds, at its rows, of the largest size measured (at any rows; its ratio at these rows is
        what ``in_forward`` gives it: at decode rows, where a profile's largest products are memory-bound and
        not measured, a smaller size's, held), grown as the square root of the weights
        (``EXCESS_SIZE_EXPONENT``), not that size's ratio; where the bare price grows slower than that (a
        few-row product whose time is mostly the call), above what the ratio held charges. The excess (what
        the forward's interpreter and cache traffic add to a product) grows far slower than a compute-bound
        product: where gqa8's profile measured it, its ratio falls from 1.36x at 128 K elements to 1.09x at 4
        M (128 rows; the excess about 8x for 32x the weights). Why: the ratio, measured where the products are
        compute-bound (small weights, or many rows), was held across sizes -- ``tiny``'s 33 K-element
        products' 1.5-2.7x at 1-16 rows priced gqa8's 1-4 M-element decode products (memory-bound inside the
        forward, 1.6-1.7x their bare time at 8 rows) as compute-bound, and gqa8's steps 9-19% high in the
        medians of a 3-run matrix from ``tiny``'s, ``small``'s and ``mid``'s profiles (2026-12-07,
        ``bench/results/twin_in_forward_sizes_xeon_2026-12-07.txt``)."""

        tops = self._tops.get(id(c))
        if tops is None:  # (the last rows, the largest size) a ratio was measured at, once per thread costs
            ratios = c.packed_in_forward
            tops = self._tops[id(c)] = (
                max(r for points in ratios.values() for r, _ in points),
                max((k for k, v in ratios.items() if v), default=0),
            )
        top_rows, top_kn = tops

        def scaled(rows: int) -> float:
            bare, ratio = c.gemm_s(rows, kn, True), c.in_forward(rows, kn)
            if kn > top_kn > 0:
                grown = (kn / top_kn) ** EXCESS_SIZE_EXPONENT
                return bare + (ratio - 1.0) * c.gemm_s(rows, top_kn, True) * grown
            return bare * ratio

        rows_in = int(m)
        if rows_in < 1:
            return scaled(m)
        floor = self._floors.get((id(c), kn))
        if floor is None:
            floor, best = [], 0.0
            for rows in range(1, max(1, top_rows) + 1):
                best = max(best, scaled(rows))
                floor.append(best)
            self._floors[(id(c), kn)] = floor
        if rows_in == m and m <= len(floor):
            return floor[rows_in - 1]
        return max(floor[min(rows_in, len(floor)) - 1], scaled(m))

    def attention(self, shape: ModelShape, batch: Batch, threads: int = 1) -> tuple[float, float]:
        c = self.profile.costs_at(threads)
        kv = shape.kv_width * 2 * shape.dtype_bytes
        pairs = sum(attention_pairs(n, ctx) for n, ctx in batch.chunks)
        read = sum(kv * ctx for _, ctx in batch.chunks)
        compute = c.pair_s * shape.q_width * pairs
        memory = c.kv_byte_s * read
        return compute + memory, memory

    def elementwise(self, shape: ModelShape, tokens: int, logit_rows: int, threads: int = 1) -> float:
        c = self.profile.costs_at(threads)
        return c.token_hidden_s * shape.layers * tokens * shape.hidden + c.logit_s * logit_rows * shape.vocab

    def fixed(
        self,
        shape: ModelShape,
        captured: bool,
        threads: int = 1,
        *,
        actor: bool = False,
        packed: bool = False,
    ) -> tuple[float, float]:
        """(host seconds, launch seconds) of one forward: the fixed costs per forward and per layer, and an
        ``actor``'s own beside them (``ThreadCosts.actor_forward_s``, ``actor_layer_s``), timed on its copies
        as the engine runs the actor here: packed where the calibration packed, else as it is (where nothing
        packs, an actor asked ``packed`` runs unpacked, as timed). An actor run unpacked on a profile that
        packed (``packed_weights=False``) is priced as a scorer's: its own costs were not timed. Every role's
        forward also pays the fixed costs' excess after its weights stream through the caches
        (``ThreadCosts.evicted_s`` at the model's weight bytes)."""
        c = self.profile.costs_at(threads)
        fixed = c.forward_s + c.layer_s * shape.layers + c.evicted_s(shape.weight_bytes, shape.layers)
        if actor and (packed or not c.packed):
            fixed += c.actor_forward_s + c.actor_layer_s * shape.layers
        return fixed, 0.0

    def host_s(self, rows: int) -> float:
        return self.host.per_forward_s + self.host.per_row_s * rows

    def repack_s(self, shape: ModelShape, threads: int = 1) -> float:
        """Packing ``shape``'s actor weights again after a weight update (``ThreadCosts.repack_s`` per packed
        tensor, ``repack_byte_s`` per byte)."""
        c = self.profile.costs_at(threads)
        return c.repack_s * shape.packs() + c.repack_byte_s * shape.packed_bytes()

    def switched_s(self, shape: ModelShape, threads: int = 1) -> float:
        """A forward's excess when another model ran on its device since this model last did
        (``ThreadCosts.switched_s`` at the model's weight bytes)."""
        return self.profile.costs_at(threads).switched_s(shape.weight_bytes)

    def training_s(self, flops: float) -> float:
        return flops / self.profile.training_flops

    def collective_s(self, nbytes: float, gpus: int) -> float:
        return 0.0  # a calibrated profile is one device: no collectives

    def stream_s(self, nbytes: float) -> float:
        return nbytes / self.profile.costs_at(1).bandwidth


def local_device_id(device) -> str:
    """A name for ``device`` that another machine does not share: the CPU model and core count, or the
    GPU's name."""
    import torch  # noqa: PLC0415

    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda:{torch.cuda.get_device_name(device)}"
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu:{model}:{os.cpu_count()} cores"


def default_profile_path(device_id: str) -> Path:
    """Where the profile of the device named ``device_id`` is written and looked for."""
    root = os.environ.get("OPPO_ENGINE_PROFILES") or Path.home() / ".cache" / "oppo_engine" / "profiles"
    slug = "".join(c if c.isalnum() else "-" for c in device_id).strip("-").lower()
    return Path(root) / f"{slug}.json"


def _older_cpu_profile(version: int, packed: bool) -> list[str]:
    """What a CPU profile of format ``version`` measured that this one does differently, one message per
    change since (``packed``: the profile has packed tables), newest first."""
    out = []
    if version <= 11:
        out.append(
            f"format version {version} kept the fastest of each timing's rounds, which prices the machine at "
            "its fastest moments (calibrated side by side on a virtual machine whose speed comes in spells, "
            "the matrix's cells priced the median of their real steps -12% and -19% on average in two sets, "
            "against -7% and -13.5% with version 12's median of the rounds)"
        )
    if version <= 10:
        out.append(
            f"format version {version} timed its forwards with the bench's own bookkeeping inside each call "
            "(every row made and freed), which the fit read as attention, so a long context is priced high "
            "(a decode of a 12 MiB model at 512 context tokens 27-156% high, on the machine where version "
            "11 was made)"
        )
    if version <= 9:
        out.append(
            f"format version {version} timed no forward right after another model's, so every forward is "
            "priced as if back to back, most of all a streamed step's, which alternate the models on the "
            "shared cache (version 10 charges 0.15-0.38 ms such a forward on models of 12-70 MiB here)"
        )
    if version <= 8:
        out.append(
            f"format version {version} measured no host time per step outside the forwards (0.25-0.36 ms a "
            "step with forwards that cost nothing, measured), so a short step is priced short by it"
        )
    if version == 7:
        out.append(
            "format version 7 timed the weights' streaming on small products only and the fixed costs with "
            "the caches hot, so a model of large products (their reads measured 1.6-1.8x as fast as priced)"
            " is priced slow and the fixed costs of a model whose weights pass the cache (0.3-0.6 ms a "
            "forward measured) fast"
        )
    if version == 6:
        out.append(
            "format version 6 measured no hand-overs of the interpreter between two lanes of one process, "
            "and fitted its cores with them read as missing cores (two lanes of a small model slowed each "
            "other 2-2.8x on two cores), so a streamed step of a wider model is priced slow and one of a "
            "Python-bound model where its profile's cores are wider"
        )
    if version == 5 and packed:
        out.append(
            "format version 5 priced the actor's packed products at their bare time in a loop of one "
            "product, which inside a forward they exceed (the interpreter's work between them takes the "
            "caches: 1-19 us a product on the small models here), so the actor's forwards are priced low"
        )
    if version == 4:
        out.append(
            "format version 4 fitted one fixed cost per forward and per layer to every role, so the actor's"
            " forwards (its packed products' bookkeeping, its sampler: some 100 us a forward and 35-90 us a"
            " layer more than a scorer's on the small models here) are priced low"
        )
    if version == 3:
        out.append(
            "format version 3 timed no repacking of the actor's packed weights after a weight update and "
            "fitted its forwards around ungrouped products, so the twin prices no repacking and the grouped"
            " products with the old fit"
        )
    if version < 3:
        out.append(
            f"format version {version} timed no packed weights, so the engine's actor (packed on the CPU: "
            "EngineConfig.packed_weights) is priced as unpacked, high where its weights bind it"
        )
    return out
