"""Orbax training checkpoints when the disk is full: one clear OSError, not Orbax's background failures."""

import errno
import os
from collections import namedtuple

import jax.numpy as jnp
import pytest

from retrace_jax.training import checkpoints as ckpt_module
from retrace_jax.training.checkpoints import Checkpoints

STATE = {"w": jnp.arange(4096, dtype=jnp.float32)}  # 16 KiB
OPT = {"mu": jnp.zeros(4096, jnp.float32)}
Usage = namedtuple("Usage", "total used free")


def test_a_checkpoint_larger_than_the_free_space_is_refused_before_orbax_writes(tmp_path, monkeypatch):
    ckpts = Checkpoints(str(tmp_path / "checkpoints"), async_save=False)
    ckpts.save(1, STATE, OPT, {"seed": 0})
    monkeypatch.setattr(ckpt_module.shutil, "disk_usage", lambda path: Usage(1 << 30, 1 << 30, 1_000_000))
    with pytest.raises(OSError) as err:
        ckpts.save(2, STATE, OPT, {"seed": 0})
    assert err.value.errno == errno.ENOSPC
    assert str(err.value) == (f"no space left on device for checkpoint 2 in {tmp_path}/checkpoints: it needs "
                              f"about 1.03 MiB, 0.95 MiB are free")
    ckpts.close()
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["1"]


def test_orbax_failing_on_a_full_disk_is_one_os_error(tmp_path, monkeypatch):
    """Orbax raises a ValueError whose text holds the errno; saving and closing turn it into an OSError."""
    ckpts = Checkpoints(str(tmp_path / "checkpoints"), async_save=False)
    full = ValueError('RESOURCE_EXHAUSTED: Error writing "params.w/0" in OCDBT database at local file "..." '
                      "Failed to write 213404 bytes to file 15: No space left on device [os_error_code='28']")

    def fail(*args, **kwargs):
        raise full

    monkeypatch.setattr(ckpts.manager, "save", fail)
    with pytest.raises(OSError) as err:
        ckpts.save(1, STATE, OPT, {})
    assert err.value.errno == errno.ENOSPC
    assert str(err.value) == f"checkpoint 1 in {tmp_path}/checkpoints could not be written: No space left on device"
    monkeypatch.setattr(ckpts.manager, "wait_until_finished", fail)  # the failure of an asynchronous save
    with pytest.raises(OSError, match=r"checkpoint 1 in .* could not be written: No space left on device$"):
        ckpts.close()
    monkeypatch.setattr(ckpts.manager, "wait_until_finished", lambda: None)
    other = ValueError("something else")
    monkeypatch.setattr(ckpts.manager, "save", lambda *a, **k: (_ for _ in ()).throw(other))
    with pytest.raises(ValueError, match="something else"):  # what is not a full disk stays as it was
        ckpts.save(2, STATE, OPT, {})


def _separate_state(state):
    """A drafter state (or moments) as checkpoints held it before q/k/v and gate/up were joined: the
    ``nnx.Linear`` parameters ``q_proj``, ``k_proj``... (kernels ``[d, out]``, biases ``[out]``)."""
    from flax import nnx

    from retrace_jax.models.layers import JOINED, separate_projections

    items = []
    for path, var in nnx.to_flat_state(state):
        if path[-2] in JOINED:
            parts = separate_projections(path[-2], var.get_value())
            items += [(path[:-2] + (n, path[-1]), var.replace(p)) for n, p in zip(JOINED[path[-2]], parts)]
        else:
            items.append((path, var))
    return nnx.from_flat_state(items)


def test_a_checkpoint_of_separate_projections_restores_joined_with_a_warning(tmp_path):
    """Training checkpoints written before the joining (parameters and AdamW moments with separate q/k/v
    and gate/up) restore into the joined layout, the same values, with a deprecation warning; the
    separate layout is checked against the weight table's (HF) tensors of the same drafter."""
    import jax
    import numpy as np
    from flax import nnx

    import retrace_jax as rj
    from retrace_jax.io.weights import export_tensors, model_specs
    from retrace_jax.models.tiny import tiny_target
    from retrace_jax.training.step import adamw, init_opt_state
    from tests.helpers import randomize

    target = tiny_target()
    drafter = randomize(rj.init_drafter(target.cfg, mask_token_id=5, num_layers=2, block_size=4,
                                        target_layer_ids=(0, 2), attention_bias=True), seed=2)
    _, params, _ = nnx.split(drafter, nnx.Param, ...)
    optimizer = adamw(1e-3, 10)
    opt = init_opt_state(optimizer, params)
    adam = opt[1][0]
    opt = (opt[0], (adam._replace(mu=jax.tree.map(lambda x: 0.5 * x, params),
                                  nu=jax.tree.map(lambda x: x * x, params)),) + opt[1][1:])
    old = Checkpoints(str(tmp_path / "c"), async_save=False)
    separate = _separate_state(params)
    hf = export_tensors(drafter, model_specs(drafter))  # the separate tensors as the official layout has them
    for name in ("q_proj", "k_proj", "v_proj"):
        np.testing.assert_array_equal(np.asarray(separate["layers"][1]["self_attn"][name]["kernel"].get_value()),
                                      hf[f"layers.1.self_attn.{name}.weight"].T)
        np.testing.assert_array_equal(np.asarray(separate["layers"][1]["self_attn"][name]["bias"].get_value()),
                                      hf[f"layers.1.self_attn.{name}.bias"])
    np.testing.assert_array_equal(np.asarray(separate["layers"][0]["mlp"]["up_proj"]["kernel"].get_value()),
                                  hf["layers.0.mlp.up_proj.weight"].T)
    old.save(3, separate, jax.tree.map(lambda x: _separate_state(x) if isinstance(x, nnx.State) else x, opt,
                                       is_leaf=lambda x: isinstance(x, nnx.State)), {"seed": 0})
    old.close()
    fresh = nnx.split(rj.init_drafter(target.cfg, mask_token_id=5, num_layers=2, block_size=4,
                                      target_layer_ids=(0, 2), attention_bias=True, seed=9), nnx.Param, ...)[1]
    warnings = []
    ckpts = Checkpoints(str(tmp_path / "c"), read_only=True)
    got, got_opt, meta = ckpts.restore(3, fresh, init_opt_state(optimizer, fresh), warn=warnings.append)
    ckpts.close()
    assert meta["seed"] == 0
    assert any("separate q/k/v and gate/up" in w and "deprecated" in w for w in warnings), warnings
    for want, have in ((params, got), (opt, got_opt)):
        a, b = jax.tree.leaves(want), jax.tree.leaves(have)
        assert jax.tree.structure(want) == jax.tree.structure(have) and len(a) == len(b)
        for x, y in zip(a, b):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
