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
