"""Response and prompt lengths for a plan: a sequence, a file, or a parametric law.

- an int: every length is that;
- a sequence of ints: used in order, one per prompt, cycled when the plan needs more;
- a file: one length per line (``#`` comments and blank lines skipped), or a ``records.json`` of a run (a
  list of objects with a ``response_len`` or ``response_ids`` field, or ``{"records": [...]}``);
- a law ``name:key=value,...``: ``lognormal:median=250,sigma=0.9,cap=1024`` (optional ``min``, default 1),
  ``uniform:low=16,high=512``, ``fixed:value=128``.

Draws are seeded functions of the prompt's index, so every mode of a plan sees the same lengths.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

LAWS = {"lognormal": ("median", "sigma", "cap"), "uniform": ("low", "high"), "fixed": ("value",)}
OPTIONAL = {"lognormal": {"min": 1.0}, "uniform": {}, "fixed": {}}


@dataclass(frozen=True, slots=True)
class Lengths:
    """The length of the ``i``-th prompt's response (or of the prompt itself): ``lengths[i]``."""

    values: tuple[int, ...] | None = None  # a list, cycled
    law: str | None = None
    params: tuple[tuple[str, float], ...] = ()
    seed: int = 0

    def __getitem__(self, i: int) -> int:
        if self.values is not None:
            return self.values[i % len(self.values)]
        p = dict(self.params)
        rng = random.Random((self.seed << 32) ^ (i * 2654435761 & 0xFFFFFFFF))
        if self.law == "lognormal":
            x = p["median"] * math.exp(p["sigma"] * rng.gauss(0.0, 1.0))
            return int(min(p["cap"], max(p["min"], round(x))))
        if self.law == "uniform":
            return rng.randint(int(p["low"]), int(p["high"]))
        return int(p["value"])

    @property
    def cap(self) -> int:
        """The longest length this can give."""
        if self.values is not None:
            return max(self.values)
        p = dict(self.params)
        return int(p.get("cap", p.get("high", p.get("value", 0))))

    def mean(self, n: int = 4096) -> float:
        """The mean over the first ``n`` draws."""
        return sum(self[i] for i in range(n)) / n

    def describe(self) -> str:
        if self.values is not None and len(set(self.values)) == 1:
            return str(self.values[0])
        if self.values is not None:
            return f"{len(self.values)} lengths (mean {sum(self.values) / len(self.values):.0f})"
        return f"{self.law}:" + ",".join(f"{k}={v:g}" for k, v in self.params)


def parse_lengths(spec, *, what: str = "lengths", seed: int = 0) -> Lengths:
    """A :class:`Lengths` from ``spec`` (module docstring); ``ValueError`` naming ``what`` -- and the line,
    for a file -- when it is malformed."""
    if isinstance(spec, Lengths):
        return spec
    if isinstance(spec, bool):
        raise ValueError(f"{what}: a length must be an int >= 1, got {spec!r}")
    if isinstance(spec, int):
        return Lengths(values=(_positive(spec, what),))
    if isinstance(spec, str) and spec.strip().isdigit():
        return Lengths(values=(_positive(int(spec), what),))
    if isinstance(spec, Path) or (isinstance(spec, str) and ":" not in spec):
        return _from_file(Path(spec), what)
    if isinstance(spec, str):
        name, _, rest = spec.partition(":")
        if Path(spec).is_file():
            return _from_file(Path(spec), what)
        return _law(name.strip().lower(), rest, what, seed)
    if isinstance(spec, Sequence):
        values = tuple(_positive(v, f"{what}[{i}]") for i, v in enumerate(spec))
        if not values:
            raise ValueError(f"{what}: an empty list of lengths")
        return Lengths(values=values)
    raise ValueError(f"{what}: an int, a list of ints, a file or a law like 'lognormal:...'; got {spec!r}")


def _positive(value, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{where}: a length must be an int >= 1, got {value!r}")
    return value


def _law(name: str, rest: str, what: str, seed: int) -> Lengths:
    if name not in LAWS:
        raise ValueError(f"{what}: unknown law {name!r}; one of {', '.join(LAWS)} (name:key=value,...)")
    params = dict(OPTIONAL[name])
    for part in filter(None, (p.strip() for p in rest.split(","))):
        key, eq, value = part.partition("=")
        key = key.strip()
        if not eq or key not in (*LAWS[name], *OPTIONAL[name]):
            raise ValueError(f"{what}: {name} takes {', '.join(LAWS[name])}; got {part!r}")
        try:
            params[key] = float(value)
        except ValueError:
            raise ValueError(f"{what}: {name} {key}={value!r} is not a number") from None
    missing = [k for k in LAWS[name] if k not in params]
    if missing:
        raise ValueError(f"{what}: {name} needs {', '.join(missing)}")
    if any(not math.isfinite(v) or v < 0 for v in params.values()):
        raise ValueError(f"{what}: {name} parameters must be finite and >= 0, got {params}")
    if name == "lognormal" and (params["median"] < 1 or params["cap"] < 1):
        raise ValueError(f"{what}: lognormal median and cap must be >= 1, got {params}")
    if name == "uniform" and not 1 <= params["low"] <= params["high"]:
        raise ValueError(f"{what}: uniform needs 1 <= low <= high, got {params}")
    if name == "fixed" and params["value"] < 1:
        raise ValueError(f"{what}: fixed value must be >= 1, got {params['value']}")
    return Lengths(law=name, params=tuple(sorted(params.items())), seed=seed)


def _from_file(path: Path, what: str) -> Lengths:
    if not path.is_file():
        raise ValueError(f"{what}: {str(path)!r} is neither a file nor a law like 'lognormal:median=...'")
    text = path.read_text()
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"{what}: {path}: line {e.lineno}: not JSON ({e.msg})") from None
        records = data.get("records", data) if isinstance(data, dict) else data
        if not isinstance(records, list):
            raise ValueError(f"{what}: {path}: a list of records (or {{'records': [...]}}) is expected")
        values = []
        for i, r in enumerate(records):
            if isinstance(r, dict) and "response_len" in r:
                values.append(_positive(r["response_len"], f"{what}: {path}: record {i} response_len"))
            elif isinstance(r, dict) and isinstance(r.get("response_ids"), list) and r["response_ids"]:
                values.append(len(r["response_ids"]))
            else:
                raise ValueError(f"{what}: {path}: record {i} has no response_len or response_ids")
        if not values:
            raise ValueError(f"{what}: {path}: no records")
        return Lengths(values=tuple(values))
    values = []
    for number, line in enumerate(text.splitlines(), start=1):
        entry = line.split("#", 1)[0].strip()
        if not entry:
            continue
        try:
            value = int(entry)
        except ValueError:
            bad = line.strip()
            raise ValueError(f"{what}: {path}: line {number}: {bad!r} is not a length (an int)") from None
        values.append(_positive(value, f"{what}: {path}: line {number}"))
    if not values:
        raise ValueError(f"{what}: {path}: no lengths in the file")
    return Lengths(values=tuple(values))
