"""A pack's attention as one batched causal call (``PPOConfig.pack_attention``): the same losses and gradients
as padded minibatches, no ``T x T`` mask, sequences that never see each other, the model's attention given
back whatever happens, and what the call cannot do exactly refused by name."""

from __future__ import annotations

import copy
import math
import threading

import pytest
import torch
import torch.nn.functional as F
from families import FAMILIES, ROUTED, build_actor
from test_ppo_packing import _leaky_attention, _record_steps, assert_same_update, make_trainer, ppo_models
from transformers import AttentionInterface, AutoModelForCausalLM
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

from oppo_engine.ppo import PPOConfig
from oppo_engine.ppo.pack_attention import (
    ATTN_IMPL,
    PackLayout,
    batched_attention,
    batched_sdpa,
    bound,
    bucket_lengths,
    register,
)
from oppo_engine.ppo.packing import (
    check_batched_packing,
    check_packing,
    pack_logprobs,
    pack_rows,
    plan_packs,
    plan_sorted_packs,
)


@pytest.fixture
def no_masks(monkeypatch):
    """Every mask builder of sdpa and eager (the dense ``T x T`` block-diagonal mask among them) raises."""

    def refuse(*args, **kwargs):
        raise AssertionError("an attention mask was built")

    for impl in ("sdpa", "eager"):
        monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, impl, refuse)


def _logprobs(model, pack):
    return pack_logprobs(model, pack, 1.0)


def test_sorted_packs_hold_runs_of_similar_lengths_within_the_budget():
    lengths = [5, 17, 3, 9, 9, 1, 12, 20]
    packs = plan_sorted_packs(lengths, 20)
    assert sorted(i for p in packs for i in p) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in p) <= 20 for p in packs)
    # Next fit over the longest-first order (ties by position): 20 | 17 | 12 | 9+9 | 5+3+1. First-fit
    # decreasing puts the 3 beside the 17 and the 5 and 1 beside the 12.
    assert packs == [[7], [1], [6], [3, 4], [0, 2, 5]]
    assert plan_packs(lengths, 20) == [[7], [1, 2], [6, 0, 5], [3, 4]]
    with pytest.raises(ValueError, match="max_tokens_per_microbatch=16"):
        plan_sorted_packs(lengths, 16)


def test_buckets_hold_lengths_within_a_factor_of_two_and_every_token_once():
    lengths = [7, 11, 5, 1, 6]
    assert bucket_lengths(lengths) == [[1, 0, 4], [2], [3]]  # 11, 7, 6 | 5 (under half of 11) | 1
    layout = PackLayout.of(lengths, "cpu")
    assert [tuple(b.gather.shape) for b in layout.buckets] == [(3, 11), (1, 5), (1, 1)]
    rows = torch.cat([b.gather.flatten()[b.scatter] for b in layout.buckets])
    assert sorted(rows.tolist()) == list(range(sum(lengths)))  # every packed token once
    assert torch.equal(rows[layout.order], torch.arange(sum(lengths)))  # and back in packed order
    # A pack sorted longest first needs no reordering; ratio inf is one call over the whole pack.
    assert PackLayout.of(sorted(lengths, reverse=True), "cpu").order is None
    assert len(PackLayout.of(lengths, "cpu", ratio=math.inf).buckets) == 1


@pytest.mark.parametrize("ratio", [2.0, math.inf])
@pytest.mark.parametrize(("kv_heads", "head_dim"), [(4, 16), (2, 16), (1, 16), (2, 288)])
def test_batched_sdpa_is_each_sequences_own_causal_attention(ratio, kv_heads, head_dim):
    """Against one causal sdpa per sequence (fp32, grouped K/V heads repeated): outputs and the gradients of
    queries, keys and values; awkward lengths (one token, a bucket of one); a head over 256 wide, whose
    grouped heads the call repeats itself (no ``enable_gqa``)."""
    g = torch.Generator().manual_seed(3)
    lengths = [5, 1, 13, 12, 2, 7]
    total = sum(lengths)
    q, k, v = (
        torch.randn(1, h, total, head_dim, generator=g).requires_grad_() for h in (4, kv_heads, kv_heads)
    )
    grad = torch.randn(1, total, 4, head_dim, generator=g)
    got = batched_sdpa(q, k, v, PackLayout.of(lengths, "cpu", ratio), scaling=0.3)
    got_grads = torch.autograd.grad(got, (q, k, v), grad)
    parts = zip(*(x.split(lengths, 2) for x in (q, k, v)), strict=True)
    want = torch.cat(
        [
            F.scaled_dot_product_attention(
                a, b.repeat_interleave(4 // kv_heads, 1), c.repeat_interleave(4 // kv_heads, 1),
                is_causal=True, scale=0.3,
            )
            for a, b, c in parts
        ],
        2,
    ).transpose(1, 2)  # fmt: skip
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    atol = 1e-6 if head_dim <= 256 else 1e-4  # sums of 288 products in another kernel's order: rounding
    torch.testing.assert_close(got, want, rtol=1e-5, atol=atol)
    for a, b in zip(got_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=atol)


@pytest.mark.parametrize("group_by_length", [False, True])
def test_batched_pack_losses_and_gradients_equal_padded_with_no_mask_built(group_by_length, monkeypatch):
    runs = {}
    for budget in (None, 40):
        trainer = make_trainer(
            ppo_models(),
            max_tokens_per_microbatch=budget,
            pack_attention="batched" if budget else "auto",
            group_by_length=group_by_length,
            epochs=2,
        )
        grads = _record_steps(trainer)
        with monkeypatch.context() as m:
            if budget:  # the batched update (agreement forward included) builds no mask at all
                for impl in ("sdpa", "eager"):
                    m.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, impl, _no_mask)
            stats = trainer.step()
        assert trainer._pack_attention_modes() == {"actor": bool(budget), "critic": bool(budget)}
        trainer.close()
        runs[budget] = (stats, grads)
    (padded, padded_grads), (packed, packed_grads) = runs[None], runs[40]
    assert_same_update(packed, padded, packed_grads, padded_grads)
    assert packed.agreement["fresh"].max_abs < 1e-4
    assert len(packed_grads) == len(padded_grads) == 4
    assert all(any(k.startswith("critic.") for k in a) and len(a) > 10 for a in packed_grads)


@pytest.mark.parametrize("impl", ["reentrant", "no_reentrant"])
def test_a_torch_checkpoint_wrapper_recomputes_inside_the_packs_batched_attention(impl):
    """torch's activation checkpointing (not transformers' flag, which the switch refuses) recomputes each
    wrapped layer's forward inside the backward: the pack's batched attention must still be on then, or the
    recompute attends across the pack's sequences (reentrant: silently wrong gradients; non-reentrant: a
    CheckpointError)."""
    from functools import partial

    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
        CheckpointImpl,
        apply_activation_checkpointing,
        checkpoint_wrapper,
    )

    wrap = partial(checkpoint_wrapper, checkpoint_impl=getattr(CheckpointImpl, impl.upper()))
    runs = {}
    for budget in (None, 40):
        trainer = make_trainer(ppo_models(), max_tokens_per_microbatch=budget, group_by_length=False)
        if budget:
            for model in (trainer.actor, trainer.critic):
                layer = type(model.model.layers[0])
                apply_activation_checkpointing(
                    model, checkpoint_wrapper_fn=wrap, check_fn=lambda m, layer=layer: isinstance(m, layer)
                )
            assert trainer._pack_attention_modes() == {"actor": True, "critic": True}
        grads = _record_steps(trainer)
        runs[budget] = (trainer.step(), grads)
        trainer.close()
    (padded, padded_grads), (packed, packed_grads) = runs[None], runs[40]
    torch.testing.assert_close(packed.policy_loss, padded.policy_loss, rtol=1e-5, atol=1e-6)
    assert len(packed_grads) == len(padded_grads) > 0
    for a, b in zip(packed_grads, padded_grads, strict=True):
        a = {k.replace("_checkpoint_wrapped_module.", ""): v for k, v in a.items()}
        assert a.keys() == b.keys()
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)


def _no_mask(*args, **kwargs):
    raise AssertionError("an attention mask was built")


def test_the_dense_pack_builds_a_mask_and_the_batched_one_none(no_masks):
    """The mask check bites: the dense pack's forward asks for its ``T x T`` mask; the batched one asks for
    none, and every layer's attention goes through the batched call."""
    _, actor, *_ = ppo_models()
    pack = pack_rows(torch.randint(3, actor.config.vocab_size, (3, 9)), [9, 4, 7])
    with torch.no_grad(), pytest.raises(AssertionError, match="an attention mask was built"):
        _logprobs(actor, pack)
    with torch.no_grad(), batched_attention(actor, pack.lengths) as layout:
        _logprobs(actor, pack)
    assert layout.calls == actor.config.num_hidden_layers


def test_changing_one_sequence_leaves_the_others_batched_outputs_bitwise_equal():
    _, actor, *_ = ppo_models()
    g = torch.Generator().manual_seed(0)
    lengths = [7, 11, 5]
    vocab = actor.config.vocab_size
    rows = torch.randint(3, vocab, (3, max(lengths)), generator=g)
    changed = rows.clone()
    changed[1] = torch.randint(3, vocab, (max(lengths),), generator=g)
    logits = []
    with torch.no_grad():
        for ids in (rows, changed):
            pack = pack_rows(ids, lengths)
            with batched_attention(actor, lengths):
                out = actor(input_ids=pack.input_ids, position_ids=pack.position_ids, use_cache=False)
            logits.append(out.logits)
    starts = [0, 7, 18]
    for k in (0, 2):
        span = slice(starts[k], starts[k] + lengths[k])
        assert torch.equal(logits[0][0, span], logits[1][0, span])
    middle = slice(starts[1], starts[1] + lengths[1])
    assert not torch.equal(logits[0][0, middle], logits[1][0, middle])
    # Each sequence's batched log-probs are its own forward's (positions restart at every sequence).
    with torch.no_grad(), batched_attention(actor, lengths):
        packed = _logprobs(actor, pack_rows(rows, lengths))
    with torch.no_grad():
        for k, n in enumerate(lengths):
            alone = actor(input_ids=rows[k : k + 1, :n], use_cache=False).logits[0, :-1].log_softmax(-1)
            expect = alone.gather(-1, rows[k, 1:n, None])[:, 0]
            torch.testing.assert_close(packed[k, : n - 1], expect, rtol=1e-5, atol=1e-6)


def test_the_model_gets_its_attention_back_after_an_error():
    _, actor, *_ = ppo_models()
    pack = pack_rows(torch.randint(3, actor.config.vocab_size, (2, 6)), [6, 4])
    with pytest.raises(RuntimeError, match="inside"), batched_attention(actor, pack.lengths):
        assert actor.config._attn_implementation == ATTN_IMPL
        raise RuntimeError("inside")
    assert actor.config._attn_implementation == "sdpa"
    # An error of the attention itself (a feature it refuses, met in the forward) as well.
    gemma2 = build_actor("gemma2")
    with torch.no_grad(), pytest.raises(ValueError, match="softcapping"):
        with batched_attention(gemma2, pack.lengths):
            _logprobs(gemma2, pack)
    assert gemma2.config._attn_implementation == "eager"
    # And outside the block a forward runs on the model's own attention again.
    with torch.no_grad():
        torch.testing.assert_close(_logprobs(actor, pack), _logprobs(actor, pack), rtol=0, atol=0)


def test_nested_batched_blocks_on_one_model_keep_the_switch_on_until_the_last_exits():
    """The switch is reference-counted: an inner block on the same model (its own pack) runs batched and does
    not give the model its attention back while the outer block is still inside; the last exit does."""
    _, actor, *_ = ppo_models()
    g = torch.Generator().manual_seed(4)
    outer_lengths, inner_lengths = [7, 4], [5, 3, 6]
    vocab = actor.config.vocab_size
    outer_pack = pack_rows(torch.randint(3, vocab, (2, 7), generator=g), outer_lengths)
    inner_pack = pack_rows(torch.randint(3, vocab, (3, 6), generator=g), inner_lengths)
    with torch.no_grad():
        dense_outer, dense_inner = _logprobs(actor, outer_pack), _logprobs(actor, inner_pack)
        with batched_attention(actor, outer_lengths) as outer:
            with batched_attention(actor, inner_lengths) as inner:
                batched_inner = _logprobs(actor, inner_pack)
            assert actor.config._attn_implementation == ATTN_IMPL
            batched_outer = _logprobs(actor, outer_pack)
    assert actor.config._attn_implementation == "sdpa"
    assert outer.calls == inner.calls == actor.config.num_hidden_layers
    torch.testing.assert_close(batched_inner, dense_inner, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(batched_outer, dense_outer, rtol=1e-5, atol=1e-6)


def test_a_threads_batched_block_stays_batched_when_another_threads_block_on_the_model_exits_first():
    """Two threads' blocks on one model, entered A then B and left A first: B's forward, run after A left,
    still goes through the batched call over B's own pack (and equals the dense pack); the model gets its
    attention back only when B leaves."""
    _, actor, *_ = ppo_models()
    lengths = [6, 9, 3]
    pack = pack_rows(torch.randint(3, actor.config.vocab_size, (3, 9)), lengths)
    with torch.no_grad():
        dense = _logprobs(actor, pack)
    a_inside, b_inside, a_left = threading.Event(), threading.Event(), threading.Event()
    out, errors = {}, []

    def a():
        try:
            with batched_attention(actor, [4, 4]):
                a_inside.set()
                assert b_inside.wait(30)
        except BaseException as e:  # noqa: BLE001 - reported to the test's thread
            errors.append(e)
        finally:
            a_inside.set()
            a_left.set()

    def b():
        try:
            assert a_inside.wait(30)
            with batched_attention(actor, lengths) as layout:
                b_inside.set()
                assert a_left.wait(30)
                out["switched"] = actor.config._attn_implementation
                with torch.no_grad():
                    out["batched"] = _logprobs(actor, pack)
            out["calls"] = layout.calls
        except BaseException as e:  # noqa: BLE001 - reported to the test's thread
            errors.append(e)
        finally:
            b_inside.set()

    threads = [threading.Thread(target=f, daemon=True) for f in (a, b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors
    assert out["switched"] == ATTN_IMPL and out["calls"] == actor.config.num_hidden_layers
    torch.testing.assert_close(out["batched"], dense, rtol=1e-5, atol=1e-6)
    assert actor.config._attn_implementation == "sdpa"


@pytest.mark.parametrize("name", ROUTED)
def test_every_family_packs_batched_exactly_or_is_refused_by_name(name):
    """Every family the dense pack serves: the batched pack's log-probs are the dense pack's (rtol 1e-5 /
    atol 1e-6, fp32, eval mode: GPT-2 has dropout) and so are its gradients (to 1e-5 of each tensor's
    largest entry: these random weights are large, ``initializer_range=0.1``, and so are the sums the
    rounding runs over), or its probe refuses it naming the feature (a sliding window shorter than a pack's
    sequences, logit softcapping)."""
    actor = build_actor(name)
    probe = list(range(4, 12))
    try:
        check_packing(actor, "actor", probe, _logprobs)
    except ValueError:
        pytest.skip(f"{name}: the dense pack refuses it too")
    features = FAMILIES[name].features
    if {"window", "softcap"} & features:
        match = "softcapping" if "softcap" in features else "sliding attention window of 5 tokens"
        with pytest.raises(ValueError, match=f"pack_attention='batched' cannot run the actor: .*{match}"):
            check_batched_packing(actor, "actor", probe, _logprobs, 64)
        return
    check_batched_packing(actor, "actor", probe, _logprobs, 64)
    g = torch.Generator().manual_seed(2)
    lengths = [9, 4, 13, 1, 6]
    pack = pack_rows(torch.randint(4, actor.config.vocab_size, (5, 13), generator=g), lengths)
    weights = torch.randn(5, 12, generator=g)

    def run(batched: bool):
        actor.zero_grad()
        if batched:
            with batched_attention(actor, lengths):
                out = _logprobs(actor, pack)
        else:
            out = _logprobs(actor, pack)
        (out * weights).sum().backward()
        return out.detach(), {n: p.grad.clone() for n, p in actor.named_parameters() if p.grad is not None}

    (dense, dense_grads), (batched, batched_grads) = run(False), run(True)
    torch.testing.assert_close(batched, dense, rtol=1e-5, atol=1e-6)
    assert dense_grads.keys() == batched_grads.keys()
    for key in dense_grads:
        scale = float(dense_grads[key].abs().max())
        torch.testing.assert_close(batched_grads[key], dense_grads[key], rtol=0, atol=1e-5 * scale, msg=key)


def _leaky_batched_attention(module, query, key, value, attention_mask, **kwargs):
    """Served inside the switch, but causal over the whole row: packed sequences see each other."""
    bound().calls += 1
    return _leaky_attention(module, query, key, value, attention_mask, **kwargs)


def test_the_probe_catches_a_batched_attention_that_crosses_sequences(monkeypatch):
    _, actor, *_ = ppo_models()
    register()
    monkeypatch.setitem(AttentionInterface._global_mapping, ATTN_IMPL, _leaky_batched_attention)
    with pytest.raises(ValueError, match="differ from its own attention's .*cross the boundary"):
        check_batched_packing(actor, "actor", [5, 6, 7], _logprobs, 64)


def test_bad_pack_attention_settings_are_refused():
    with pytest.raises(ValueError, match="pack_attention must be one of"):
        PPOConfig(max_tokens_per_microbatch=64, pack_attention="flash")
    with pytest.raises(ValueError, match="pack_attention='batched' is the attention of packs"):
        PPOConfig(pack_attention="batched")
    # A model batched attention cannot stand in for: "batched" refuses it at build naming why, "auto" packs it
    # densely (the dense probe, as before, refuses the leak it has).
    AttentionInterface.register("leaky_sdpa", _leaky_attention)
    tokenizer, actor, critic, reference, reward, prompts = models = ppo_models()
    actor.set_attn_implementation("leaky_sdpa")
    with pytest.raises(ValueError, match="the actor: PeftModel|the actor: Qwen2ForCausalLM runs attention "):
        make_trainer(models, max_tokens_per_microbatch=64, pack_attention="batched")
    actor.set_attn_implementation("sdpa")
    critic.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="the critic: .*activation checkpointing"):
        make_trainer(models, max_tokens_per_microbatch=64, pack_attention="batched")
    trainer = make_trainer(models, max_tokens_per_microbatch=64)
    assert trainer._pack_attention_modes() == {"actor": True, "critic": False}
    # Checkpointing turned on after the build: "auto" packs the actor densely from then on.
    actor.gradient_checkpointing_enable()
    assert trainer._pack_attention_modes() == {"actor": False, "critic": False}
    trainer.close()


def test_a_sliding_window_is_batched_only_where_no_sequence_reaches_past_it():
    """A window of 16 tokens never binds on sequences of up to 16: batched, and the dense pack's log-probs;
    with packs of up to 64 tokens it would bind, so the probe refuses (though its own sequences are short)."""
    actor = build_actor("mistral_window", sliding_window=16)
    probe = list(range(4, 12))
    with pytest.raises(ValueError, match="sliding attention window of 16 tokens, .* can be \\(64\\)"):
        check_batched_packing(actor, "actor", probe, _logprobs, 64)
    check_batched_packing(actor, "actor", probe, _logprobs, 16)
    lengths = [16, 9, 14]
    pack = pack_rows(torch.randint(4, actor.config.vocab_size, (3, 16)), lengths)
    with torch.no_grad():
        dense = _logprobs(actor, pack)
        with batched_attention(actor, lengths):
            batched = _logprobs(actor, pack)
    torch.testing.assert_close(batched, dense, rtol=1e-5, atol=1e-6)
    # And a pack whose sequence reaches past the window is refused in the forward, never approximated.
    with (
        torch.no_grad(),
        pytest.raises(ValueError, match="window of 16 tokens, shorter than the pack's longest"),
    ):
        long = pack_rows(torch.randint(4, actor.config.vocab_size, (1, 17)), [17])
        with batched_attention(actor, [17]):
            _logprobs(actor, long)


def test_auto_batches_a_model_whose_dense_pack_leaks_and_refuses_its_dense_fallback():
    """OPT's dense pack leaks across sequences (the dense probe refuses it), but its batched pack is exact.
    "auto" used to refuse it at build, the dense probe first; now it batches it: losses and gradients equal
    the padded update's. A later switch to the dense mask (activation checkpointing turned on) is refused by
    name, never run."""
    tokenizer, actor, critic, reference, reward, prompts = ppo_models()
    cfg = FAMILIES["opt"].make_config(
        vocab_size=actor.config.vocab_size,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dropout=0.0,  # the update runs in train mode: masks drawn over other shapes would differ
        attention_dropout=0.0,
        activation_dropout=0.0,
        layerdrop=0.0,
    )
    runs = {}
    for budget in (None, 40):
        torch.manual_seed(0)
        opt = AutoModelForCausalLM.from_config(cfg)
        models = (tokenizer, opt, critic, copy.deepcopy(opt).eval().requires_grad_(False), reward, prompts)
        if budget:
            with pytest.raises(ValueError, match="crosses the boundary between packed sequences"):
                make_trainer(models, max_tokens_per_microbatch=budget, pack_attention="dense")
        trainer = make_trainer(models, max_tokens_per_microbatch=budget, epochs=2)
        grads = _record_steps(trainer)
        stats = trainer.step()
        assert trainer._pack_attention_modes() == {"actor": bool(budget), "critic": bool(budget)}
        if budget:
            assert "crosses the boundary" in trainer._dense_refusal["actor"]
            opt.gradient_checkpointing_enable()
            with pytest.raises(ValueError, match="the actor turned activation checkpointing on, so .*dense"):
                trainer._pack_attention_modes()
        trainer.close()
        runs[budget] = (stats, grads)
    (padded, padded_grads), (packed, packed_grads) = runs[None], runs[40]
    assert_same_update(packed, padded, packed_grads, padded_grads)
    assert packed_grads and all(any(k.startswith("actor.") for k in a) for a in packed_grads)
