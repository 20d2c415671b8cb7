"""The DFlash drafter against the PyTorch reference, and its checkpoints in the official layout."""

import dataclasses
import json
import os
import stat

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.numpy import load_file, save_file
from safetensors.torch import load_file as load_torch

import retrace_jax as rj
from tests.dflash_reference import RefDFlashDraftModel
from tests.helpers import randomize

TOL = 1e-4


@pytest.fixture(scope="module")
def target(qwen3):
    return qwen3


@pytest.fixture(scope="module")
def drafter(target):
    d = rj.init_drafter(target.cfg, mask_token_id=127, num_layers=2, block_size=4, target_layer_ids=(0, 1))
    return randomize(d, seed=3)


def test_saved_drafter_loads_in_reference_pytorch_model(drafter, tmp_path):
    rj.save_drafter(drafter, str(tmp_path))
    with open(tmp_path / "config.json") as f:
        cfg = json.load(f)
    assert cfg["architectures"] == ["DFlashDraftModel"]
    assert cfg["dflash_config"] == {"mask_token_id": 127, "target_layer_ids": [0, 1]}
    assert not any(k.startswith("model.") for k in load_file(str(tmp_path / "model.safetensors")))
    ref, info = RefDFlashDraftModel.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_a_draft_vocabulary_leaves_the_official_layout_loadable(drafter, tmp_path):
    from retrace_jax.models.drafter import with_draft_vocab

    rj.save_drafter(with_draft_vocab(drafter, [1, 5, 9, 127]), str(tmp_path))
    ref, info = RefDFlashDraftModel.from_pretrained(str(tmp_path), output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_layers_start_from_target_layers(target, drafter):
    from retrace_jax.models.drafter import init_layers_from_target

    copied = init_layers_from_target(drafter, target, [1, 0])
    slices = target.layer_slices()
    for i, layer in enumerate((1, 0)):
        for name in ("qkv_proj", "o_proj"):
            np.testing.assert_array_equal(np.asarray(getattr(copied.layers[i].self_attn, name).kernel[...]),
                                          np.asarray(slices[layer]["self_attn"][name]["kernel"].get_value()))
        np.testing.assert_array_equal(np.asarray(copied.layers[i].mlp.down_proj.kernel[...]),
                                      np.asarray(slices[layer]["mlp"]["down_proj"]["kernel"].get_value()))
    np.testing.assert_array_equal(np.asarray(copied.fc.kernel[...]), np.asarray(drafter.fc.kernel[...]))  # its own
    assert not np.array_equal(np.asarray(copied.layers[0].self_attn.qkv_proj.kernel[...]),
                              np.asarray(drafter.layers[0].self_attn.qkv_proj.kernel[...]))
    with pytest.raises(ValueError, match="2 layers"):
        init_layers_from_target(drafter, target, [1])
    with pytest.raises(ValueError, match="not among the target's"):
        init_layers_from_target(drafter, target, [0, 9])


def test_the_final_norm_and_the_feature_projection_can_start_from_the_target(target, drafter):
    from retrace_jax.models.drafter import init_around_layers

    target = randomize(target, seed=3)  # final-norm weights other than ones
    same = init_around_layers(drafter, target)
    np.testing.assert_array_equal(np.asarray(same.fc.kernel[...]), np.asarray(drafter.fc.kernel[...]))
    np.testing.assert_array_equal(np.asarray(same.norm.weight[...]), np.asarray(drafter.norm.weight[...]))
    both = init_around_layers(drafter, target, final_norm=True, fc="mean")
    np.testing.assert_array_equal(np.asarray(both.norm.weight[...]), np.asarray(target.norm.weight[...]))
    n, d = drafter.cfg.num_features, drafter.cfg.hidden_size
    feats = jax.random.normal(jax.random.PRNGKey(0), (2, 5, n * d))
    mean = feats.reshape(2, 5, n, d).mean(2)
    np.testing.assert_allclose(np.asarray(both.fc(feats)), np.asarray(mean), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(drafter.fc.kernel[...]), np.asarray(same.fc.kernel[...]))  # a copy
    with pytest.raises(ValueError, match="fc must be one of"):
        init_around_layers(drafter, target, fc="eye")


def test_a_narrower_mlp_starts_from_the_first_neurons_of_the_target_layer(target):
    """``intermediate_size`` below the target's: the attention is copied whole, the MLP from the target's
    first neurons (gate and up columns, down rows in the ``[in, out]`` layout); a wider MLP is refused."""
    from retrace_jax.models.drafter import init_layers_from_target

    width = target.cfg.intermediate_size // 2
    narrow = rj.init_drafter(target.cfg, mask_token_id=127, num_layers=1, intermediate_size=width)
    copied = init_layers_from_target(narrow, target, [1])
    layer = target.layer_slices()[1]
    np.testing.assert_array_equal(np.asarray(copied.layers[0].self_attn.qkv_proj.kernel[...]),
                                  np.asarray(layer["self_attn"]["qkv_proj"]["kernel"].get_value()))
    # gate_up_proj [d, 2, I]: the gate's and the up projection's first neurons
    for name, cut in (("gate_up_proj", np.s_[:, :, :width]), ("down_proj", np.s_[:width])):
        np.testing.assert_array_equal(np.asarray(getattr(copied.layers[0].mlp, name).kernel[...]),
                                      np.asarray(layer["mlp"][name]["kernel"].get_value())[cut], err_msg=name)
    wide = rj.init_drafter(target.cfg, mask_token_id=127, num_layers=1, intermediate_size=2 * target.cfg.intermediate_size)
    with pytest.raises(ValueError, match="has shape"):
        init_layers_from_target(wide, target, [1])


def test_saved_in_bfloat16_loads_close(drafter, target, tmp_path):
    rj.save_drafter(drafter, str(tmp_path), dtype="bfloat16")
    assert json.load(open(tmp_path / "config.json"))["torch_dtype"] == "bfloat16"
    assert {v.dtype for v in load_torch(str(tmp_path / "model.safetensors")).values()} == {torch.bfloat16}
    loaded = rj.load_drafter(str(tmp_path), target)
    for a, b in zip(jax.tree.leaves(nnx.state(drafter, nnx.Param)), jax.tree.leaves(nnx.state(loaded, nnx.Param))):
        assert b.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-2, atol=1e-6)


def test_forward_matches_reference(drafter, tmp_path):
    rj.save_drafter(drafter, str(tmp_path))
    ref = RefDFlashDraftModel.from_pretrained(str(tmp_path)).eval()
    rng = np.random.RandomState(0)
    s, t, d = 6, 4, drafter.cfg.hidden_size
    feats = rng.randn(2, s, 2 * d).astype(np.float32)
    emb = rng.randn(2, t, d).astype(np.float32)
    offset = 5  # context at absolute positions 5..10, block at 11..14
    positions = np.arange(offset, offset + s + t)[None].repeat(2, 0)
    with torch.no_grad():
        want = ref(torch.tensor(emb), torch.tensor(feats), torch.tensor(positions)).numpy()
    ctx_kv = drafter.context_kv(jnp.asarray(feats), jnp.asarray(positions[:, :s]))
    got = drafter.forward(jnp.asarray(emb), jnp.asarray(positions[:, s:]), ctx_kv, jnp.ones((2, t, s + t), bool))
    np.testing.assert_allclose(np.asarray(got), want, atol=TOL, rtol=0)


def test_cached_draft_equals_forward_and_hides_stale_context(drafter):
    """``draft`` over a context cache sees exactly the positions below each row's length."""
    rng = np.random.RandomState(1)
    d = drafter.cfg.hidden_size
    feats = jnp.asarray(rng.randn(2, 7, 2 * d).astype(np.float32))
    emb = jnp.asarray(rng.randn(2, 4, d).astype(np.float32))
    lens = jnp.asarray([5, 7], jnp.int32)
    cache = drafter.extend_cache(feats, drafter.init_cache(2, 16)).replace(lengths=lens)
    got = np.asarray(drafter.draft(emb, cache))
    for b, n in enumerate([5, 7]):
        pos = jnp.arange(n + 4)[None]
        kv = drafter.context_kv(feats[b : b + 1, :n], pos[:, :n])
        want = drafter.forward(emb[b : b + 1], pos[:, n:], kv, jnp.ones((1, 4, n + 4), bool))
        np.testing.assert_allclose(got[b], np.asarray(want[0]), atol=1e-5, rtol=0)


def test_save_load_round_trip(target, drafter, tmp_path):
    rj.save_drafter(drafter, str(tmp_path))
    umask = os.umask(0o022)
    os.umask(umask)
    for name in ("config.json", "model.safetensors"):  # the usual file mode, not private to the writer
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o666 & ~umask, name
    loaded = rj.load_drafter(str(tmp_path), target)
    assert loaded.cfg == drafter.cfg
    for (p, a), (_, b) in zip(nnx.to_flat_state(nnx.state(drafter)), nnx.to_flat_state(nnx.state(loaded))):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(p))
    prompts = [[3, 4, 5], [9]]
    assert rj.generate(target, prompts, 12, drafter=drafter) == rj.generate(target, prompts, 12, drafter=loaded)
    assert rj.load_drafter(str(tmp_path), target, dtype="bfloat16").dtype == jnp.bfloat16


def test_model_prefix_is_accepted(target, drafter, tmp_path):
    rj.save_drafter(drafter, str(tmp_path))
    path = str(tmp_path / "model.safetensors")
    save_file({f"model.{k}": v for k, v in load_file(path).items()}, path)
    loaded = rj.load_drafter(str(tmp_path), target)
    np.testing.assert_array_equal(np.asarray(loaded.fc.kernel[...]), np.asarray(drafter.fc.kernel[...]))


def test_a_tensor_with_and_without_the_model_prefix_is_refused(target, drafter, tmp_path):
    """fc.weight beside model.fc.weight: one of them is stale, and neither may silently win (as a
    directory holding both weight layouts is refused)."""
    rj.save_drafter(drafter, str(tmp_path))
    path = str(tmp_path / "model.safetensors")
    tensors = load_file(path)
    save_file({**tensors, "model.fc.weight": np.zeros_like(tensors["fc.weight"]),
               "model.norm.weight": tensors["norm.weight"]}, path)
    with pytest.raises(rj.CheckpointError, match=(
            rf"{tmp_path}\S* holds both fc\.weight and model\.fc\.weight, norm\.weight and model\.norm\.weight: "
            r"the same tensors with and without the 'model\.' prefix; one of each is stale \(remove it\)")):
        rj.load_drafter(str(tmp_path), target)


def test_drafter_for_another_target_is_refused(target, drafter, tmp_path):
    rj.save_drafter(drafter, str(tmp_path))
    other_cfg = dataclasses.replace(target.cfg, hidden_size=32, num_layers=2, vocab_size=100)
    other = rj.TargetModel(other_cfg, rngs=nnx.Rngs(0))
    with pytest.raises(rj.ConfigError) as err:
        rj.load_drafter(str(tmp_path), other)
    msg = str(err.value)
    for part in ("hidden_size 64 != target hidden_size 32", "num_target_layers 3 != target num_hidden_layers 2",
                 "vocab_size 128 != target vocab_size 100", "mask_token_id 127 outside"):
        assert part in msg


def test_not_a_drafter_directory(target, hf_model_dir, tmp_path):
    with pytest.raises(rj.ConfigError, match="dflash_config"):
        rj.load_drafter(hf_model_dir("qwen3")[1], target)
    with pytest.raises(FileNotFoundError, match="model directory not found: .*missing"):
        rj.load_drafter(str(tmp_path / "missing"), target)


def test_repeated_target_layer_ids_are_kept_with_a_warning(tmp_path):
    """The official formula gives (1, 1) for a 4-layer target and 2 drafter layers: kept, but warned about
    at creation and at loading; distinct ids give no warning."""
    import warnings

    from retrace_jax.models.drafter import default_target_layer_ids
    from retrace_jax.models.tiny import tiny_target

    target = tiny_target()
    assert target.cfg.num_layers == 4
    assert default_target_layer_ids(4, 2) == (1, 1)
    with pytest.warns(UserWarning, match=r"target_layer_ids \[1, 1\] repeat layer\(s\) \[1\]"):
        d = rj.init_drafter(target.cfg, mask_token_id=3, num_layers=2, block_size=4)
    assert d.cfg.target_layer_ids == (1, 1)
    rj.save_drafter(d, str(tmp_path))
    with pytest.warns(UserWarning, match=r"repeat layer\(s\) \[1\]"):
        loaded = rj.load_drafter(str(tmp_path), target)
    assert loaded.cfg.target_layer_ids == (1, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        rj.init_drafter(target.cfg, mask_token_id=3, num_layers=2, block_size=4, target_layer_ids=(0, 2))


def test_a_drafter_with_attention_biases_keeps_those_of_copied_qwen2_layers(hf_model_dir, tmp_path):
    """``attention_bias=True`` (``drafter.attention_bias``): the copied layers of a Qwen2 target keep their
    q/k/v biases (o has none in Qwen2 and stays at zero); the official layout stores them and loads them
    back; without it the biases are left out, as before."""
    from retrace_jax.models.drafter import init_layers_from_target

    _, directory = hf_model_dir("qwen2")
    target = rj.load_target(directory)
    layer = target.layer_slices()[1]["self_attn"]
    biased = init_layers_from_target(rj.init_drafter(target.cfg, mask_token_id=3, num_layers=1,
                                                     attention_bias=True), target, [1])
    want = np.asarray(layer["qkv_proj"]["bias"].get_value())  # [K, H/K + 2, D]: q, k and v biases
    assert all(np.any(want[:, i]) for i in range(want.shape[1]))
    np.testing.assert_array_equal(np.asarray(biased.layers[0].self_attn.qkv_proj.bias[...]), want)
    assert not np.any(np.asarray(biased.layers[0].self_attn.o_proj.bias[...]))
    rj.save_drafter(biased, str(tmp_path))
    assert json.load(open(tmp_path / "config.json"))["attention_bias"] is True
    loaded = rj.load_drafter(str(tmp_path), target)
    np.testing.assert_array_equal(np.asarray(loaded.layers[0].self_attn.qkv_proj.bias[...]),
                                  np.asarray(biased.layers[0].self_attn.qkv_proj.bias[...]))
    plain = init_layers_from_target(rj.init_drafter(target.cfg, mask_token_id=3, num_layers=1), target, [1])
    assert plain.layers[0].self_attn.qkv_proj.bias is None


def test_mlp_activity_matches_transformers_and_picks_the_neurons_a_narrower_mlp_keeps(hf_model_dir, qwen3):
    """TargetModel.mlp_activity is the mean |input of down_proj| of a layer in transformers; a narrower
    drafter MLP started with those scores keeps the most active neurons, in the target's order."""
    from retrace_jax.models.drafter import init_layers_from_target

    hf, _ = hf_model_dir("qwen3")
    tokens = np.random.RandomState(0).randint(0, 120, (2, 10))
    valid = np.ones((2, 10), bool)
    valid[1, 7:] = False  # a shorter second row
    captured = {}
    hook = hf.model.layers[1].mlp.down_proj.register_forward_hook(
        lambda mod, args, out: captured.__setitem__("x", args[0].detach().numpy()))
    try:
        with torch.no_grad():
            hf(torch.as_tensor(tokens), attention_mask=torch.as_tensor(valid.astype(np.int64)))
    finally:
        hook.remove()
    ref = np.abs(captured["x"])[valid].mean(0)
    got = np.asarray(qwen3.mlp_activity(jnp.asarray(tokens), jnp.asarray(valid), 1))
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=1e-6)
    width = qwen3.cfg.intermediate_size // 2
    drafter = rj.init_drafter(qwen3.cfg, mask_token_id=127, num_layers=1, block_size=4, intermediate_size=width)
    chosen = init_layers_from_target(drafter, qwen3, [1], neurons=[got])
    keep = np.sort(np.argsort(-got, kind="stable")[:width])
    layer = qwen3.layer_slices()[1]["mlp"]
    np.testing.assert_array_equal(np.asarray(chosen.layers[0].mlp.gate_up_proj.kernel[...]),
                                  np.asarray(layer["gate_up_proj"]["kernel"].get_value())[:, :, keep])
    np.testing.assert_array_equal(np.asarray(chosen.layers[0].mlp.down_proj.kernel[...]),
                                  np.asarray(layer["down_proj"]["kernel"].get_value())[keep, :])
    assert not np.array_equal(keep, np.arange(width))  # not simply the first neurons
    with pytest.raises(ValueError, match="neuron scores"):
        init_layers_from_target(drafter, qwen3, [1], neurons=[got[:5]])


def test_qk_scales_start_the_norms_at_the_scale_of_the_target_layers_heads(hf_model_dir):
    """TargetModel.layer_statistics' q_rms and k_rms are the mean RMS of a query and a key head vector as
    transformers' q_proj and k_proj give them (biases included); init_layers_from_target starts the drafter's
    q/k norms at them, and refuses scales for a target whose layers have q/k norms of their own."""
    from retrace_jax.models.drafter import init_layers_from_target

    hf, directory = hf_model_dir("qwen2")
    target = rj.load_target(directory)
    tokens = np.random.RandomState(1).randint(0, 120, (2, 9))
    valid = np.ones((2, 9), bool)
    valid[0, 6:] = False
    captured = {}
    attn = hf.model.layers[1].self_attn
    hooks = [proj.register_forward_hook(lambda mod, args, out, n=n: captured.__setitem__(n, out.detach().numpy()))
             for n, proj in (("q", attn.q_proj), ("k", attn.k_proj))]
    try:
        with torch.no_grad():
            hf(torch.as_tensor(tokens), attention_mask=torch.as_tensor(valid.astype(np.int64)))
    finally:
        for h in hooks:
            h.remove()
    stats = target.layer_statistics(jnp.asarray(tokens), jnp.asarray(valid), 1)
    for name in ("q", "k"):
        heads = captured[name].reshape(2, 9, -1, target.cfg.head_dim)
        ref = np.sqrt((heads ** 2).mean(-1)).mean(-1)[valid].mean()
        np.testing.assert_allclose(float(stats[f"{name}_rms"]), ref, rtol=1e-4)
    drafter = rj.init_drafter(target.cfg, mask_token_id=100, num_layers=2, block_size=4)
    scaled = init_layers_from_target(drafter, target, [0, 1], qk_scales=[(2.0, 3.0), (float(stats["q_rms"]), 0.5)])
    for layer, (q, k) in zip(scaled.layers, [(2.0, 3.0), (float(stats["q_rms"]), 0.5)]):
        np.testing.assert_array_equal(np.asarray(layer.self_attn.q_norm.weight[...]), np.full(target.cfg.head_dim, q,
                                                                                              np.float32))
        np.testing.assert_array_equal(np.asarray(layer.self_attn.k_norm.weight[...]), np.full(target.cfg.head_dim, k,
                                                                                              np.float32))
    np.testing.assert_array_equal(np.asarray(drafter.layers[0].self_attn.q_norm.weight[...]), 1.0)  # a copy
    with pytest.raises(ValueError, match="2 q/k scales for 1 layers"):
        init_layers_from_target(rj.init_drafter(target.cfg, mask_token_id=100, num_layers=1), target, [1],
                                qk_scales=[(1.0, 1.0)] * 2)
    qwen3 = rj.load_target(hf_model_dir("qwen3")[1])
    with pytest.raises(ValueError, match="q/k norms of their own"):
        init_layers_from_target(rj.init_drafter(qwen3.cfg, mask_token_id=100, num_layers=1), qwen3, [1],
                                qk_scales=[(1.0, 1.0)])
