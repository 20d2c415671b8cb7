"""Float32 parity of the target model with transformers' PyTorch models."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch

import retrace_jax as rj
from retrace_jax.decoding.layer_loop import decode_weights
from retrace_jax.models.kv_cache import KVCache
from retrace_jax.models.target import prefill

TOL = 1e-4


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids)).logits.numpy()


def test_prefill_logits_match_hf(family, hf_model_dir):
    model, directory = hf_model_dir(family)
    target = rj.load_target(directory)
    ids = np.random.RandomState(0).randint(0, rj.load_target(directory).cfg.vocab_size, (2, 9))
    out = target(jnp.asarray(ids), target.init_cache(2, 16))
    np.testing.assert_allclose(np.asarray(target.logits(out.hidden)), hf_logits(model, ids), atol=TOL, rtol=0)
    np.testing.assert_array_equal(np.asarray(out.cache.lengths), [9, 9])


@pytest.mark.parametrize("layer_loop", ["scan", "unrolled", "in_place"])
def test_cached_decoding_with_ragged_rows_matches_hf(family, hf_model_dir, layer_loop):
    """Rows of different prompt lengths decode token by token, each at its own cache offset; also through
    the per-layer weight views that unrolled (CPU) programs run, and through the static slices of the
    stacked weights that unrolled programs run elsewhere."""
    model, directory = hf_model_dir(family)
    target = rj.load_target(directory)
    if layer_loop == "unrolled":
        target.unroll_layers(decode_weights(target, "unrolled").layers)  # the decode steps; the prefill scans
    elif layer_loop == "in_place":
        target.unroll_in_place()
    rng = np.random.RandomState(1)
    lens = [3, 7]
    seqs = [rng.randint(0, 128, (lens[b] + 6,)) for b in range(2)]
    padded = np.zeros((2, max(lens)), np.int32)
    for b in range(2):
        padded[b, : lens[b]] = seqs[b][: lens[b]]
    logits, cache, _ = prefill(target, jnp.asarray(padded), jnp.asarray(lens, jnp.int32), target.init_cache(2, 32))
    got = [[np.asarray(logits[b])] for b in range(2)]
    for step in range(6):
        step_tokens = np.array([[seqs[b][lens[b] + step]] for b in range(2)], np.int32)
        out = target(jnp.asarray(step_tokens), cache)
        cache = out.cache
        step_logits = np.asarray(target.logits(out.hidden[:, 0]))
        for b in range(2):
            got[b].append(step_logits[b])
    for b in range(2):
        ref = hf_logits(model, seqs[b][None])[0, lens[b] - 1 : lens[b] + 6]
        np.testing.assert_allclose(np.stack(got[b]), ref, atol=TOL, rtol=0)
    np.testing.assert_array_equal(np.asarray(cache.lengths), [l + 6 for l in lens])


def test_features_are_chosen_layer_outputs(hf_model_dir):
    model, directory = hf_model_dir("qwen3")
    target = rj.load_target(directory)
    ids = np.random.RandomState(2).randint(0, 128, (1, 5))
    out = target(jnp.asarray(ids), target.init_cache(1, 8), feature_layers=(1, 0))
    with torch.no_grad():
        hs = model(torch.tensor(ids), output_hidden_states=True).hidden_states
    # hidden_states[i + 1] is the output of layer i (the last one is replaced by the final norm).
    ref = np.concatenate([hs[2].numpy(), hs[1].numpy()], -1)
    np.testing.assert_allclose(np.asarray(out.features), ref, atol=TOL, rtol=0)
    # The returned hidden state is the final-norm state, the LM head's input.
    np.testing.assert_allclose(np.asarray(out.hidden), hs[-1].numpy(), atol=TOL, rtol=0)
    with pytest.raises(ValueError, match="outside"):
        target(jnp.asarray(ids), target.init_cache(1, 8), feature_layers=(3,))


def test_last_layer_feature_is_the_final_norm_state(hf_model_dir):
    """As in transformers' hidden_states[L] (and the official DFlash code): layer L-1's feature is the
    final-norm state, also when asked for twice and next to other layers."""
    model, directory = hf_model_dir("qwen3")
    target = rj.load_target(directory)
    ids = np.random.RandomState(5).randint(0, 128, (2, 7))
    last = target.cfg.num_layers - 1
    out = target(jnp.asarray(ids), target.init_cache(2, 8), feature_layers=(last, 0, last))
    with torch.no_grad():
        hs = model(torch.tensor(ids), output_hidden_states=True).hidden_states
    ref = np.concatenate([hs[last + 1].numpy(), hs[1].numpy(), hs[last + 1].numpy()], -1)
    np.testing.assert_allclose(np.asarray(out.features), ref, atol=TOL, rtol=0)
    np.testing.assert_allclose(np.asarray(out.features[..., :64]), np.asarray(out.hidden), atol=0)


def test_stale_cache_entries_are_never_read(hf_model_dir):
    """Garbage past a row's length (e.g. rejected draft tokens) does not change the result."""
    _, directory = hf_model_dir("qwen3")
    target = rj.load_target(directory)
    ids = jnp.asarray(np.random.RandomState(3).randint(0, 128, (1, 6)))
    clean = target.init_cache(1, 16)
    noisy = KVCache(clean.k + 7.0, clean.v - 3.0, clean.lengths)
    a = target(ids, clean).hidden
    b = target(ids, noisy).hidden
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_bfloat16_load_runs_close_to_float32(hf_model_dir):
    _, directory = hf_model_dir("llama")
    t32 = rj.load_target(directory)
    t16 = rj.load_target(directory, dtype="bfloat16")
    assert t16.embed_tokens.embedding.dtype == jnp.bfloat16
    ids = jnp.asarray(np.random.RandomState(4).randint(0, 128, (1, 6)))
    l32 = np.asarray(t32.logits(t32(ids, t32.init_cache(1, 8)).hidden))
    l16 = np.asarray(t16.logits(t16(ids, t16.init_cache(1, 8)).hidden)).astype(np.float32)
    err = np.abs(l16 - l32).max()
    assert 0 < err < 0.1 * l32.std()  # it computes in bfloat16, within a tenth of the logits' spread
    np.testing.assert_array_equal(l16.argmax(-1), l32.argmax(-1))
    probs = [np.exp(x - x.max(-1, keepdims=True)) / np.exp(x - x.max(-1, keepdims=True)).sum(-1, keepdims=True)
             for x in (l16, l32)]
    assert np.abs(probs[0] - probs[1]).sum(-1).max() < 0.05  # total variation of the next-token distributions


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_abstract_target_has_the_structure_of_the_built_model(family, dtype):
    """``abstract_target`` (one block built, its parameters given the layer axis) is the structure that
    ``nnx.eval_shape`` of the whole model gives: the same graph, parameter paths, kinds, shapes and dtypes."""
    import dataclasses

    from flax import nnx

    from retrace_jax.models.target import TargetModel, abstract_target
    from tests.helpers import make_hf_model

    cfg = dataclasses.replace(rj.ModelConfig.from_hf(make_hf_model(family).config.to_dict()), num_layers=3)
    built = nnx.eval_shape(lambda: TargetModel(cfg, dtype=dtype, rngs=nnx.Rngs(0)))
    abstract = abstract_target(cfg, dtype)
    (graph_a, state_a), (graph_b, state_b) = nnx.split(abstract), nnx.split(built)
    assert graph_a == graph_b and abstract.cfg == cfg

    def leaves(state):
        return [(p, type(v), v.get_value().shape, v.get_value().dtype) for p, v in nnx.to_flat_state(state)]

    assert leaves(state_a) == leaves(state_b)
    gate_up = abstract.layers.mlp.gate_up_proj.kernel.get_value()  # [L, d, 2, I]
    assert gate_up.shape == (3, cfg.hidden_size, 2, cfg.intermediate_size) and gate_up.dtype == dtype
