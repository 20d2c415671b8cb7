"""Drafters whose config.json sets ``layer_types`` with ``"sliding_attention"`` layers and a ``sliding_window``.

The rule is the official DFlash drafter's (see ``retrace_jax.models.drafter.window_start``): in a sliding
layer a block query at position ``p`` sees the context keys at ``k > p - window`` and the whole block. The
PyTorch reference (``tests/dflash_reference.py``) applies it as a mask over ``[context ; block]``; every
comparison has a control, the same weights with the window ignored, which the reference tells apart.
"""

import dataclasses
import json
import re

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

import retrace_jax as rj
from retrace_jax.attention import cached_attention
from retrace_jax.training.dflash_loss import block_visibility
from tests.dflash_reference import RefDFlashDraftModel
from tests.helpers import edit_config, randomize

WINDOW = 5
BLOCK = 4
TYPES = ("sliding_attention", "full_attention")
TOL = 1e-5


def with_layer_types(drafter, layer_types, sliding_window):
    """A copy of ``drafter`` (same weights) with other layer types."""
    graphdef, state = nnx.split(drafter)
    new = nnx.merge(graphdef, state)
    new.cfg = dataclasses.replace(drafter.cfg, layer_types=layer_types, sliding_window=sliding_window)
    return new


@pytest.fixture(scope="module")
def full(qwen3):
    d = rj.init_drafter(qwen3.cfg, mask_token_id=127, num_layers=2, block_size=BLOCK, target_layer_ids=(0, 1))
    return randomize(d, seed=3)


@pytest.fixture(scope="module")
def sliding(full):
    return with_layer_types(full, TYPES, WINDOW)


@pytest.fixture(scope="module")
def reference(sliding, tmp_path_factory):
    path = tmp_path_factory.mktemp("sliding")
    rj.save_drafter(sliding, str(path))
    return RefDFlashDraftModel.from_pretrained(str(path)).eval()


def run_reference(ref, emb, feats, positions):
    with torch.no_grad():
        return ref(torch.tensor(np.asarray(emb)), torch.tensor(np.asarray(feats)), torch.tensor(positions)).numpy()


def test_saved_config_round_trips_and_the_reference_reads_the_window(qwen3, sliding, reference, tmp_path):
    rj.save_drafter(sliding, str(tmp_path))
    with open(tmp_path / "config.json") as f:
        cfg = json.load(f)
    assert (cfg["layer_types"], cfg["sliding_window"], cfg["use_sliding_window"]) == (list(TYPES), WINDOW, True)
    assert rj.load_drafter(str(tmp_path), qwen3).cfg == sliding.cfg
    assert [layer.self_attn.window for layer in reference.layers] == [WINDOW, None]


def test_old_and_all_full_configs_load_as_full_attention(qwen3, full, tmp_path):
    rj.save_drafter(full, str(tmp_path))
    assert rj.load_drafter(str(tmp_path), qwen3).cfg.layer_types is None  # written as all full
    edit_config(str(tmp_path), lambda c: c.pop("layer_types"))
    assert rj.load_drafter(str(tmp_path), qwen3).cfg == full.cfg


def test_without_use_sliding_window_the_layers_stay_full_as_in_transformers(qwen3, sliding, tmp_path):
    """transformers' Qwen3Config sets sliding_window None unless use_sliding_window: the official model's
    sliding layers then attend to everything, and so do ours."""
    rj.save_drafter(sliding, str(tmp_path))
    edit_config(str(tmp_path), lambda c: c.pop("use_sliding_window"))
    cfg = rj.load_drafter(str(tmp_path), qwen3).cfg
    assert cfg.layer_types == TYPES and cfg.sliding_window is None and cfg.window(0) is None
    ref = RefDFlashDraftModel.from_pretrained(str(tmp_path))
    assert [layer.self_attn.window for layer in ref.layers] == [None, None]


BAD = {
    "unknown layer type": (
        lambda c: c.update(layer_types=["sliding_attention", "chunked_attention"]),
        (r"config\.json: layer_types\[1\]: 'chunked_attention' is not implemented; retrace-jax implements "
         r"'full_attention' and 'sliding_attention'")),
    "one type for two layers": (
        lambda c: c.update(layer_types=["full_attention"]),
        r"config\.json: layer_types has 1 entries for num_hidden_layers 2"),
    "not a list": (lambda c: c.update(layer_types="sliding_attention"), r"config\.json: layer_types: expected a list"),
    "zero window": (lambda c: c.update(sliding_window=0),
                    r"config\.json: sliding_window: .*needs a positive integer sliding_window; got 0"),
    "no window": (lambda c: c.pop("sliding_window"), r"config\.json: sliding_window: .*got None"),
    "window as text": (lambda c: c.update(sliding_window="4096"),
                       r"config\.json: sliding_window: expected an integer, got '4096'"),
    "window below the block": (lambda c: c.update(sliding_window=3),
                               r"config\.json: sliding_window: 3 is smaller than block_size 4"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_layer_types_and_windows_are_refused_naming_file_and_field(qwen3, sliding, tmp_path, case):
    edit, message = BAD[case]
    rj.save_drafter(sliding, str(tmp_path))
    edit_config(str(tmp_path), edit)
    with pytest.raises(rj.ConfigError, match=message) as err:
        rj.load_drafter(str(tmp_path), qwen3)
    assert str(err.value).startswith(str(tmp_path))  # the file, under the directory (a saved version)


def test_training_forward_matches_reference(sliding, full, reference):
    """The training path: several blocks over one sequence, each seeing the context before its anchor,
    through the explicit mask, against the reference run on each block alone."""
    rng = np.random.RandomState(0)
    s, d = 16, sliding.cfg.hidden_size
    feats = rng.randn(1, s, 2 * d).astype(np.float32)
    anchors = np.array([[3, 8, 12]])
    a = anchors.shape[1]
    emb = rng.randn(1, a * BLOCK, d).astype(np.float32)
    positions = jnp.asarray((anchors[:, :, None] + np.arange(BLOCK)).reshape(1, -1))
    mask = block_visibility(jnp.asarray(anchors), s, BLOCK, causal=False)
    ctx_kv = sliding.context_kv(jnp.asarray(feats), jnp.arange(s)[None])  # full's weights are the same
    got = np.asarray(sliding.forward(jnp.asarray(emb), positions, ctx_kv, mask))
    control = np.asarray(full.forward(jnp.asarray(emb), positions, ctx_kv, mask))
    for i, anchor in enumerate(anchors[0]):
        rows = slice(i * BLOCK, (i + 1) * BLOCK)
        want = run_reference(reference, emb[:, rows], feats[:, :anchor], np.arange(anchor + BLOCK)[None])[0]
        np.testing.assert_allclose(got[0, rows], want, atol=TOL, rtol=0)
        if anchor > WINDOW:  # the window hides some context: ignoring it differs
            assert np.abs(control[0, rows] - want).max() > 1e-3


@pytest.mark.parametrize("attention", ["chunked", "dense"])
def test_cached_draft_matches_reference(sliding, full, reference, attention):
    """The decode path: a block drafted against each row's cached context, longer than the window."""
    rng = np.random.RandomState(1)
    d = sliding.cfg.hidden_size
    feats = jnp.asarray(rng.randn(2, 13, 2 * d).astype(np.float32))
    emb = jnp.asarray(rng.randn(2, BLOCK, d).astype(np.float32))
    lens = [9, 13]
    cache = sliding.extend_cache(feats, sliding.init_cache(2, 20)).replace(lengths=jnp.asarray(lens, jnp.int32))
    got = np.asarray(sliding.draft(emb, cache, attention=attention))
    control = np.asarray(full.draft(emb, cache, attention=attention))
    for b, n in enumerate(lens):
        want = run_reference(reference, emb[b : b + 1], feats[b : b + 1, :n], np.arange(n + BLOCK)[None])[0]
        np.testing.assert_allclose(got[b], want, atol=TOL, rtol=0)
        assert np.abs(control[b] - want).max() > 1e-3


@pytest.mark.parametrize("attention", ["chunked", "dense"])
def test_a_window_longer_than_the_context_changes_nothing(full, attention):
    """Every position below the window: each query's first visible slot is negative, and every context
    key is seen, once (the walk once read chunk 0 again for each negative chunk before it)."""
    wide = with_layer_types(full, TYPES, 300)
    rng = np.random.RandomState(4)
    d = full.cfg.hidden_size
    feats = jnp.asarray(rng.randn(2, 140, 2 * d).astype(np.float32))
    emb = jnp.asarray(rng.randn(2, BLOCK, d).astype(np.float32))
    cache = full.extend_cache(feats, full.init_cache(2, 300)).replace(lengths=jnp.asarray([9, 140], jnp.int32))
    np.testing.assert_allclose(np.asarray(wide.draft(emb, cache, attention=attention)),
                               np.asarray(full.draft(emb, cache, attention=attention)), atol=TOL, rtol=0)


def test_windowed_cache_walk_equals_dense(walk):
    """``start_bt`` (a first visible slot per query) through the chunked walk, over several chunks and in
    chunks of queries, equals the dense reference."""
    rng = np.random.RandomState(2)
    b, t, h, kv, d, s = 2, 6, 4, 2, 8, 64
    q = jnp.asarray(rng.randn(b, t, h, d).astype(np.float32))
    k, v = (jnp.asarray(rng.randn(1, b, kv, s, d).astype(np.float32)) for _ in range(2))  # [L, B, K, S, D]
    ek, ev = (jnp.asarray(rng.randn(b, 3, kv, d).astype(np.float32)) for _ in range(2))
    limit = jnp.asarray([[40] * t, [9] * t], jnp.int32)
    # Near the sequence start a window's first slot is negative (window_start = p - w + 1): some queries here.
    start = jnp.asarray([[20, 21, 22, 23, 24, 25], [-40, -17, -1, 0, 3, 4]], jnp.int32)
    want = cached_attention(q, k, v, 0, limit, ek, ev, start_bt=start, implementation="dense")
    for q_chunk in (512, 4):
        got = cached_attention(q, k, v, 0, limit, ek, ev, start_bt=start, implementation="chunked", kv_chunk=16,
                               q_chunk=q_chunk)
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=TOL, rtol=0)
    unwindowed = cached_attention(q, k, v, 0, limit, ek, ev, implementation="chunked", kv_chunk=16)
    assert np.abs(np.asarray(unwindowed) - np.asarray(want)).max() > 1e-3


def test_greedy_speculative_decoding_with_a_sliding_drafter_is_lossless(qwen3, sliding):
    prompts = [[3, 4, 5, 6, 7, 8, 9, 10], [9], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31]]
    spec = rj.generate(qwen3, prompts, 24, drafter=sliding)
    assert spec.tokens == rj.generate(qwen3, prompts, 24).tokens


def test_the_error_names_the_unknown_value(qwen3):
    """DrafterConfig built in code refuses the same way (no file to name)."""
    cfg = rj.init_drafter(qwen3.cfg, mask_token_id=127, num_layers=2, block_size=BLOCK).cfg
    with pytest.raises(rj.ConfigError, match=re.escape("layer_types[0]: 'global'")):
        dataclasses.replace(cfg, layer_types=("global", "full_attention"), sliding_window=WINDOW)
