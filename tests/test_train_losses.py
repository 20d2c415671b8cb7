"""Training objectives against direct loop-based references: DFlash blocks and the ReTrace rollout
(which must see exactly what two inference rounds see)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import retrace_jax as rj
from retrace_jax.dflash_loss import build_blocks, sample_anchors
from retrace_jax.retrace import shift_memory
from retrace_jax.retrace_loss import retrace_rollout
from retrace_jax.speculative_loop import draft_block
from retrace_jax.target import prefill
from tests.helpers import with_random_retrace


def test_blocks_match_a_loop_reference():
    rng = np.random.RandomState(0)
    b, s, k, a, mask_id, gamma = 2, 20, 4, 5, 99, 3.0
    tokens = rng.randint(0, 50, (b, s)).astype(np.int32)
    loss_mask = (rng.rand(b, s) > 0.3).astype(np.int32)
    anchors, valid = sample_anchors(jax.random.PRNGKey(1), jnp.asarray(loss_mask), a, k)
    anchors, valid = np.asarray(anchors), np.asarray(valid)
    got = build_blocks(jnp.asarray(tokens), jnp.asarray(loss_mask), jnp.asarray(anchors), jnp.asarray(valid), k,
                       mask_id, gamma)
    got = jax.tree.map(np.asarray, got)
    for r in range(b):
        cands = [p for p in range(s) if loss_mask[r, p] and p <= s - k]
        assert sorted(anchors[r][valid[r]].tolist()) == anchors[r][valid[r]].tolist()
        assert set(anchors[r][valid[r]].tolist()) <= set(cands)
        assert valid[r].sum() == min(a, len(cands))
        for i in range(a):
            anc = anchors[r, i]
            for j in range(k):
                q = i * k + j
                pos = anc + j
                assert got.tokens_bak[r, i, j] == (tokens[r, anc] if j == 0 else mask_id)
                assert got.positions_bak[r, i, j] == pos
                label_ok = pos < s and valid[r, i] and j >= 1 and loss_mask[r, min(pos, s - 1)]
                want_w = np.exp(-(j - 1) / gamma) if label_ok else 0.0
                np.testing.assert_allclose(float(got.weights_bak[r, i, j]), want_w, rtol=1e-6)
                if label_ok:
                    assert got.labels_bak[r, i, j] == tokens[r, pos]
                for key in range(s):  # context strictly before the anchor
                    assert bool(got.mask_bt_st[r, q, key]) == (key < anc)
                for i2 in range(a):  # its own block, both ways; never another block
                    for j2 in range(k):
                        assert bool(got.mask_bt_st[r, q, s + i2 * k + j2]) == (i2 == i)


@pytest.fixture(scope="module")
def qwen3(hf_model_dir):
    return rj.load_target(hf_model_dir("qwen3")[1])


def inference_rounds(target, drafter, seq):
    """Two inference rounds at a given anchor, as ``rj.generate`` runs them, each jitted once for every
    anchor and both correction sources (the anchor ``s`` is a value: the whole sequence is prefilled and
    the caches' lengths cut to ``s``; entries past a row's length are never read)."""
    tdef, tstate = nnx.split(target)
    ddef, dstate = nnx.split(drafter)
    k, layer_ids = drafter.cfg.block_size, drafter.cfg.target_layer_ids
    s_len = seq.shape[1]
    seq = jnp.asarray(seq)

    @jax.jit
    def round1(tstate, dstate, s):
        """Round 1 at anchor ``s``: the drafter's states, its proposals, the target's choices, the target
        states of the verify pass and of the teacher-forced sequence, the verified features, the cache."""
        target, drafter = nnx.merge(tdef, tstate), nnx.merge(ddef, dstate)
        _, tcache, feats = prefill(target, seq, s[None], target.init_cache(1, s_len + k), feature_layers=layer_ids)
        dcache = drafter.extend_cache(feats, drafter.init_cache(1, s_len + k)).replace(lengths=s[None])
        anchor = jax.lax.dynamic_slice(seq, (0, s), (1, 1))[:, 0]
        hd = draft_block(target, drafter, anchor, dcache, k)
        proposals = jnp.argmax(target.logits(hd[:, 1:]), -1).astype(jnp.int32)
        out = target(jnp.concatenate([anchor[:, None], proposals], 1), tcache, feature_layers=layer_ids)
        choice = jnp.argmax(target.logits(out.hidden), -1)[0]
        teacher = target(jax.lax.dynamic_slice(seq, (0, s), (1, k)), tcache).hidden
        return hd, proposals[0], choice, {"verify": out.hidden, "teacher": teacher}, out.features, dcache

    @jax.jit
    def round2(tstate, dstate, hd, ht, a, features, dcache, s2, token):
        """Round 2 at ``s2 = s + a + 1``: the memory and the drafter's states."""
        target, drafter = nnx.merge(tdef, tstate), nnx.merge(ddef, dstate)
        memory = shift_memory(hd, ht, a[None])
        dcache2 = drafter.extend_cache(features, dcache).replace(lengths=s2[None])
        return memory, draft_block(target, drafter, token[None], dcache2, k, memory)

    return (lambda s: round1(tstate, dstate, jnp.int32(s)),
            lambda *args: round2(tstate, dstate, *args))


@pytest.fixture(scope="module")
def rollout_case(qwen3, trained_drafter):
    """A ReTrace drafter with random memory weights, a sequence of the target's own greedy text, anchors,
    and the jitted inference rounds."""
    dflash, prompts = trained_drafter
    cfg = dataclasses.replace(dflash.cfg, retrace=rj.ReTraceConfig())
    graphdef, state = nnx.split(rj.DFlashDrafter(cfg, rngs=nnx.Rngs(0)))
    flat = dict(nnx.to_flat_state(state))
    for path, var in nnx.to_flat_state(nnx.state(dflash)):
        flat[path].set_value(var.get_value())
    drafter = with_random_retrace(nnx.merge(graphdef, nnx.from_flat_state(flat)), seed=3, scale=0.2)
    prompt = prompts[0]
    response = rj.generate(qwen3, [prompt], 40).tokens[0]  # the target's own greedy text
    seq = np.asarray(prompt + response, np.int32)[None]
    anchors = np.arange(len(prompt), seq.shape[1] - 2 * cfg.block_size, 3, dtype=np.int32)[None]
    loss_mask = np.r_[np.zeros(len(prompt)), np.ones(len(response))].astype(np.int32)[None]
    return drafter, seq, anchors, loss_mask, inference_rounds(qwen3, drafter, seq)


@pytest.mark.parametrize("source", ["verify", "teacher"])
def test_rollout_equals_two_inference_rounds(qwen3, rollout_case, source):
    drafter, seq, anchors, loss_mask, (round1, round2) = rollout_case
    k = drafter.cfg.block_size
    (ddef, dstate), (tdef, tstate) = nnx.split(drafter), nnx.split(qwen3)
    rollout = jax.jit(lambda dstate, tstate, *arrays: retrace_rollout(
        nnx.merge(ddef, dstate), nnx.merge(tdef, tstate), *arrays, 1.0, correction_source=source))
    roll = rollout(dstate, tstate, seq, loss_mask, anchors, np.ones(anchors.shape, bool))
    seen_a = set()
    for i, s in enumerate(anchors[0].tolist()):
        # Inference round 1 at anchor s.
        hd, proposals, choice, ht, features, dcache = round1(s)
        proposals, choice = np.asarray(proposals), np.asarray(choice)
        a = 0
        while a < k - 1 and proposals[a] == choice[a]:
            a += 1
        assert a == int(roll.accepted_ba[0, i])
        seen_a.add(a)
        # Inference round 2 at s' = s + a + 1, its cache extended by the verified positions.
        s2 = s + a + 1
        assert choice[a] == seq[0, s2]
        memory, hd2 = round2(hd, ht[source], jnp.int32(a), features, dcache, jnp.int32(s2), jnp.int32(choice[a]))
        sl = slice(i * k, (i + 1) * k)
        np.testing.assert_array_equal(np.asarray(roll.memory.valid[0, sl]), np.asarray(memory.valid[0]))
        v = np.asarray(memory.valid[0])
        np.testing.assert_allclose(np.asarray(roll.memory.mem_d[0, sl])[v], np.asarray(memory.mem_d[0])[v], atol=2e-5)
        np.testing.assert_allclose(np.asarray(roll.memory.mem_t[0, sl])[v], np.asarray(memory.mem_t[0])[v], atol=2e-5)
        np.testing.assert_allclose(np.asarray(roll.hidden2_btd[0, sl]), np.asarray(hd2[0]), atol=5e-5)
    assert len(seen_a) > 1  # several acceptance counts were exercised


def test_bf16_compute_remat_and_accumulation(qwen3):
    from retrace_jax.train_step import StepOptions, adamw, init_opt_state, make_train_step

    rng = np.random.RandomState(0)
    tokens = jnp.asarray(rng.randint(0, 127, (4, 32)), jnp.int32)
    mask = jnp.asarray(np.r_[np.zeros(6), np.ones(26)][None].repeat(4, 0), jnp.int32)
    opts = StepOptions(objective="retrace", compute_dtype="bfloat16", remat=True, num_anchors=3, grad_accum=2)
    drafter = rj.init_drafter(qwen3.cfg, mask_token_id=127, num_layers=1, block_size=4, retrace=rj.ReTraceConfig())
    optimizer = adamw(1e-2, 8, grad_accum=2)
    (tdef, ts), (ddef, ds) = nnx.split(qwen3), nnx.split(drafter)
    ds = jax.tree.map(jnp.copy, ds)
    step = make_train_step(tdef, ddef, optimizer, opts)
    opt_state = init_opt_state(optimizer, ds)
    snapshots = [jax.tree.map(np.asarray, ds)]
    for i in range(6):
        ds, opt_state, metrics = step(ts, ds, opt_state, tokens, mask, jnp.int32(i), jnp.uint32(0))
        assert np.isfinite(float(metrics["loss"]))
        snapshots.append(jax.tree.map(np.asarray, ds))
    assert all(x.dtype == np.float32 for x in jax.tree.leaves(snapshots[-1]))  # float32 master weights
    changed = [any(not np.array_equal(a, b) for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(q)))
               for p, q in zip(snapshots, snapshots[1:])]
    # One update per two accumulated micro-steps; the first update has learning rate 0 (warm-up starts at 0).
    assert changed == [False, False, False, True, False, True]


def test_retained_states_are_detached_and_can_be_stored_in_float16(qwen3):
    rng = np.random.RandomState(1)
    tokens = jnp.asarray(rng.randint(0, 127, (2, 24)), jnp.int32)
    mask = jnp.asarray(np.r_[np.zeros(4), np.ones(20)][None].repeat(2, 0), jnp.int32)
    drafter = rj.init_drafter(qwen3.cfg, mask_token_id=127, num_layers=1, block_size=4, retrace=rj.ReTraceConfig())
    anchors = jnp.asarray([[4, 9, 14], [5, 10, 15]], jnp.int32)
    valid = jnp.ones(anchors.shape, bool)
    graphdef, state = nnx.split(drafter)

    @functools.partial(jax.jit, static_argnames="dtype")
    def memory(st, dtype=None):
        return retrace_rollout(nnx.merge(graphdef, st), qwen3, tokens, mask, anchors, valid, 1.0,
                               memory_dtype=dtype).memory

    full, half = memory(state), memory(state, "float16")
    for a, b in ((full.mem_d, half.mem_d), (full.mem_t, half.mem_t)):
        assert b.dtype == a.dtype  # stored rounded, used in the compute dtype
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a.astype(jnp.float16).astype(a.dtype)))
        assert not np.array_equal(np.asarray(a), np.asarray(b))
    # Detached: nothing flows back into the drafter through the memory.
    grads = jax.jit(jax.grad(lambda st: jnp.sum(memory(st).mem_d) + jnp.sum(memory(st).mem_t)))(state)
    assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(grads))
