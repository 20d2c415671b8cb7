"""Training checkpoints that changed on disk, resumes with another drafter shape, and a refused resume
that exits at once: a changed byte is found by the checksums recorded at save time (Orbax would restore
it), the changed setting is named, and nothing of Orbax's is left running to print a traceback at exit."""

import hashlib
import os
import subprocess
import sys
import time

import jax.numpy as jnp
import numpy as np
import pytest
import yaml

import retrace_jax as rj
from retrace_jax.models.drafter import drafter_config
from retrace_jax.models.tiny import TINY_QWEN3
from retrace_jax.training.checkpoints import CHECKSUMS, Checkpoints
from retrace_jax.training.config import load_config
from retrace_jax.training.loop import check_resume, restore_newest_readable, run_settings

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _state(value):
    return {"w": jnp.full(4096, value, jnp.float32)}, {"mu": jnp.full(4096, -value, jnp.float32)}


def _saved(directory, steps=(1, 2), async_save=True):
    ckpts = Checkpoints(str(directory), async_save=async_save)
    for step in steps:
        ckpts.save(step, *_state(float(step)), {"seed": 0})
    ckpts.close()
    return str(directory)


def _largest_file(step_dir):
    """The largest file of the arrays' data (OCDBT's data files): one Orbax reads without complaint when
    its bytes change."""
    files = [os.path.join(d, f) for d, _, names in os.walk(step_dir) for f in names
             if os.path.basename(os.path.dirname(d)).startswith("ocdbt.process_")]
    return max(files, key=os.path.getsize)


def _flip_bytes(path, n=64):
    """Overwrites ``n`` bytes in the middle of ``path`` with their complement (the size stays)."""
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        data = f.read(n)
        f.seek(os.path.getsize(path) // 2)
        f.write(bytes(255 - b for b in data))


def test_every_file_is_recorded_once_an_asynchronous_save_has_finished(tmp_path):
    """In sha256sum's format, in the committed step directory; recorded by poll() without waiting, as
    the training loop calls it, and the files still match after a restore and on another reader."""
    ckpts = Checkpoints(str(tmp_path / "c"), async_save=True)
    ckpts.save(1, *_state(1.0), {"seed": 0})
    path = tmp_path / "c" / "1" / CHECKSUMS
    deadline = time.monotonic() + 60
    while not path.exists():
        assert time.monotonic() < deadline, "the finished save's checksums were never recorded"
        time.sleep(0.05)
        ckpts.poll()
    listed = dict(reversed(line.split("  ", 1)) for line in path.read_text().splitlines())
    files = {os.path.relpath(os.path.join(d, f), tmp_path / "c" / "1")
             for d, _, names in os.walk(tmp_path / "c" / "1") for f in names} - {CHECKSUMS}
    assert set(listed) == files and any(name.startswith("state/") for name in files)
    for name, digest in listed.items():
        assert hashlib.sha256((tmp_path / "c" / "1" / name).read_bytes()).hexdigest() == digest, name
    assert ckpts.verify(1) is True
    params, opt, _ = ckpts.restore(1, *_state(0.0))
    ckpts.close()
    np.testing.assert_array_equal(params["w"], np.full(4096, 1.0))
    np.testing.assert_array_equal(opt["mu"], np.full(4096, -1.0))
    reader = Checkpoints(str(tmp_path / "c"), read_only=True)
    assert reader.verify(1) is True
    reader.close()


def test_a_changed_byte_sets_the_newest_checkpoint_aside_and_the_one_before_restores(tmp_path):
    """64 bytes overwritten in the newest checkpoint (same size): Orbax would restore it without an error;
    the checksums make it unreadable, named in a warning, set aside, and the one before is restored."""
    directory = _saved(tmp_path / "c")
    _flip_bytes(_largest_file(tmp_path / "c" / "2"))
    records = []
    ckpts = Checkpoints(directory)
    try:
        step, params, opt = restore_newest_readable(ckpts, *_state(0.0), {"seed": 0}, str(tmp_path), records.append)
    finally:
        ckpts.close()
    assert step == 1
    np.testing.assert_array_equal(params["w"], np.full(4096, 1.0))
    np.testing.assert_array_equal(opt["mu"], np.full(4096, -1.0))
    [warning] = [r["message"] for r in records if r.get("event") == "warning"]
    assert warning.startswith(f"checkpoint 2 in {directory} cannot be read (its files differ from the checksums "
                              f"recorded when it was saved: state/"), warning
    assert warning.endswith(f"resuming from step 1, the newest readable one; it is moved to {directory}/2.unreadable")
    assert sorted(os.listdir(directory)) == ["1", "2.unreadable"]


def test_a_changed_or_missing_file_is_a_checkpoint_error_naming_it(tmp_path):
    directory = _saved(tmp_path / "c")
    os.remove(tmp_path / "c" / "2" / "meta" / "metadata")
    _flip_bytes(_largest_file(tmp_path / "c" / "1"), n=1)
    ckpts = Checkpoints(directory, read_only=True)
    with pytest.raises(rj.CheckpointError, match=r"checkpoint 2 .* cannot be read \(its files differ from the "
                                                 r"checksums recorded when it was saved: meta/metadata \(missing\)\)"):
        ckpts.restore(2, *_state(0.0))
    with pytest.raises(rj.CheckpointError, match=r"checkpoint 1 .*: state/"):
        ckpts.verify(1)
    ckpts.close()


def test_a_checkpoint_without_checksums_restores_with_a_warning(tmp_path):
    """An earlier release's checkpoint (no SHA256SUMS) is restored as before, with a warning that it is
    not checked."""
    directory = _saved(tmp_path / "c", async_save=False)
    os.remove(tmp_path / "c" / "2" / CHECKSUMS)
    warnings = []
    ckpts = Checkpoints(directory)
    assert ckpts.verify(2) is False
    params, opt, meta = ckpts.restore(2, *_state(0.0), warn=warnings.append)
    ckpts.close()
    np.testing.assert_array_equal(params["w"], np.full(4096, 2.0))
    np.testing.assert_array_equal(opt["mu"], np.full(4096, -2.0))
    assert meta["step"] == 2
    assert warnings == [f"checkpoint 2 in {directory} records no checksums (an earlier release wrote it, or its run "
                        f"ended before recording them): it is restored without checking its files"]


def test_a_resume_with_another_intermediate_size_names_it_before_restoring(tmp_path):
    """The drafter's MLP width is a run setting: a resume with another is refused naming it, not as a
    checkpoint that cannot be read (Orbax's "Requested shape ...")."""
    cfg = load_config(os.path.join(ROOT, "configs", "tiny_dflash.yaml"))

    def settings(width):
        return run_settings(cfg, drafter_config(TINY_QWEN3, mask_token_id=511, num_layers=2, block_size=8,
                                                target_layer_ids=[1, 2], intermediate_size=width), 100)

    ckpts = Checkpoints(str(tmp_path / "c"), async_save=False)
    ckpts.save(3, *_state(1.0), settings(None))  # the target's width, 256
    check_resume(ckpts, 3, settings(256), str(tmp_path))
    with pytest.raises(rj.ConfigError) as err:
        check_resume(ckpts, 3, settings(128), str(tmp_path))
    ckpts.close()
    assert "(intermediate_size: 256 then, 128 now)" in str(err.value), err.value


def test_a_refused_resume_leaves_nothing_of_orbax_running_at_exit(tmp_path):
    """Orbax removes unfinished saves' directories in a background thread when the checkpoints open; a
    run that is refused right after (another setting) used to exit while that thread still ran, which
    then printed a 50-line traceback ("cannot schedule new futures after shutdown") after the error."""
    directory = tmp_path / "c"
    for i in range(300):  # unfinished saves: the background clean-up takes a while
        os.makedirs(directory / f"{i}.orbax-checkpoint-tmp-{i}" / "x")
    script = ("import os, sys\n"
              "from retrace_jax.training.checkpoints import Checkpoints\n"
              "ckpts = Checkpoints(sys.argv[1])\n"
              "left = len(os.listdir(sys.argv[1]))\n"
              "ckpts.close()\n"
              "print(f'error: refused ({left} left)', file=sys.stderr)\n"
              "raise SystemExit(1)\n")
    run = subprocess.run([sys.executable, "-c", script, str(directory)], capture_output=True, text=True, cwd=ROOT,
                         env=dict(os.environ, JAX_PLATFORMS="cpu"), timeout=300, check=False)
    assert run.returncode == 1
    assert "Traceback" not in run.stderr and "cannot schedule" not in run.stderr, run.stderr
    assert run.stderr.splitlines()[-1] == "error: refused (0 left)", run.stderr


@pytest.mark.slow  # three short train.py runs; pytest -m slow runs it
def test_train_py_resumes_from_the_checkpoint_before_a_changed_one_and_names_a_changed_width(tmp_path, capsys):
    import shutil

    import train
    from safetensors.numpy import load_file
    from tests.helpers import cli_error

    config = tmp_path / "c.yaml"
    config.write_text(yaml.safe_dump({
        "target": "tiny", "out": str(tmp_path / "out"),
        "data": {"num_prompts": 8, "eval_prompts": 2, "max_new_tokens": 8, "gen_batch_size": 8, "shard_size": 8},
        "drafter": {"num_layers": 1, "block_size": 4},
        "train": {"steps": 4, "batch_size": 2, "seq_len": 16, "num_anchors": 2, "checkpoint_every": 2,
                  "eval_max_new_tokens": 4}}))
    out, flipped = tmp_path / "out", tmp_path / "flipped"
    train.main(["--config", str(config)])
    assert all((out / "checkpoints" / step / CHECKSUMS).exists() for step in ("2", "4"))
    shutil.copytree(out, flipped)
    shutil.rmtree(flipped / "drafter")
    _flip_bytes(_largest_file(flipped / "checkpoints" / "4"))
    capsys.readouterr()
    train.main(["--config", str(config), "--set", f"out={flipped}"])
    err = capsys.readouterr().err
    assert f"warning: checkpoint 4 in {flipped}/checkpoints cannot be read (its files differ from the checksums" in err
    assert f"resuming from step 2, the newest readable one; it is moved to {flipped}/checkpoints/4.unreadable" in err
    a, b = (load_file(os.path.join(o, "drafter", "model.safetensors")) for o in (out, flipped))
    for name in a:
        np.testing.assert_array_equal(a[name], b[name], err_msg=name)
    message = cli_error(capsys, train.main, ["--config", str(config), "--set", "drafter.intermediate_size=128"])
    assert message.startswith(f"error: {out}/checkpoints/4 was written with other settings (intermediate_size: 256 "
                              f"then, 128 now)"), message
