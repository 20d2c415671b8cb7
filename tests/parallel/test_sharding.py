"""Sharded inference. The multi-device checks run in their own process (XLA_FLAGS must be set before
jax is imported): a 4-device one in the default suite, the 8-device ones marked slow; mesh parsing and
rules are checked here."""

import os
import subprocess
import sys

import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import retrace_jax as rj
from retrace_jax.parallel.sharding import partition_spec

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def _run_with_devices(script, tmp_path, devices=8, args=()):
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, os.path.join(HERE, script), str(tmp_path), *args], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert proc.stdout.strip().endswith("ok")
    return proc.stdout


def test_sharded_generation_on_4_cpu_devices(tmp_path):
    """The default suite's multi-device check: one mesh with both a data and a tensor axis, a drafter whose
    rounds accept every length (tests/oracle.py)."""
    out = _run_with_devices("sharded_check.py", tmp_path, 4, ["--devices", "4", "--mesh", "data=2,tensor=2",
                                                               "--methods", "plain,oracle"])
    assert out.count("equal the single-device run") == 1


@pytest.mark.slow  # about 35 s of CPU
def test_a_stream_on_2_cpu_devices(tmp_path):
    """generate(slots=...) sharded over the data axis: a refilled slot's prefill writes one row of caches
    split over the devices; the stream equals the static batch and the single-device stream."""
    out = _run_with_devices("sharded_check.py", tmp_path, 2, ["--devices", "2", "--mesh", "data=2",
                                                               "--methods", "stream,stream_plain"])
    assert out.count("equal the single-device run") == 1


@pytest.mark.slow
def test_sharded_generation_on_8_cpu_devices(tmp_path):
    assert _run_with_devices("sharded_check.py", tmp_path).count("equal the single-device run") == 4


@pytest.mark.slow
def test_sharded_train_step_on_8_cpu_devices(tmp_path):
    assert _run_with_devices("sharded_train_check.py", tmp_path).count("mesh step equals one device") == 2


def test_make_mesh_specs():
    mesh = rj.make_mesh("data=1")
    assert dict(mesh.shape) == {"data": 1, "fsdp": 1, "tensor": 1}
    assert dict(rj.make_mesh({"data": np.int64(1)}).shape)["data"] == 1  # NumPy integers are sizes too
    with pytest.raises(ValueError, match="unknown mesh axis 'model'"):
        rj.make_mesh("model=1")
    with pytest.raises(ValueError, match="needs 4 devices"):
        rj.make_mesh("data=2,tensor=2")
    with pytest.raises(ValueError, match="look like"):
        rj.make_mesh("tensor")
    with pytest.raises(ValueError, match="mesh axis 'data' is named twice"):
        rj.make_mesh("data=1,data=1")


def test_rules_replicate_what_does_not_divide():
    class FakeMesh:
        shape = {"data": 2, "fsdp": 1, "tensor": 4}

    assert partition_spec(("embed", "heads"), (64, 128), FakeMesh()) == P(None, "tensor")
    assert partition_spec(("vocab", "embed"), (130, 64), FakeMesh()) == P(None, None)  # 130 % 4 != 0
    assert partition_spec(("batch", None), (6, 3), FakeMesh()) == P("data", None)
