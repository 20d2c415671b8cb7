"""Loading Hugging Face checkpoints: sharded files, and clear errors for what does not fit."""

import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import retrace_jax as rj
from tests.helpers import copy_model_dir, edit_config, edit_tensors, make_hf_model, save_hf_model


@pytest.fixture
def qwen3_copy(hf_model_dir, tmp_path):
    return copy_model_dir(hf_model_dir("qwen3")[1], tmp_path / "model")


def test_sharded_checkpoint_loads_identically(hf_model_dir, tmp_path):
    model, directory = hf_model_dir("qwen3")
    sharded = save_hf_model(model, str(tmp_path / "sharded"), max_shard_size="100KB")
    assert os.path.exists(os.path.join(sharded, "model.safetensors.index.json"))
    a, b = rj.load_target(directory), rj.load_target(sharded)
    leaves_a, leaves_b = (nnx.to_flat_state(nnx.state(m)) for m in (a, b))
    assert [p for p, _ in leaves_a] == [p for p, _ in leaves_b]
    for (path, x), (_, y) in zip(leaves_a, leaves_b):
        np.testing.assert_array_equal(np.asarray(x.get_value()), np.asarray(y.get_value()), err_msg=str(path))


def test_missing_directory_and_files(tmp_path, qwen3_copy):
    with pytest.raises(FileNotFoundError, match="not found"):
        rj.load_target(str(tmp_path / "nope"))
    os.remove(os.path.join(qwen3_copy, "model.safetensors"))
    with pytest.raises(FileNotFoundError, match="no model.safetensors"):
        rj.load_target(qwen3_copy)
    os.remove(os.path.join(qwen3_copy, "config.json"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        rj.load_target(qwen3_copy)


def test_missing_shard_file(hf_model_dir, tmp_path):
    model, _ = hf_model_dir("qwen3")
    sharded = save_hf_model(model, str(tmp_path / "sharded"), max_shard_size="100KB")
    shard = sorted(f for f in os.listdir(sharded) if f.endswith(".safetensors"))[0]
    os.remove(os.path.join(sharded, shard))
    with pytest.raises(FileNotFoundError, match=shard):
        rj.load_target(sharded)


def test_unsupported_model_type(qwen3_copy):
    edit_config(qwen3_copy, lambda c: c.update(model_type="mistral"))
    with pytest.raises(rj.ConfigError, match="model_type: must be 'qwen3', 'qwen2' or 'llama', got 'mistral'"):
        rj.load_target(qwen3_copy)


def test_unsupported_rope_scaling(qwen3_copy):
    edit_config(qwen3_copy, lambda c: c.update(rope_parameters={"rope_type": "yarn", "factor": 4.0}))
    with pytest.raises(rj.ConfigError, match="yarn"):
        rj.load_target(qwen3_copy)


def test_missing_and_extra_tensors(qwen3_copy):
    def edit(t):
        t["model.extra.weight"] = np.zeros((2,), np.float32)
        del t["model.layers.1.mlp.up_proj.weight"]

    edit_tensors(qwen3_copy, edit)
    with pytest.raises(rj.CheckpointError, match=r"missing tensors model.layers.1.mlp.up_proj.weight.*model.extra.weight"):
        rj.load_target(qwen3_copy)


def test_wrong_shape(qwen3_copy):
    edit_tensors(qwen3_copy, lambda t: t.update({"model.layers.0.self_attn.k_proj.weight": np.zeros((32, 64), np.float32)}))
    with pytest.raises(rj.CheckpointError, match=r"k_proj.weight has shape \(32, 64\), the config implies \(64, 64\)"):
        rj.load_target(qwen3_copy)


def test_rope_theta_under_rope_parameters_and_top_level():
    base = dict(model_type="qwen3", vocab_size=8, hidden_size=8, intermediate_size=8, num_hidden_layers=1,
                num_attention_heads=2)
    assert rj.ModelConfig.from_hf({**base, "rope_theta": 5.0}).rope_theta == 5.0
    assert rj.ModelConfig.from_hf({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 7.0}}).rope_theta == 7.0
    with pytest.raises(rj.ConfigError, match="num_hidden_layers"):
        rj.ModelConfig.from_hf({k: v for k, v in base.items() if k != "num_hidden_layers"})


def test_bad_dtype(qwen3_copy):
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        rj.load_target(qwen3_copy, dtype="float16")


def test_bfloat16_checkpoint(tmp_path):
    model = make_hf_model("qwen2").to(dtype=__import__("torch").bfloat16)
    directory = save_hf_model(model, str(tmp_path / "bf16"))
    target = rj.load_target(directory, dtype="bfloat16")
    assert target.embed_tokens.embedding.dtype == jnp.bfloat16
    assert rj.load_target(directory).embed_tokens.embedding.dtype == jnp.float32


def test_model_config_to_hf_round_trips(family):
    cfg = rj.ModelConfig.from_hf(make_hf_model(family).config.to_dict())
    assert rj.ModelConfig.from_hf(cfg.to_hf()) == cfg


def test_model_config_to_hf_refuses_what_the_family_cannot_express():
    import dataclasses

    from retrace_jax.models.tiny import TINY_QWEN3

    with pytest.raises(rj.ConfigError, match="qk_norm"):
        dataclasses.replace(TINY_QWEN3, model_type="llama").to_hf()
    with pytest.raises(rj.ConfigError, match="attention_bias"):
        dataclasses.replace(TINY_QWEN3, qkv_bias=True).to_hf()


def test_save_target_round_trips_and_transformers_agrees(family, hf_model_dir, tmp_path):
    """A loaded checkpoint saved again loads to the same parameters here and in transformers (float32
    logits agree); the save keeps other files (a tokenizer) and replaces the weights atomically."""
    import torch
    import transformers

    _, directory = hf_model_dir(family)
    target = rj.load_target(directory, dtype="float32")
    out = str(tmp_path / "saved")
    os.makedirs(out)
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        f.write("{}")
    rj.save_target(target, out, extra_config={"eos_token_id": 2})
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors", "tokenizer.json"]
    again = rj.load_target(out, dtype="float32")
    for (p, a), (_, b) in zip(nnx_flat(target), nnx_flat(again)):
        np.testing.assert_array_equal(a, b, err_msg=str(p))
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert hf.config.eos_token_id == 2
    tokens = [[3, 17, 5, 99, 42, 8]]
    with torch.no_grad():
        ref = hf(torch.tensor(tokens)).logits.numpy()
    mine = again(jnp.asarray(tokens), again.init_cache(1, 6), attention="dense")
    np.testing.assert_allclose(np.asarray(again.logits(mine.hidden)), ref, atol=2e-5, rtol=2e-5)


def test_save_target_bfloat16_halves_the_file(hf_model_dir, tmp_path):
    target = rj.load_target(hf_model_dir("qwen3")[1], dtype="float32")
    rj.save_target(target, str(tmp_path / "f32"))
    rj.save_target(target, str(tmp_path / "bf16"), dtype="bfloat16")
    size = lambda d: os.path.getsize(os.path.join(tmp_path, d, "model.safetensors"))  # noqa: E731
    assert size("bf16") < 0.55 * size("f32")
    assert rj.load_target(str(tmp_path / "bf16"), dtype="bfloat16").embed_tokens.embedding.dtype == jnp.bfloat16


def nnx_flat(module):
    from flax import nnx

    return [(p, np.asarray(v.get_value())) for p, v in nnx.to_flat_state(nnx.state(module, nnx.Param))]


# ------------------------------------------------------------------------ what a fault probe found


def _tiny(num_layers=2):
    """A small random target (the tiny Qwen3 at ``num_layers`` layers) and its drafter."""
    import dataclasses

    from retrace_jax.models.tiny import TINY_QWEN3

    target = rj.tiny.tiny_target(cfg=dataclasses.replace(TINY_QWEN3, num_layers=num_layers))
    return target, rj.init_drafter(target.cfg, mask_token_id=5, num_layers=1, block_size=4)


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.bool_])
def test_a_weight_stored_as_integers_or_bools_is_refused(dtype, tmp_path):
    """A norm weight of the right shape but an integer or bool type is refused by name (file and tensor),
    not cast to float (int8 3 would load as 3.0)."""
    target, drafter = _tiny()
    rj.save_target(target, str(tmp_path / "t"))
    rj.save_drafter(drafter, str(tmp_path / "d"))
    edit_tensors(str(tmp_path / "t"), lambda t: t.update({"model.norm.weight": np.full((128,), 3, dtype)}))
    edit_tensors(str(tmp_path / "d"), lambda t: t.update({"norm.weight": np.full((128,), 3, dtype)}))
    kind = {np.int8: "I8", np.int32: "I32", np.bool_: "BOOL"}[dtype]
    with pytest.raises(rj.CheckpointError, match=rf"model.norm.weight in .*t.*model.safetensors is stored as {kind}"):
        rj.load_target(str(tmp_path / "t"))
    with pytest.raises(rj.CheckpointError, match=rf"norm.weight in .*d.*model.safetensors is stored as {kind}"):
        rj.load_drafter(str(tmp_path / "d"), target)


def _count_blocks(monkeypatch, refuse: bool = False) -> list:
    """Counts the decoder blocks built from here on (each is one walk over a block's graph); with
    ``refuse``, building one fails the test at once."""
    from retrace_jax.models import layers

    built, init = [], layers.DecoderBlock.__init__

    def counted(self, *args, **kwargs):
        built.append(1)
        if refuse:
            raise AssertionError("a decoder block was built")
        init(self, *args, **kwargs)

    monkeypatch.setattr(layers.DecoderBlock, "__init__", counted)
    return built


def test_loading_a_target_builds_one_block_whatever_its_depth(tmp_path, monkeypatch):
    """The loader's abstract target costs the same whatever the number of layers (building every block
    under ``nnx.eval_shape`` grew quadratically: 12.7 s at 64 layers), and holds the saved weights."""
    saved = {}
    for layers in (2, 6):
        target, _ = _tiny(layers)
        rj.save_target(target, str(tmp_path / str(layers)))
        saved[layers] = target
    built = _count_blocks(monkeypatch)
    for layers, target in saved.items():
        built.clear()
        loaded = rj.load_target(str(tmp_path / str(layers)))
        assert len(built) == 1, (layers, len(built))
        assert loaded.cfg == target.cfg
        for (p, a), (q, b) in zip(nnx_flat(target), nnx_flat(loaded)):
            assert p == q
            np.testing.assert_array_equal(a, b, err_msg=str(p))


@pytest.mark.parametrize("layers", [100000, 10**12])
def test_a_config_claiming_layers_its_checkpoint_lacks_is_refused_before_building(layers, tmp_path, monkeypatch):
    """A hostile ``num_hidden_layers`` is refused by the tensor names alone, at once, before any block is
    built (it used to build the abstract model first: a hang); the error names the missing layers."""
    import time

    target, drafter = _tiny(2)
    rj.save_target(target, str(tmp_path / "t"))
    rj.save_drafter(drafter, str(tmp_path / "d"))
    edit_config(str(tmp_path / "t"), lambda c: c.update(num_hidden_layers=layers))
    edit_config(str(tmp_path / "d"), lambda c: [c.update(num_hidden_layers=layers), c.pop("layer_types")])
    built = _count_blocks(monkeypatch, refuse=True)
    start = time.perf_counter()
    with pytest.raises(rj.CheckpointError, match=rf"num_hidden_layers {layers} .*missing layers 2..{layers - 1}"):
        rj.load_target(str(tmp_path / "t"))
    with pytest.raises(rj.CheckpointError, match=rf"num_hidden_layers {layers} .*missing layers 1..{layers - 1}"):
        rj.load_drafter(str(tmp_path / "d"), target)
    assert time.perf_counter() - start < 1.0 and not built


def test_layers_missing_in_the_middle_or_beyond_the_config_are_named(tmp_path):
    target, _ = _tiny(6)
    rj.save_target(target, str(tmp_path / "t"))
    edit_tensors(str(tmp_path / "t"), lambda t: [t.pop(n) for n in list(t) if n.startswith(("model.layers.2.",
                                                                                           "model.layers.3."))])
    with pytest.raises(rj.CheckpointError, match=r"num_hidden_layers 6 .*missing layers 2..3"):
        rj.load_target(str(tmp_path / "t"))
    edit_config(str(tmp_path / "t"), lambda c: c.update(num_hidden_layers=2))
    with pytest.raises(rj.CheckpointError, match=r"num_hidden_layers 2 .*unexpected layers 4, 5"):
        rj.load_target(str(tmp_path / "t"))


def test_a_deeply_nested_config_or_index_is_a_clear_error(qwen3_copy):
    """JSON nested 100000 deep makes the decoder run out of recursion: a ``ConfigError`` (config.json) or
    ``CheckpointError`` (the index file) naming the file, not a ``RecursionError``."""
    deep = '{"a": ' * 100000 + "1" + "}" * 100000
    config = os.path.join(qwen3_copy, "config.json")
    with open(config) as f:
        text = f.read()
    with open(config, "w") as f:
        f.write(deep)
    with pytest.raises(rj.ConfigError, match=f"{config} is nested too deeply"):
        rj.load_target(qwen3_copy)
    with open(config, "w") as f:
        f.write(text)
    os.remove(os.path.join(qwen3_copy, "model.safetensors"))
    index = os.path.join(qwen3_copy, "model.safetensors.index.json")
    with open(index, "w") as f:
        f.write(deep)
    with pytest.raises(rj.CheckpointError, match=f"{index} is nested too deeply"):
        rj.load_target(qwen3_copy)


@pytest.fixture(scope="module")
def tiny_drafter_dir(tmp_path_factory):
    target = rj.tiny.tiny_target()
    path = str(tmp_path_factory.mktemp("drafter"))
    rj.save_drafter(rj.init_drafter(target.cfg, mask_token_id=511, num_layers=1, block_size=4), path)
    return target, path


@pytest.mark.parametrize("retrace, error", [
    ("no", r"load_drafter: retrace: expected true or false, got 'no'"),
    ("false", r"load_drafter: retrace: expected true or false, got 'false'"),
    (0, r"load_drafter: retrace: expected true or false, got 0"),
    (1, r"load_drafter: retrace: expected true or false, got 1"),
    ("ReTraceConfig", r"load_drafter: retrace: expected true or false, got 'ReTraceConfig'"),
])
def test_load_drafter_takes_retrace_as_strictly_as_generate_takes_use_retrace(tiny_drafter_dir, retrace, error):
    """retrace="no" loaded a ReTrace drafter (any truthy value did), while retrace=0 loaded DFlash."""
    target, path = tiny_drafter_dir
    with pytest.raises(TypeError, match=error):
        rj.load_drafter(path, target, retrace=retrace)
    with pytest.raises(TypeError, match=error.replace("load_drafter: retrace", "generate: use_retrace")):
        rj.generate(target, [[1, 2]], 2, use_retrace=retrace)


def test_load_drafter_takes_a_bool_none_or_a_retrace_config(tiny_drafter_dir):
    target, path = tiny_drafter_dir
    assert rj.load_drafter(path, target).cfg.retrace is None
    assert rj.load_drafter(path, target, retrace=np.False_).cfg.retrace is None
    assert rj.load_drafter(path, target, retrace=True).cfg.retrace == rj.ReTraceConfig()
    assert rj.load_drafter(path, target, retrace=rj.ReTraceConfig(rank=4)).cfg.retrace == rj.ReTraceConfig(rank=4)


@pytest.mark.parametrize("target", [None, "tiny", {}])
def test_load_drafter_without_a_target_model_names_the_argument(tiny_drafter_dir, target):
    """rj.load_drafter(path, None) raised AttributeError: 'NoneType' object has no attribute 'dtype'."""
    with pytest.raises(TypeError, match=rf"^load_drafter: target must be a TargetModel \(rj.load_target, "
                                        rf"rj.tiny.tiny_target\), got {type(target).__name__}$"):
        rj.load_drafter(tiny_drafter_dir[1], target)


def _tensors(directory):
    from safetensors.numpy import load_file

    return load_file(os.path.join(directory, "model.safetensors"))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_load_then_save_gives_back_every_tensor_byte_for_byte(family, dtype, hf_model_dir, tmp_path):
    """The parameters join q/k/v and gate/up (one product each); the checkpoint keeps transformers'
    separate tensors, which a load and a save give back bit for bit (names, types, shapes, bytes)."""
    _, directory = hf_model_dir(family)
    source = directory
    if dtype == "bfloat16":  # a checkpoint stored in bfloat16, loaded and saved in bfloat16
        source = str(tmp_path / "bf16")
        rj.save_target(rj.load_target(directory, dtype="float32"), source, dtype="bfloat16")
    out = str(tmp_path / "saved")
    rj.save_target(rj.load_target(source, dtype=dtype), out, dtype=dtype)
    want, got = _tensors(source), _tensors(out)
    assert sorted(got) == sorted(want)
    for name, a in want.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape, name
        assert got[name].tobytes() == a.tobytes(), name


def test_an_official_dflash_checkpoint_loads_and_saves_byte_for_byte(hf_model_dir, tmp_path):
    """A drafter written by the official layout's PyTorch model (with attention biases: q/k/v/o), loaded
    and saved again: the same tensors, bit for bit."""
    from tests.dflash_reference import RefDFlashDraftModel
    from tests.helpers import randomize

    target = rj.load_target(hf_model_dir("qwen3")[1])
    ours = randomize(rj.init_drafter(target.cfg, mask_token_id=127, num_layers=2, block_size=4,
                                     attention_bias=True), seed=5)
    rj.save_drafter(ours, str(tmp_path / "ours"))
    official = str(tmp_path / "official")
    RefDFlashDraftModel.from_pretrained(str(tmp_path / "ours")).save_pretrained(official, safe_serialization=True)
    out = str(tmp_path / "saved")
    rj.save_drafter(rj.load_drafter(official, target), out)
    want, got = _tensors(official), _tensors(out)
    assert sorted(got) == sorted(want) and any(n.endswith("k_proj.bias") for n in want)
    for name, a in want.items():
        assert got[name].dtype == a.dtype and got[name].shape == a.shape, name
        assert got[name].tobytes() == a.tobytes(), name
