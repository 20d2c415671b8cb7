"""ReTrace: buffer alignment, zero-init equivalence with DFlash, losslessness, checkpoints."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hypothesis import given, settings
from hypothesis import strategies as st

import retrace_jax as rj
from retrace_jax.models.retrace import MIXTURE_TOP_K, Memory, ReTraceFusion, shift_memory, stale_top_k
from tests.dflash_reference import RefDFlashDraftModel
from tests.helpers import with_random_retrace

BLOCK_SIZES = (2, 3, 4, 7, 8, 16)  # each compiles shift_memory once; a and s are values
jit_shift_memory = jax.jit(shift_memory)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(BLOCK_SIZES).flatmap(lambda k: st.tuples(st.just(k), st.integers(0, k - 1),
                                                                  st.integers(0, 1000))))
def test_buffer_entries_hold_the_same_absolute_position(case):
    """Encode each state with the absolute position it describes; after the shift, every valid slot
    of the next block holds states of exactly that slot's position."""
    k, a, s = case
    hd = (s + np.arange(k, dtype=np.float32))[None, :, None]  # hd[i] describes position s + i
    ht = (s + 1 + np.arange(k, dtype=np.float32))[None, :, None]  # ht[i] scores position s + i + 1
    mem = jit_shift_memory(hd, ht, np.asarray([a], np.int32))
    valid, mem_d, mem_t = (np.asarray(x)[0] for x in (mem.valid, mem.mem_d, mem.mem_t))
    next_start = s + a + 1
    for j in range(k):
        expect_valid = 1 <= j <= k - 2 - a
        assert bool(valid[j]) == expect_valid
        if expect_valid:
            assert float(mem_d[j, 0]) == next_start + j
            assert float(mem_t[j, 0]) == next_start + j


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(BLOCK_SIZES).flatmap(lambda k: st.tuples(
    st.just(k), st.integers(0, k - 1), st.lists(st.booleans(), min_size=k - 1, max_size=k - 1))))
def test_agreed_slots_keep_only_the_slots_whose_proposal_the_target_shared(case):
    """``slots="agreed"``: next-round slot ``j`` is kept where it would be anyway and the proposal it
    carries (block slot ``a+1+j``, proposal index ``a+j``) equalled the target's token there."""
    k, a, agreed = case
    hd = np.arange(k, dtype=np.float32)[None, :, None]
    every = np.asarray(jit_shift_memory(hd, hd, np.asarray([a], np.int32)).valid)[0]
    some = np.asarray(jit_shift_memory(hd, hd, np.asarray([a], np.int32), np.asarray([agreed])).valid)[0]
    for j in range(k):
        assert bool(some[j]) == (bool(every[j]) and agreed[a + j]), (j, a)


def _fusion(signals="both", rank=None, gate=True, seed=0):
    f = ReTraceFusion(rj.ReTraceConfig(signals=signals, rank=rank, gate=gate), 8, 8, rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(f)
    keys = iter(jax.random.split(jax.random.PRNGKey(seed), 16))
    state = jax.tree.map(lambda x: jax.random.normal(next(keys), x.shape), state)  # W_v non-zero
    return nnx.merge(graphdef, state)


@pytest.mark.parametrize("signals,rank,gate", [("both", None, True), ("drafter", 3, True), ("target", None, False)])
def test_invalid_entries_have_no_effect(signals, rank, gate):
    fusion = _fusion(signals, rank, gate)
    rng = np.random.RandomState(0)
    emb = jnp.asarray(rng.randn(2, 5, 8), jnp.float32)
    valid = jnp.asarray([[0, 1, 1, 0, 0], [0, 0, 0, 0, 0]], bool)
    mem = Memory(jnp.asarray(rng.randn(2, 5, 8), jnp.float32), jnp.asarray(rng.randn(2, 5, 8), jnp.float32), valid)
    garbage = Memory(jnp.where(valid[..., None], mem.mem_d, 1e3), jnp.where(valid[..., None], mem.mem_t, -1e3), valid)
    out, out_garbage = fusion(emb, mem), fusion(emb, garbage)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(out_garbage))
    np.testing.assert_array_equal(np.asarray(out)[~np.asarray(valid)], np.asarray(emb)[~np.asarray(valid)])
    assert not np.allclose(np.asarray(out)[np.asarray(valid)], np.asarray(emb)[np.asarray(valid)])


def test_fusion_formula():
    fusion = _fusion()
    rng = np.random.RandomState(1)
    e, md, mt = (rng.randn(1, 3, 8).astype(np.float32) for _ in range(3))
    valid = np.array([[False, True, True]])
    out = np.asarray(fusion(jnp.asarray(e), Memory(jnp.asarray(md), jnp.asarray(mt), jnp.asarray(valid)), beta=0.5))
    wc, wv, wg = (np.asarray(getattr(fusion, n).full.kernel[...]) for n in ("correct", "value", "gate"))
    r = md + 0.5 * np.concatenate([md, mt], -1) @ wc
    gate = 1 / (1 + np.exp(-(np.concatenate([e, r], -1) @ wg)))
    want = e + valid[..., None] * (r @ wv) * gate
    np.testing.assert_allclose(out, want, atol=1e-5)


@pytest.fixture(scope="module")
def dflash_dir(trained_drafter, tmp_path_factory):
    path = str(tmp_path_factory.mktemp("dflash"))
    rj.save_drafter(trained_drafter[0], path)
    return path


def test_zero_initialised_retrace_is_exactly_dflash(qwen3, trained_drafter, dflash_dir):
    dflash, prompts = trained_drafter
    retrace = rj.load_drafter(dflash_dir, qwen3, retrace=True)
    assert retrace.cfg.retrace == rj.ReTraceConfig()
    assert not np.any(np.asarray(retrace.retrace.value.full.kernel[...]))
    assert np.any(np.asarray(retrace.retrace.correct.full.kernel[...]))
    a = rj.generate(qwen3, prompts[:6], 32, drafter=dflash)
    b = rj.generate(qwen3, prompts[:6], 32, drafter=retrace)
    assert a == b


def test_zero_initialised_token_hints_are_exactly_dflash(qwen3, trained_drafter, dflash_dir):
    """``hints="tokens"`` adds W_h at zero: a new module drafts exactly as DFlash, though every other
    ReTrace weight is random (W_v included) and the hints themselves are not zero."""
    dflash, prompts = trained_drafter
    drafter = with_random_retrace(rj.load_drafter(dflash_dir, qwen3, retrace=rj.ReTraceConfig(hints="tokens")))
    graphdef, state = nnx.split(drafter)
    flat = dict(nnx.to_flat_state(state))
    for path, var in flat.items():
        if path[:2] == ("retrace", "value") or path[:2] == ("retrace", "hint"):
            var.set_value(jnp.zeros_like(var.get_value()))
    drafter = nnx.merge(graphdef, nnx.from_flat_state(flat))
    assert np.any(np.asarray(drafter.retrace.hint_gate.full.kernel[...]))
    assert rj.generate(qwen3, prompts[:6], 32, drafter=drafter) == rj.generate(qwen3, prompts[:6], 32, drafter=dflash)


def test_a_zero_scale_start_is_exactly_dflash_and_its_gradient_reaches_the_correction(qwen3, trained_drafter,
                                                                                     dflash_dir):
    """``zero_start="scale"``: W_v starts random, a scalar on the residual at zero, so a new module drafts
    exactly as DFlash; the scale's gradient is not zero at the start (the paper's zero W_v gives W_c a zero
    gradient instead)."""
    dflash, prompts = trained_drafter
    drafter = rj.load_drafter(dflash_dir, qwen3, retrace=rj.ReTraceConfig(zero_start="scale"))
    assert np.any(np.asarray(drafter.retrace.value.full.kernel[...]))
    assert not np.any(np.asarray(drafter.retrace.scale[...]))
    assert rj.generate(qwen3, prompts[:6], 32, drafter=drafter) == rj.generate(qwen3, prompts[:6], 32, drafter=dflash)
    rng = np.random.RandomState(0)
    d = drafter.cfg.hidden_size
    memory = Memory(jnp.asarray(rng.randn(2, 4, d), jnp.float32), jnp.asarray(rng.randn(2, 4, d), jnp.float32),
                    jnp.asarray([[False, True, True, False]] * 2))
    emb = jnp.asarray(rng.randn(2, 4, d), jnp.float32)
    target = jnp.asarray(rng.randn(2, 4, d), jnp.float32)
    fusion = drafter.retrace
    graphdef, state = nnx.split(fusion)
    grads = jax.grad(lambda st: jnp.sum(nnx.merge(graphdef, st)(emb, memory) * target))(state)
    flat = {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(grads)}
    assert np.any(flat[("scale",)])


def test_the_output_mixture_starts_closed_and_its_gate_learns(qwen3, trained_drafter, dflash_dir):
    """``mixture="target"``: a new module (scale 0) drafts exactly as DFlash; in training the scale's
    gradient is finite and not zero at the start, also where the drafter's probabilities underflow; an
    open gate moves q toward the stale target tokens (q stays a distribution)."""
    dflash, prompts = trained_drafter
    drafter = rj.load_drafter(dflash_dir, qwen3, retrace=rj.ReTraceConfig(mixture="target"))
    assert not np.any(np.asarray(drafter.retrace.mix_scale[...]))
    assert rj.generate(qwen3, prompts[:6], 32, drafter=drafter) == rj.generate(qwen3, prompts[:6], 32, drafter=dflash)
    rng = np.random.RandomState(0)
    b, w, d, v = 2, 4, drafter.cfg.hidden_size, 16
    ids = jnp.asarray(rng.randint(-1, v, (b, w, 8)), jnp.int32)
    p = jnp.where(ids >= 0, jnp.asarray(rng.rand(b, w, 8), jnp.float32), 0.0)
    memory = Memory(jnp.zeros((b, w, d)), jnp.zeros((b, w, d)), jnp.asarray([[False, True, True, True]] * b),
                    mix_ids=ids, mix_p=p / p.sum(-1, keepdims=True))
    logits = jnp.asarray(rng.randn(b, w - 1, v) * 40.0, jnp.float32)  # some probabilities underflow to 0
    hidden = jnp.asarray(rng.randn(b, w - 1, d), jnp.float32)
    labels = jnp.asarray(rng.randint(0, v, (b, w - 1)))
    graphdef, state = nnx.split(drafter.retrace)

    def loss(st):
        q = nnx.merge(graphdef, st).mix(logits, hidden, memory)
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(q, -1), labels[..., None], -1))

    grads = {p_: np.asarray(x.get_value()) for p_, x in nnx.to_flat_state(jax.grad(loss)(state))}
    assert all(np.isfinite(g).all() for g in grads.values()) and np.any(grads[("mix_scale",)])
    drafter.retrace.mix_scale[...] = jnp.ones((1,))
    q = np.exp(np.asarray(drafter.retrace.mix(logits, hidden, memory), np.float64))
    np.testing.assert_allclose(q.sum(-1), 1.0, rtol=1e-4)
    top = np.asarray(ids)[:, 1:][np.asarray(p)[:, 1:] > 0]
    base = np.exp(np.asarray(jax.nn.log_softmax(logits), np.float64))
    stale_mass = lambda dist: sum(dist[i, j][np.asarray(ids)[i, j + 1][np.asarray(p)[i, j + 1] > 0]].sum()  # noqa
                                  for i in range(b) for j in range(w - 1))
    assert len(top) and stale_mass(q) > stale_mass(base)


def test_stale_top_k_is_the_targets_top_tokens_renormalised_inside_the_draft_vocabulary():
    """Against the definition in float64: the full softmax, its top ``MIXTURE_TOP_K`` tokens, those outside
    the draft vocabulary dropped, the rest renormalised; a slot with none inside gets all zeros."""
    rng = np.random.default_rng(0)
    v = 3000  # the two-level top-k on CPU (more than MIXTURE_TOP_K blocks of 128)
    logits = rng.normal(size=(2, 5, v)).astype(np.float32) * 4
    logits[1, 2, :] = -30.0
    logits[1, 2, 1500:1500 + MIXTURE_TOP_K] = 30.0  # its top tokens, all outside
    inside_v = (np.arange(v) % 3 != 0) & ((np.arange(v) < 1500) | (np.arange(v) >= 1500 + MIXTURE_TOP_K))
    to_index = lambda ids: jnp.where(jnp.asarray(inside_v)[ids], ids // 2, -1)  # noqa: E731
    ids, p = jax.jit(lambda x: stale_top_k(x, to_index))(jnp.asarray(logits))
    probs = np.exp(logits - logits.max(-1, keepdims=True), dtype=np.float64)
    probs /= probs.sum(-1, keepdims=True)
    top = np.argsort(-logits, -1, kind="stable")[..., :MIXTURE_TOP_K]
    kept = np.where(inside_v[top], np.take_along_axis(probs, top, -1), 0.0)
    expected = kept / np.maximum(kept.sum(-1, keepdims=True), 1e-300)
    np.testing.assert_array_equal(np.asarray(ids), np.where(inside_v[top], top // 2, -1))
    np.testing.assert_allclose(np.asarray(p), expected, rtol=1e-5, atol=1e-7)
    assert not np.asarray(p)[1, 2].any() and np.isfinite(np.asarray(p)).all()


@pytest.mark.parametrize("cfg", [rj.ReTraceConfig(), rj.ReTraceConfig(hints="tokens"),
                                 rj.ReTraceConfig(mixture="target")])
def test_random_retrace_weights_stay_lossless_and_change_the_traces(qwen3, trained_drafter, dflash_dir, cfg):
    dflash, prompts = trained_drafter
    retrace = with_random_retrace(rj.load_drafter(dflash_dir, qwen3, retrace=cfg))
    if cfg.mixture == "target":
        retrace.retrace.mix_scale[...] = jnp.full((1,), 0.6)  # open (a random scale may be negative: closed)
    plain = rj.generate(qwen3, prompts[:8], 32)
    dfl = rj.generate(qwen3, prompts[:8], 32, drafter=dflash)
    ret = rj.generate(qwen3, prompts[:8], 32, drafter=retrace)
    assert ret.tokens == plain.tokens == dfl.tokens
    assert ret.acceptance_lengths != dfl.acceptance_lengths  # the memory reaches the drafter
    off = rj.generate(qwen3, prompts[:8], 32, drafter=retrace, use_retrace=False)
    assert off == dfl  # memory switched off: exactly the DFlash drafter


def test_batched_retrace_rows_equal_rows_alone(qwen3, dflash_dir, trained_drafter):
    _, prompts = trained_drafter
    retrace = with_random_retrace(rj.load_drafter(dflash_dir, qwen3, retrace=True), seed=1, scale=0.1)
    batched = rj.generate(qwen3, prompts[:5], 30, drafter=retrace)
    assert len({tuple(a) for a in batched.acceptance_lengths}) > 1  # rows accept differently
    for i, p in enumerate(prompts[:5]):
        alone = rj.generate(qwen3, [p], 30, drafter=retrace)
        assert (alone.tokens[0], alone.acceptance_lengths[0]) == (batched.tokens[i], batched.acceptance_lengths[i])


@pytest.mark.parametrize("cfg", [rj.ReTraceConfig(), rj.ReTraceConfig(signals="drafter", rank=4, gate=False, slots="agreed"),
                                 rj.ReTraceConfig(fusion="keys"), rj.ReTraceConfig(hints="tokens"),
                                 rj.ReTraceConfig(rank=4, hints="tokens"), rj.ReTraceConfig(zero_start="scale"),
                                 rj.ReTraceConfig(mixture="target")])
def test_retrace_checkpoint_round_trip(qwen3, dflash_dir, tmp_path, cfg):
    base = rj.load_drafter(dflash_dir, qwen3)
    import dataclasses
    drafter = rj.DFlashDrafter(dataclasses.replace(base.cfg, retrace=cfg), rngs=nnx.Rngs(0))
    drafter = with_random_retrace(drafter, seed=2)
    rj.save_drafter(drafter, str(tmp_path))
    with open(tmp_path / "config.json") as f:
        hints = {} if cfg.hints == "none" else {"hints": cfg.hints}  # written only when used, as zero_start
        hints.update({} if cfg.zero_start == "value" else {"zero_start": cfg.zero_start})
        hints.update({} if cfg.mixture == "none" else {"mixture": cfg.mixture})
        assert json.load(f)["retrace_config"] == {"enabled": True, "signals": cfg.signals, "rank": cfg.rank,
                                                  "gate": cfg.gate, "slots": cfg.slots, "fusion": cfg.fusion,
                                                  **hints}
    loaded = rj.load_drafter(str(tmp_path), qwen3)
    assert loaded.cfg == drafter.cfg
    for (p, a), (_, b) in zip(nnx.to_flat_state(nnx.state(drafter)), nnx.to_flat_state(nnx.state(loaded))):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(p))
    # Loaded as plain DFlash, the extra tensors are ignored.
    assert rj.load_drafter(str(tmp_path), qwen3, retrace=False).cfg.retrace is None


def test_a_checkpoint_without_slots_keeps_the_design_it_was_trained_with(qwen3, dflash_dir, tmp_path):
    """``retrace_config`` written before ``slots`` existed loads as ``slots="all"``; an unknown value is
    refused with the field's name."""
    import dataclasses
    import shutil

    base = rj.load_drafter(dflash_dir, qwen3)
    rj.save_drafter(rj.DFlashDrafter(dataclasses.replace(base.cfg, retrace=rj.ReTraceConfig()), rngs=nnx.Rngs(0)),
                    str(tmp_path / "d"))
    for value, expect in ((None, "all"), ("agreed", "agreed"), ("some", None)):
        shutil.copytree(tmp_path / "d", tmp_path / str(value), symlinks=False)
        path = tmp_path / str(value) / "config.json"
        hf = json.loads(path.read_text())
        hf["retrace_config"].pop("slots")
        hf["retrace_config"].pop("fusion")  # neither key existed then
        if value is not None:
            hf["retrace_config"]["slots"] = value
        path.write_text(json.dumps(hf))
        if expect is None:
            with pytest.raises(rj.ConfigError, match=r"retrace_config\.slots: must be 'all' or 'agreed', got 'some'"):
                rj.load_drafter(str(tmp_path / str(value)), qwen3)
        else:
            loaded = rj.load_drafter(str(tmp_path / str(value)), qwen3).cfg.retrace
            assert (loaded.slots, loaded.fusion) == (expect, "embedding")


def test_the_keys_fusion_attends_to_valid_memory_slots_only(qwen3, trained_drafter):
    """``fusion="keys"``: the memory's target features are extra keys of the block. Invalid slots change
    nothing (whatever they hold), a memory with no valid slot drafts exactly as DFlash, and valid slots
    change the drafter's states; a keys drafter has no parameters of its own, and takes no rank."""
    import dataclasses

    dflash, _ = trained_drafter
    drafter = rj.DFlashDrafter(dataclasses.replace(dflash.cfg, retrace=rj.ReTraceConfig(fusion="keys")),
                               rngs=nnx.Rngs(0))
    nnx.update(drafter, nnx.state(dflash))
    assert not hasattr(drafter, "retrace")
    k, f = drafter.cfg.block_size, drafter.cfg.num_features * qwen3.cfg.hidden_size
    rng = np.random.RandomState(4)
    feats = jnp.asarray(rng.randn(2, 20, f).astype(np.float32))
    cache = drafter.extend_cache(feats, drafter.init_cache(2, 64)).replace(lengths=jnp.asarray([9, 20], jnp.int32))
    emb = qwen3.embed(jnp.full((2, k), drafter.cfg.mask_token_id, jnp.int32))
    valid = jnp.asarray(np.arange(k)[None, :] % 2 == 1).repeat(2, 0).at[1].set(False)  # row 1: nothing valid
    mem = Memory(jnp.zeros((2, k, drafter.cfg.hidden_size)), jnp.asarray(rng.randn(2, k, f).astype(np.float32)), valid)
    garbage = mem.replace(mem_t=jnp.where(valid[..., None], mem.mem_t, 1e3))
    plain = np.asarray(drafter.draft(emb, cache))
    for attention in ("chunked", "dense"):
        out = np.asarray(drafter.draft(emb, cache, mem, attention=attention))
        np.testing.assert_allclose(out, np.asarray(drafter.draft(emb, cache, garbage, attention=attention)), atol=1e-5)
        np.testing.assert_allclose(out[1], plain[1], atol=1e-5)  # no valid slot: DFlash
        assert np.abs(out[0] - plain[0]).max() > 1e-3  # valid slots are attended to
    with pytest.raises(rj.ConfigError, match="fusion 'keys'"):
        rj.ReTraceConfig(fusion="keys", rank=4)


def test_reference_pytorch_loads_the_dflash_part(qwen3, dflash_dir, tmp_path):
    retrace = with_random_retrace(rj.load_drafter(dflash_dir, qwen3, retrace=True))
    rj.save_drafter(retrace, str(tmp_path))
    _, info = RefDFlashDraftModel.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not info["missing_keys"]
    assert sorted(info["unexpected_keys"]) == ["retrace.correct.weight", "retrace.gate.weight", "retrace.value.weight"]
