"""Training objectives against direct loop-based references: DFlash blocks and the ReTrace rollout
(which must see exactly what K inference rounds see)."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import retrace_jax as rj
from retrace_jax.decoding.generation import _pad_stops
from retrace_jax.decoding.sampling import SamplingParams
from retrace_jax.decoding.speculative import SpeculativeStepper, draft_block
from retrace_jax.decoding.verify import accepted_count
from retrace_jax.models.retrace import shift_memory, stale_top_k, token_hints
from retrace_jax.training.dflash_loss import (
    block_loss,
    build_blocks,
    default_gamma,
    draft_blocks,
    sample_anchors,
    sequence_context,
)
from retrace_jax.training.retrace_loss import retrace_loss, retrace_rollout, verify_blocks
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
                assert got.tokens_baw[r, i, j] == (tokens[r, anc] if j == 0 else mask_id)
                assert got.positions_baw[r, i, j] == pos
                label_ok = pos < s and valid[r, i] and j >= 1 and loss_mask[r, min(pos, s - 1)]
                want_w = np.exp(-(j - 1) / gamma) if label_ok else 0.0
                np.testing.assert_allclose(float(got.weights_baw[r, i, j]), want_w, rtol=1e-6)
                if label_ok:
                    assert got.labels_baw[r, i, j] == tokens[r, pos]
                for key in range(s):  # context strictly before the anchor
                    assert bool(got.mask_bt_st[r, q, key]) == (key < anc)
                for i2 in range(a):  # its own block, both ways; never another block
                    for j2 in range(k):
                        assert bool(got.mask_bt_st[r, q, s + i2 * k + j2]) == (i2 == i)


def two_round_reference(drafter, target, tokens_bs, loss_mask_bs, anchors_ba, valid_ba, beta, correction_source):
    """The two-round rollout as the library computed it before K rounds (round 1 without memory, round 2
    with round 1's rejected suffix), kept here to check that ``rounds=2`` still computes exactly that."""
    k, mask_id, layer_ids = drafter.cfg.block_size, drafter.cfg.mask_token_id, drafter.cfg.target_layer_ids
    gamma = default_gamma(k)
    b, s = tokens_bs.shape
    n = anchors_ba.shape[1]
    seq = jax.lax.stop_gradient(target(tokens_bs, target.init_cache(b, s), feature_layers=layer_ids))
    ctx_kv = sequence_context(drafter, seq.features)
    blocks1 = build_blocks(tokens_bs, loss_mask_bs, anchors_ba, valid_ba, k, mask_id, gamma)
    hidden1 = draft_blocks(drafter, target, ctx_kv, blocks1)
    logits1 = target.logits(hidden1)
    proposals = jnp.argmax(logits1[:, :, 1:], -1).astype(jnp.int32)
    truth = jnp.where(blocks1.weights_baw[:, :, 1:] > 0, blocks1.labels_baw[:, :, 1:], -1)
    accepted = accepted_count(proposals.reshape(-1, k - 1), truth.reshape(-1, k - 1)).reshape(b, n)
    if correction_source == "verify":
        drafted = jnp.concatenate([blocks1.labels_baw[:, :, :1], proposals], axis=-1)
        states = verify_blocks(target, seq.cache, drafted, anchors_ba)
    else:
        idx = jnp.minimum(blocks1.positions_baw, s - 1).reshape(b, -1)
        states = jnp.take_along_axis(seq.hidden, idx[..., None], axis=1).reshape(b, n, k, -1)
    memory = shift_memory(hidden1.reshape(b * n, k, -1), states.reshape(b * n, k, -1), accepted.reshape(-1))
    memory = jax.tree.map(lambda x: x.reshape((b, n * k) + x.shape[2:]), memory)
    anchors2 = anchors_ba + accepted + 1
    valid2 = valid_ba & (anchors2 < s)
    anchors2 = jnp.minimum(anchors2, s - 1)
    blocks2 = build_blocks(tokens_bs, loss_mask_bs, anchors2, valid2, k, mask_id, gamma)
    memory = memory.replace(valid=memory.valid & jnp.repeat(valid2, k, axis=1))
    hidden2 = draft_blocks(drafter, target, ctx_kv, blocks2, memory, beta)
    return (block_loss(logits1, blocks1), block_loss(target.logits(hidden2), blocks2), accepted, memory,
            hidden2.reshape(b, n * k, -1), anchors2, valid2)


@pytest.fixture(scope="module")
def rollout_case(qwen3, trained_drafter):
    """A ReTrace drafter with random memory weights, a sequence of the target's own greedy text, its
    loss mask, anchors (the last ones so near the end that later rounds run past the sequence), a
    stepper that runs real inference rounds, and ``observe(carry)``: the drafter's states of the round
    about to run and the teacher-forced target states of its block."""
    return _rollout_case(qwen3, trained_drafter, rj.ReTraceConfig())


@pytest.fixture(scope="module")
def rollout_case_agreed(qwen3, trained_drafter):
    """The same with ``slots="agreed"``: the memory keeps only slots whose proposal the target shared."""
    return _rollout_case(qwen3, trained_drafter, rj.ReTraceConfig(slots="agreed"))


@pytest.fixture(scope="module")
def rollout_case_keys(qwen3, trained_drafter):
    """The same with ``fusion="keys"``: the memory holds the target's features, which the next round
    attends to as extra keys (no fusion module)."""
    return _rollout_case(qwen3, trained_drafter, rj.ReTraceConfig(fusion="keys"))


@pytest.fixture(scope="module")
def rollout_case_hints(qwen3, trained_drafter):
    """The same with ``hints="tokens"``: the memory also carries the embedded target token and rejected
    proposal of each slot."""
    return _rollout_case(qwen3, trained_drafter, rj.ReTraceConfig(hints="tokens"))


@pytest.fixture(scope="module")
def rollout_case_mixture(qwen3, trained_drafter):
    """The same with ``mixture="target"``: the proposals mix in the target's stale top-K distribution."""
    return _rollout_case(qwen3, trained_drafter, rj.ReTraceConfig(mixture="target"))


def _rollout_case(qwen3, trained_drafter, retrace: rj.ReTraceConfig):
    dflash, prompts = trained_drafter
    cfg = dataclasses.replace(dflash.cfg, retrace=retrace)
    graphdef, state = nnx.split(rj.DFlashDrafter(cfg, rngs=nnx.Rngs(0)))
    flat = dict(nnx.to_flat_state(state))
    for path, var in nnx.to_flat_state(nnx.state(dflash)):
        flat[path].set_value(var.get_value())
    drafter = with_random_retrace(nnx.merge(graphdef, nnx.from_flat_state(flat)), seed=3, scale=0.2)
    if retrace.mixture == "target":  # an open gate (a random scale may be negative: closed)
        drafter.retrace.mix_scale[...] = jnp.full((1,), 0.6)
    prompt = prompts[0]
    response = rj.generate(qwen3, [prompt], 48).tokens[0]  # the target's own greedy text
    seq = np.asarray(prompt + response, np.int32)[None]
    k, s_len = cfg.block_size, seq.shape[1]
    near_end = [s_len - k - 2, s_len - k, s_len - 1]
    anchors = np.r_[np.arange(len(prompt), s_len - 4 * k, 3), near_end].astype(np.int32)[None]
    loss_mask = np.r_[np.zeros(len(prompt)), np.ones(len(response))].astype(np.int32)[None]
    stepper = SpeculativeStepper(qwen3, drafter, capacity=64, block_size=k)
    (tdef, tstate), (ddef, dstate) = nnx.split(qwen3), nnx.split(drafter)
    rows = anchors.shape[1]

    @jax.jit
    def observe(tstate, dstate, carry):
        """The drafter's states of the round about to run and the teacher-forced target states of its
        block (the sequence at ``start .. start+K-1``, seen through the round's own target cache; with
        the "keys" fusion its features, which that memory holds)."""
        target, drafter = nnx.merge(tdef, tstate), nnx.merge(ddef, dstate)
        hidden = draft_block(target, drafter, carry.anchor_b, carry.draft_cache, k, carry.memory)
        idx = jnp.minimum(carry.target_cache.lengths[:, None] + jnp.arange(k), s_len - 1)
        teacher = target(jnp.take_along_axis(jnp.repeat(jnp.asarray(seq), rows, 0), idx, 1), carry.target_cache,
                         feature_layers=cfg.target_layer_ids)
        return hidden, (teacher.features if retrace.fusion == "keys" else teacher.hidden)

    return drafter, seq, anchors, loss_mask, (stepper, lambda carry: observe(tstate, dstate, carry))


@pytest.mark.parametrize("source", ["verify", "teacher"])
def test_two_rounds_compute_the_two_round_rollout(qwen3, rollout_case, source):
    drafter, seq, anchors, loss_mask, _ = rollout_case
    valid = np.ones(anchors.shape, bool)
    (ddef, dstate), (tdef, tstate) = nnx.split(drafter), nnx.split(qwen3)
    loss, roll = jax.jit(lambda dstate, tstate, *arrays: retrace_loss(
        nnx.merge(ddef, dstate), nnx.merge(tdef, tstate), *arrays, 0.7, correction_source=source, rounds=2,
        round1_weight=0.25))(dstate, tstate, seq, loss_mask, anchors, valid)
    ref = jax.jit(lambda dstate, tstate, *arrays: two_round_reference(
        nnx.merge(ddef, dstate), nnx.merge(tdef, tstate), *arrays, 0.7, source))(dstate, tstate, seq, loss_mask,
                                                                                 anchors, valid)
    m1, m2, accepted, memory, hidden2, anchors2, valid2 = jax.tree.map(np.asarray, ref)
    assert len(roll.rounds) == 2 and len(roll.memories) == 1
    assert not valid2.all() and valid2.any()  # some round-2 blocks run past the sequence
    for got, want in ((roll.round1, m1), (roll.round2, m2)):
        for name in ("loss", "slot_accuracy", "tau"):
            np.testing.assert_allclose(np.asarray(getattr(got, name)), getattr(want, name), rtol=1e-6, err_msg=name)
    np.testing.assert_array_equal(np.asarray(roll.accepted_ba), accepted)
    np.testing.assert_array_equal(np.asarray(roll.anchors2_ba), anchors2)
    np.testing.assert_array_equal(np.asarray(roll.valid2_ba), valid2)
    np.testing.assert_array_equal(np.asarray(roll.memory.valid), memory.valid)
    np.testing.assert_allclose(np.asarray(roll.memory.mem_d), memory.mem_d, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(roll.memory.mem_t), memory.mem_t, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(roll.hidden2_btd), hidden2, rtol=1e-6, atol=1e-6)
    # The loss of two rounds: round 2 + round1_weight x round 1.
    np.testing.assert_allclose(float(loss), float(m2.loss) + 0.25 * float(m1.loss), rtol=1e-6)


ROLLOUT_CASES = [
    ("rollout_case", "verify", 2), ("rollout_case", "verify", 4), ("rollout_case", "teacher", 2),
    ("rollout_case", "teacher", 4), ("rollout_case_agreed", "verify", 4), ("rollout_case_agreed", "teacher", 4),
    ("rollout_case_keys", "verify", 4), ("rollout_case_keys", "teacher", 4), ("rollout_case_hints", "verify", 4),
    ("rollout_case_hints", "teacher", 4), ("rollout_case_mixture", "verify", 4), ("rollout_case_mixture", "teacher", 4)]


# By default each memory variant against the verify pass, and the teacher source on the plain memory
# only (the variants read the source the same way); `pytest -m slow` runs the other teacher cases.
@pytest.mark.parametrize("case,source,rounds", [
    c if c[0] == "rollout_case" or c[1] == "verify" else pytest.param(*c, marks=pytest.mark.slow)
    for c in ROLLOUT_CASES])
def test_rollout_equals_inference_rounds(qwen3, request, case, source, rounds):
    """The training rollout against ``rounds`` real inference rounds (``speculative_round`` through the
    stepper), every anchor a row whose prompt is the sequence up to it: the anchors, ``a``, the drafter's
    states and the memory of every round. With ``teacher`` the stepper's memory takes the teacher-forced
    target states of its round's block in place of the verify pass's (what that source trains). With
    ``slots="agreed"`` the rollout drops the same memory slots as inference (some kept, some dropped);
    with ``fusion="keys"`` the memory holds the target's features, attended to as extra keys; with
    ``hints="tokens"`` it also holds the embedded target token and rejected proposal of each slot (the
    sequence's own token in place of the target's with ``teacher``)."""
    drafter, seq, anchors, loss_mask, (stepper, observe) = request.getfixturevalue(case)
    k, s_len = drafter.cfg.block_size, seq.shape[1]
    (ddef, dstate), (tdef, tstate) = nnx.split(drafter), nnx.split(qwen3)
    roll = jax.jit(lambda dstate, tstate, *arrays: retrace_rollout(
        nnx.merge(ddef, dstate), nnx.merge(tdef, tstate), *arrays, 1.0, correction_source=source, rounds=rounds))(
        dstate, tstate, seq, loss_mask, anchors, np.ones(anchors.shape, bool))
    assert len(roll.rounds) == rounds and len(roll.memories) == rounds - 1
    rows = anchors.shape[1]
    stepper.init(np.repeat(seq, rows, 0), anchors[0], np.ones(rows, bool), np.int32(10**6),
                 _pad_stops([], qwen3.cfg.vocab_size), SamplingParams.make(0.0, 0, 1.0, 0))
    inside = np.ones(rows, bool)  # rows whose rounds so far lie wholly inside the sequence
    counts = set()
    kept_dropped = [0, 0]  # memory slots kept, and slots the agreement rule dropped
    for r in range(rounds):
        hidden, teacher = observe(stepper.carry)
        info = stepper.step()
        start, a, tokens = np.asarray(info.start_b), np.asarray(info.accepted_b), np.asarray(info.tokens_bw)
        inside &= start + k <= s_len
        assert inside.sum() >= 6
        for i in np.flatnonzero(inside):
            assert int(roll.anchors[r][0, i]) == start[i] and bool(roll.valid[r][0, i])
            assert int(roll.accepted[r][0, i]) == a[i], (r, i)
            # The round committed the sequence after its anchor: it is the target's own greedy text.
            np.testing.assert_array_equal(tokens[i, : a[i] + 1], seq[0, start[i] + 1: start[i] + a[i] + 2])
            counts.add(int(a[i]))
        sl = lambda i: slice(i * k, (i + 1) * k)  # noqa: E731
        for i in np.flatnonzero(inside):
            np.testing.assert_allclose(np.asarray(roll.hidden[r][0, sl(i)]), np.asarray(hidden[i]), atol=5e-5,
                                       err_msg=f"round {r + 1}, anchor {anchors[0, i]}")
        if r < rounds - 1:
            memory = stepper.carry.memory
            if source == "teacher":
                memory = memory.replace(mem_t=shift_memory(teacher, teacher, info.accepted_b).mem_t)
                at = np.minimum(start[:, None] + 1 + np.arange(k - 1), s_len - 1)
                if case == "rollout_case_agreed":  # with teacher states the target's own tokens are the sequence
                    agreed = np.asarray(info.proposals_bj) == seq[0][at]
                    memory = memory.replace(valid=shift_memory(teacher, teacher, info.accepted_b, agreed).valid)
                if case == "rollout_case_hints":
                    hint = token_hints(qwen3.embed, jnp.asarray(seq[0][at]), info.proposals_bj, jnp.float32)
                    memory = memory.replace(hint=shift_memory(teacher, teacher, info.accepted_b, None, hint).hint)
                if case == "rollout_case_mixture":  # the stale distribution of the teacher-forced states
                    mix = stale_top_k(qwen3.logits(teacher), lambda ids: ids)
                    shifted = shift_memory(teacher, teacher, info.accepted_b, None, None, mix)
                    memory = memory.replace(mix_ids=shifted.mix_ids, mix_p=shifted.mix_p)
                stepper.carry = stepper.carry.replace(memory=memory)
            got = roll.memories[r]
            for i in np.flatnonzero(inside & (start + a + 1 < s_len)):  # the next round is valid
                v = np.asarray(memory.valid[i])
                positional = (np.arange(k) >= 1) & (np.arange(k) <= k - 2 - a[i])
                kept_dropped[0] += int(v.sum())
                kept_dropped[1] += int((positional & ~v).sum())
                np.testing.assert_array_equal(np.asarray(got.valid[0, sl(i)]), v)
                np.testing.assert_allclose(np.asarray(got.mem_d[0, sl(i)])[v], np.asarray(memory.mem_d[i])[v],
                                           atol=5e-5)
                np.testing.assert_allclose(np.asarray(got.mem_t[0, sl(i)])[v], np.asarray(memory.mem_t[i])[v],
                                           atol=5e-5)
                assert (got.hint is None) == (memory.hint is None) == (case != "rollout_case_hints")
                if memory.hint is not None:
                    np.testing.assert_array_equal(np.asarray(got.hint[0, sl(i)])[v], np.asarray(memory.hint[i])[v])
                assert (got.mix_ids is None) == (memory.mix_ids is None) == (case != "rollout_case_mixture")
                if memory.mix_ids is not None:
                    np.testing.assert_array_equal(np.asarray(got.mix_ids[0, sl(i)])[v],
                                                  np.asarray(memory.mix_ids[i])[v])
                    np.testing.assert_allclose(np.asarray(got.mix_p[0, sl(i)])[v], np.asarray(memory.mix_p[i])[v],
                                               atol=2e-5)
    assert len(counts) > 1  # several acceptance counts were exercised
    # The agreement rule dropped slots, and kept some where it could (the tiny target's verify pass, after a
    # wrong token, rarely shares the drafter's later proposals; the sequence itself often does).
    agreed = case == "rollout_case_agreed"
    assert (kept_dropped[1] > 0) == agreed and (kept_dropped[0] > 0 or (agreed and source == "verify")), kept_dropped
    # Rounds past the sequence are masked, and so is the memory fused into them.
    for r in range(1, rounds):
        unclipped = np.asarray(roll.anchors[r - 1]) + np.asarray(roll.accepted[r - 1]) + 1
        want = np.asarray(roll.valid[r - 1]) & (unclipped < s_len)
        np.testing.assert_array_equal(np.asarray(roll.valid[r]), want)
        off = np.repeat(~want[0], k)
        assert not np.asarray(roll.memories[r - 1].valid[0])[off].any()
    if rounds == 4:
        assert not np.asarray(roll.valid[-1]).all()


def test_bf16_compute_remat_and_accumulation(qwen3):
    from retrace_jax.training.step import StepOptions, adamw, init_opt_state, make_train_step

    rng = np.random.RandomState(0)
    tokens = jnp.asarray(rng.randint(0, 127, (4, 32)), jnp.int32)
    mask = jnp.asarray(np.r_[np.zeros(6), np.ones(26)][None].repeat(4, 0), jnp.int32)
    opts = StepOptions(objective="retrace", compute_dtype="bfloat16", remat=True, num_anchors=3, grad_accum=2,
                       rounds=2)
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
    def memories(st, dtype=None):  # the memories fused into rounds 2, 3 and 4
        return retrace_rollout(nnx.merge(graphdef, st), qwen3, tokens, mask, anchors, valid, 1.0,
                               memory_dtype=dtype, rounds=4).memories

    full, half = memories(state), memories(state, "float16")
    assert len(full) == 3 and all(m.mem_d.dtype == m.mem_t.dtype == jnp.float32 for m in half)
    for a, b in ((full[0].mem_d, half[0].mem_d), (full[0].mem_t, half[0].mem_t)):
        assert b.dtype == a.dtype  # stored rounded, used in the compute dtype
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a.astype(jnp.float16).astype(a.dtype)))
        assert not np.array_equal(np.asarray(a), np.asarray(b))
    # Detached: nothing flows back into the drafter through any round's memory.
    grads = jax.jit(jax.grad(lambda st: sum(jnp.sum(m.mem_d) + jnp.sum(m.mem_t) for m in memories(st))))(state)
    assert all(not np.any(np.asarray(g)) for g in jax.tree.leaves(grads))


def test_the_retrace_module_learns_at_its_own_rate(qwen3):
    """``retrace_lr_multiplier``: the ReTrace module's updates are that multiple of what they would be,
    every other parameter's are unchanged (same gradients, one update after the warm-up)."""
    import optax

    from retrace_jax.training.step import adamw

    drafter = rj.init_drafter(qwen3.cfg, mask_token_id=127, num_layers=1, block_size=4, retrace=rj.ReTraceConfig())
    params = nnx.state(drafter, nnx.Param)
    grads = jax.tree.map(lambda x: jnp.full_like(x, 0.01), params)
    updates = {}
    for m in (1.0, 3.0):
        opt = adamw(1e-2, 10, warmup_frac=0.0, retrace_lr_multiplier=m)
        updates[m], _ = opt.update(grads, opt.init(params), params)
    for (path, one), (_, three) in zip(nnx.to_flat_state(updates[1.0]), nnx.to_flat_state(updates[3.0])):
        scale = 3.0 if "retrace" in path else 1.0
        np.testing.assert_allclose(np.asarray(three.get_value()), scale * np.asarray(one.get_value()), rtol=1e-6,
                                   err_msg=str(path))
    assert any("retrace" in p for p, _ in nnx.to_flat_state(updates[1.0]))
    with pytest.raises(ValueError, match="retrace_lr_multiplier must be a positive number"):
        adamw(1e-2, 10, retrace_lr_multiplier=0.0)
    assert isinstance(adamw(1e-2, 10), optax.GradientTransformation)


def test_memory_dropout_drops_whole_blocks_of_later_rounds(qwen3, rollout_case):
    """``MemoryTraining(dropout=p)``: in each round after the first, a block's memory is dropped with
    probability p (all its slots invalid), drawn from the key; p = 0 is the paper's rollout, p = 1 drops
    every memory, so every round drafts as DFlash."""
    from retrace_jax.training.retrace_loss import MemoryTraining

    drafter, seq, anchors, loss_mask, _ = rollout_case
    k = drafter.cfg.block_size
    (ddef, dstate), (tdef, tstate) = nnx.split(drafter), nnx.split(qwen3)

    @functools.partial(jax.jit, static_argnames="p")
    def roll(dstate, p, key):
        return retrace_rollout(nnx.merge(ddef, dstate), nnx.merge(tdef, tstate), seq, loss_mask, anchors,
                               np.ones(anchors.shape, bool), 1.0, rounds=3,
                               memory_training=MemoryTraining(dropout=p, key=key))

    key = jax.random.PRNGKey(5)
    base = roll(dstate, 0.0, key)
    plain = retrace_rollout(drafter, qwen3, seq, loss_mask, anchors, np.ones(anchors.shape, bool), 1.0, rounds=3)
    np.testing.assert_allclose(float(base.rounds[-1].loss), float(plain.rounds[-1].loss), rtol=1e-6)
    every = roll(dstate, 1.0, key)
    assert not any(np.asarray(m.valid).any() for m in every.memories)
    half = roll(dstate, 0.5, key)
    kept = dropped = 0
    for n, (m_half, m_base) in enumerate(zip(half.memories, base.memories)):
        h = np.asarray(m_half.valid).reshape(-1, k).any(-1)
        b_ = np.asarray(m_base.valid).reshape(-1, k).any(-1)
        kept, dropped = kept + int((h & b_).sum()), dropped + int((~h & b_).sum())
        if n == 0:
            # The first memory comes from round 1, the same in both runs: dropping never adds a slot, and a
            # block is kept whole or dropped whole. (Later rounds draft from the memories left, so their
            # acceptance, and the slots of the memories they leave, may differ from the base run's.)
            assert not (h & ~b_).any()
            np.testing.assert_array_equal(np.asarray(m_half.valid).reshape(-1, k),
                                          np.asarray(m_base.valid).reshape(-1, k) & h[:, None])
    assert kept > 0 and dropped > 0, (kept, dropped)
    with pytest.raises(ValueError, match="memory dropout needs a random key"):
        retrace_rollout(drafter, qwen3, seq, loss_mask, anchors, np.ones(anchors.shape, bool), 1.0, rounds=2,
                        memory_training=MemoryTraining(dropout=0.5))


def test_miss_weight_weighs_the_slots_the_memory_off_draft_gets_wrong(qwen3, rollout_case):
    """``MemoryTraining(miss_weight=w)``: round 1 is unchanged; in later rounds a slot that the round's own
    draft without memory gets wrong weighs 1 + w, so the loss moves toward those slots while the
    acceptance metrics stay the same. The weighted loss is checked against the slot losses themselves."""
    from retrace_jax.training.dflash_loss import slot_loss
    from retrace_jax.training.retrace_loss import MemoryTraining

    drafter, seq, anchors, loss_mask, _ = rollout_case
    valid = np.ones(anchors.shape, bool)
    (ddef, dstate), (tdef, tstate) = nnx.split(drafter), nnx.split(qwen3)
    roll = jax.jit(lambda dstate, w: retrace_rollout(nnx.merge(ddef, dstate), nnx.merge(tdef, tstate), seq, loss_mask,
                                                      anchors, valid, 1.0, rounds=2,
                                                      memory_training=MemoryTraining(miss_weight=w)),
                   static_argnums=1)
    base, weighted = roll(dstate, 0.0), roll(dstate, 3.0)
    np.testing.assert_allclose(float(weighted.round1.loss), float(base.round1.loss), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(weighted.round2.slot_accuracy), np.asarray(base.round2.slot_accuracy))
    np.testing.assert_allclose(float(weighted.round2.tau), float(base.round2.tau), rtol=1e-6)
    assert abs(float(weighted.round2.loss) - float(base.round2.loss)) > 1e-4

    # The reference: round 2's blocks drafted with and without the memory; weights 1 + 3 x (off-draft wrong).
    k = drafter.cfg.block_size
    blocks = build_blocks(jnp.asarray(seq), jnp.asarray(loss_mask), base.anchors[1], base.valid[1], k,
                          drafter.cfg.mask_token_id, default_gamma(k))
    seq_out = qwen3(jnp.asarray(seq), qwen3.init_cache(1, seq.shape[1]), feature_layers=drafter.cfg.target_layer_ids)
    ctx = sequence_context(drafter, seq_out.features)
    off = draft_blocks(drafter, qwen3, ctx, blocks)
    on = draft_blocks(drafter, qwen3, ctx, blocks, base.memory, 1.0)
    missed = np.asarray(jnp.argmax(qwen3.logits(off[:, :, 1:]), -1)) != np.asarray(blocks.labels_baw[:, :, 1:])
    w = np.asarray(blocks.weights_baw[:, :, 1:]) * (1 + 3.0 * missed)
    want = slot_loss(qwen3.logits(on[:, :, 1:]), blocks.labels_baw[:, :, 1:], jnp.asarray(w))
    np.testing.assert_allclose(float(weighted.round2.loss), float(want.loss), rtol=1e-5)
    assert missed[np.asarray(blocks.weights_baw[:, :, 1:]) > 0].mean() not in (0.0, 1.0)
