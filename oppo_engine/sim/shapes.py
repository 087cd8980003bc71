"""A model's shape, as the cost model reads it: from a preset name, a ``config.json`` or an HF config.

Only what decides a forward's arithmetic and bytes is kept (layers, widths, heads, vocabulary, the dtype of
the weights and the head the role puts on top). Nothing is downloaded and no weight is built.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

# Bytes per element of the dtypes a config names.
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4, "bf16": 2, "fp16": 2, "fp32": 4}
HEADS = ("lm", "score", "value")  # the actor and reference, the reward, the critic


@dataclass(frozen=True, slots=True)
class ModelShape:
    """One model's dimensions and weight dtype. ``head``: ``"lm"`` (a vocabulary projection: actor,
    reference), ``"score"`` (one label at the last token: reward) or ``"value"`` (one label at every
    token: critic)."""

    name: str
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool
    dtype_bytes: int = 2
    head: str = "lm"
    # Whether the engine's fused attention serves this family (transformers' Llama), whose packed q, k and v
    # projections then run as one grouped product on the CPU (``model/packed.py``).
    fused_qkv: bool = False

    def __post_init__(self) -> None:
        for field in ("layers", "hidden", "heads", "kv_heads", "head_dim", "intermediate", "vocab"):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"model {self.name!r}: {field} must be an int >= 1, got {value!r}")
        if self.head not in HEADS:
            raise ValueError(f"model {self.name!r}: head must be one of {HEADS}, got {self.head!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name!r}: {self.heads} heads over {self.kv_heads} KV heads")

    def with_head(self, head: str, dtype_bytes: int | None = None) -> ModelShape:
        """The same body under another head (the actor's shape as a critic: a value head)."""
        return ModelShape(
            self.name, self.layers, self.hidden, self.heads, self.kv_heads, self.head_dim, self.intermediate,
            self.vocab, self.tied, self.dtype_bytes if dtype_bytes is None else dtype_bytes, head,
            self.fused_qkv,
        )  # fmt: skip

    # -- sizes -------------------------------------------------------------------------------------------

    @property
    def q_width(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.kv_heads * self.head_dim

    @property
    def layer_params(self) -> int:
        """Weights of one decoder layer: q, k, v (with Qwen2's biases), o, the gated MLP, two norms."""
        h = self.hidden
        attention = h * self.q_width + 2 * h * self.kv_width + self.q_width * h
        biases = self.q_width + 2 * self.kv_width
        return attention + biases + 3 * h * self.intermediate + 2 * h

    @property
    def head_params(self) -> int:
        """The head's own weights (a tied LM head shares the embedding's)."""
        if self.head == "lm":
            return 0 if self.tied else self.vocab * self.hidden
        return self.hidden

    @property
    def params(self) -> int:
        return self.layers * self.layer_params + self.vocab * self.hidden + self.hidden + self.head_params

    @property
    def weight_bytes(self) -> int:
        return self.params * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        """Key and value of one token in every layer."""
        return self.layers * 2 * self.kv_width * self.dtype_bytes

    def layer_gemms(self, grouped: bool = False) -> list[tuple[int, int]]:
        """(K, N) of each weight GEMM of one layer, for T tokens: [T, K] @ [K, N]. ``grouped``: as the
        engine's packed actor runs them on the CPU (``model/packed.py``): the MLP's gate and up projections
        as one product, and q, k and v as one where ``fused_qkv``."""
        h, i = self.hidden, self.intermediate
        if self.fused_qkv and grouped:
            attention = [(h, self.q_width + 2 * self.kv_width)]
        else:
            attention = [(h, self.q_width), (h, self.kv_width), (h, self.kv_width)]
        mlp = [(h, 2 * i)] if grouped else [(h, i), (h, i)]
        return [*attention, (self.q_width, h), *mlp, (i, h)]

    def packed_bytes(self) -> int:
        """Bytes of the weights the engine's packed actor holds packed on the CPU (``model/packed.py``): every
        projection's (the LM head's included), and the grouped products' stacked copies on top."""
        alone = sum(k * n for k, n in self.layer_gemms())
        stacked = (self.hidden * (self.q_width + 2 * self.kv_width) if self.fused_qkv else 0) + (
            self.hidden * 2 * self.intermediate
        )
        k, n = self.head_gemm()
        return (self.layers * (alone + stacked) + k * n) * self.dtype_bytes

    def packs(self) -> int:
        """How many packed tensors the engine's packed actor holds (``model/packed.py``): one per projection
        (the LM head's included) and one per grouped product (gate and up; q, k and v where ``fused_qkv``)."""
        return self.layers * (len(self.layer_gemms()) + 1 + self.fused_qkv) + 1

    def head_gemm(self) -> tuple[int, int]:
        """(K, N) of the head's projection."""
        return (self.hidden, self.vocab if self.head == "lm" else 1)


def _from_mapping(name: str, cfg: dict, dtype_bytes: int | None) -> ModelShape:
    def get(*keys, default=None):
        for key in keys:
            if cfg.get(key) is not None:
                return cfg[key]
        if default is None:
            raise ValueError(f"model {name!r}: the config has none of {keys}")
        return default

    heads = int(get("num_attention_heads", "n_head"))
    hidden = int(get("hidden_size", "n_embd", "d_model"))
    head_dim = cfg.get("head_dim") or hidden // heads
    if dtype_bytes is None:
        dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
        dtype_bytes = _DTYPE_BYTES.get(dtype, 2)
    return ModelShape(
        name=name,
        layers=int(get("num_hidden_layers", "n_layer", "num_layers")),
        hidden=hidden,
        heads=heads,
        kv_heads=int(get("num_key_value_heads", default=heads)),
        head_dim=int(head_dim),
        intermediate=int(get("intermediate_size", "ffn_dim", default=4 * hidden)),
        vocab=int(get("vocab_size")),
        tied=bool(cfg.get("tie_word_embeddings", False)),
        dtype_bytes=dtype_bytes,
        fused_qkv=cfg.get("model_type") == "llama",
    )


def model_shape(
    model, *, head: str = "lm", dtype_bytes: int | None = 2, name: str | None = None
) -> ModelShape:
    """The shape of ``model``: a preset name (``oppo_engine.presets``), a ``config.json`` path (or the folder
    holding one), an HF ``PretrainedConfig`` or a module with ``.config``, or a ``ModelShape`` (its head
    replaced). ``dtype_bytes=None`` reads the dtype from the config (bf16 where it names none)."""
    if isinstance(model, ModelShape):
        return model.with_head(head, dtype_bytes)
    if isinstance(model, str | Path):
        from oppo_engine.presets import PRESETS  # noqa: PLC0415  (torch-free callers never get here)

        text = str(model)
        if text in PRESETS:
            cfg = dict(PRESETS[text])
            cfg.setdefault("tie_word_embeddings", False)
            return _from_mapping(name or text, cfg, dtype_bytes).with_head(head)
        path = Path(model)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ValueError(
                f"model {text!r} is neither a preset ({', '.join(sorted(PRESETS))}) nor a config.json file"
            )
        try:
            cfg = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"model {text!r}: {path} is not valid JSON ({e})") from None
        return _from_mapping(name or path.parent.name or text, cfg, dtype_bytes).with_head(head)
    config = getattr(model, "config", model)
    if not hasattr(config, "to_dict"):
        raise ValueError(
            f"model {model!r}: give a preset name, a config.json path, an HF config or a model with .config"
        )
    cfg = config.to_dict()
    return _from_mapping(name or str(cfg.get("model_type", "model")), cfg, dtype_bytes).with_head(head)


def attention_pairs(new_tokens: int, context: int) -> float:
    """Query-key pairs of ``new_tokens`` appended after ``context - new_tokens`` cached ones (causal)."""
    before = context - new_tokens
    return new_tokens * before + new_tokens * (new_tokens + 1) / 2


def log_interp(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear interpolation of ``y`` in ``log(x)`` through sorted ``points``, held flat outside."""
    if x <= points[0][0]:
        return points[0][1]
    if x >= points[-1][0]:
        return points[-1][1]
    for (x0, y0), (x1, y1) in zip(points, points[1:], strict=False):
        if x <= x1:
            w = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + w * (y1 - y0)
    return points[-1][1]
