"""Multi-process training and inference on one machine standing in for several hosts: two processes with
4 CPU devices each against one process with 8, on the same (2, 2, 2) mesh and the same prepared data.

Every run is a real ``train.py`` command (see tests/parallel/multiprocess.py); the processes meet through a local
coordinator and exchange collectives through gloo."""

import json
import os
import signal
import time

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file

from retrace_jax.training.data import PrepareSettings, prepare_shards
from tests.parallel import multiprocess as mp

CONFIG = {
    "target": "tiny",
    "data": {"prompts": "random", "num_prompts": 32, "prompt_len": 6, "eval_prompts": 0, "max_new_tokens": 20,
             "gen_batch_size": 16, "shard_size": 8},
    "drafter": {"num_layers": 1, "block_size": 4},
    "train": {"steps": 12, "batch_size": 8, "seq_len": 24, "num_anchors": 4, "lr": 3e-3, "log_every": 1,
              "checkpoint_every": 4, "mesh": "data=2,fsdp=2,tensor=2", "tensorboard": False},
}


def _config(root, name: str, **train) -> str:
    cfg = yaml.safe_load(yaml.safe_dump(CONFIG))
    cfg["out"] = str(root / name)
    cfg["data"]["dir"] = str(root / "data")
    cfg["train"].update(train)
    path = root / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def _losses(out) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in map(json.loads, open(os.path.join(out, "metrics.jsonl"))) if "loss" in r}


def _drafter(out):
    return load_file(os.path.join(out, "drafter", "model.safetensors"))


def _assert_same_drafter(a, b, atol: float = 1e-6) -> float:
    """Every exported weight equal within float32 reduction-order noise (collectives through gloo sum in
    another order than inside one process); returns the largest difference."""
    assert a.keys() == b.keys()
    for name in a:
        np.testing.assert_allclose(a[name], b[name], rtol=1e-5, atol=atol, err_msg=name)
    worst = max(float(np.max(np.abs(a[k].astype(np.float64) - b[k]))) for k in a)
    print(f"largest weight difference: {worst:.2e}")
    return worst


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """The prepared data that every training run below reads: random responses, written directly (the
    multi-process preparation has its own test)."""
    root = tmp_path_factory.mktemp("mp")
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, 512, (6,)).tolist() for _ in range(32)]
    settings = PrepareSettings(num_prompts=32, shard_size=8, max_prompt_len=1024, max_new_tokens=20,
                               source="random")
    prepare_shards(str(root / "data"), prompts, settings, progress=False,
                   generate_fn=lambda chunk, first: [rng.randint(0, 512, (20,)).tolist() for _ in chunk])
    (root / "data" / "eval_prompts.json").write_text("[]")
    return root, 0.0


@pytest.fixture(scope="module")
def two_process_run(workspace):
    root, _ = workspace
    start = time.perf_counter()
    logs = mp.run(["train.py", "--config", _config(root, "two"), "--stage", "train"], 2, 4, str(root), "two")
    return str(root / "two"), logs, time.perf_counter() - start


@pytest.mark.slow
def test_data_preparation_is_shared_and_equals_one_process(workspace, tmp_path):
    """Two processes prepare the same shards as one, each its share; a lost shard is remade alone."""
    root, _ = workspace
    configs = {}
    for name in ("data1", "data2"):
        cfg = yaml.safe_load(open(_config(root, "prep")))
        cfg["data"]["dir"] = str(tmp_path / name)
        configs[name] = tmp_path / f"{name}.yaml"
        configs[name].write_text(yaml.safe_dump(cfg))
    mp.run(["train.py", "--config", str(configs["data1"]), "--stage", "prepare"], 1, 1, str(tmp_path), "prep1")
    args = ["train.py", "--config", str(configs["data2"]), "--stage", "prepare"]
    start = time.perf_counter()
    logs = mp.run(args, 2, 4, str(tmp_path), "prep")
    seconds = time.perf_counter() - start
    assert json.load(open(tmp_path / "data2" / "manifest.json"))["done"] == [0, 1, 2, 3]
    assert '"processes": 2' in logs[0] and "[process 1]" in logs[1]
    for i in range(4):
        with np.load(tmp_path / "data1" / f"shard_{i:05d}.npz") as a, np.load(tmp_path / "data2" / f"shard_{i:05d}.npz") as b:
            for key in ("tokens", "loss_mask", "offsets"):
                np.testing.assert_array_equal(a[key], b[key])
    # A preparation that resumes: a shard lost, rerun with two processes, only that one is remade.
    data = tmp_path / "data2"
    os.remove(data / "shard_00002.npz")
    m = json.load(open(data / "manifest.json"))
    m["done"] = [0, 1, 3]
    (data / "manifest.json").write_text(json.dumps(m))
    stamps = {i: os.stat(data / f"shard_{i:05d}.npz").st_mtime_ns for i in (0, 1, 3)}
    mp.run(args, 2, 4, str(tmp_path), "prep2")
    assert json.load(open(data / "manifest.json"))["done"] == [0, 1, 2, 3]
    assert {i: os.stat(data / f"shard_{i:05d}.npz").st_mtime_ns for i in (0, 1, 3)} == stamps
    with np.load(tmp_path / "data1" / "shard_00002.npz") as a, np.load(data / "shard_00002.npz") as b:
        np.testing.assert_array_equal(a["tokens"], b["tokens"])
    print(f"two-process preparation: {seconds:.1f} s")


def test_two_processes_train_exactly_as_one(workspace, two_process_run):
    root, _ = workspace
    out2, logs, seconds2 = two_process_run
    start = time.perf_counter()
    mp.run(["train.py", "--config", _config(root, "one"), "--stage", "train"], 1, 8, str(root), "one")
    seconds1 = time.perf_counter() - start
    one, two = _losses(str(root / "one")), _losses(out2)
    assert sorted(one) == sorted(two) == list(range(1, 13))
    np.testing.assert_allclose([two[s] for s in one], [one[s] for s in one], rtol=1e-5)
    assert one[12] < one[1]
    _assert_same_drafter(_drafter(str(root / "one")), _drafter(out2))
    assert "[process 1]" in logs[1] and not os.path.exists(root / "two" / "metrics.jsonl.1")
    print(f"train 12 steps: 1 process x 8 devices {seconds1:.1f} s, 2 processes x 4 devices {seconds2:.1f} s")


@pytest.mark.slow
def test_two_processes_train_retrace_exactly_as_one(workspace):
    root, _ = workspace
    kw = dict(objective="retrace", steps=4, beta_warmup_steps=2)
    mp.run(["train.py", "--config", _config(root, "r1", **kw), "--stage", "train"], 1, 8, str(root), "r1")
    mp.run(["train.py", "--config", _config(root, "r2", **kw), "--stage", "train"], 2, 4, str(root), "r2")
    one, two = _losses(str(root / "r1")), _losses(str(root / "r2"))
    np.testing.assert_allclose([two[s] for s in one], [one[s] for s in one], rtol=1e-5)
    # Adam divides each gradient element by its own running scale, so where a gradient is near zero (the
    # ReTrace correction and gate weights, behind the zero-initialised value projection W_v, in the
    # first steps) reduction-order noise moves a weight by up to a few 1e-6: 1-2 of the 32,768 elements
    # of each in three runs, every other weight within 1.2e-7. A missing or wrong collective moves
    # thousands of them by about the learning rate (3e-3).
    _assert_same_drafter(_drafter(str(root / "r1")), _drafter(str(root / "r2")), atol=1e-5)


@pytest.mark.slow
def test_kill_one_process_and_resume(workspace, two_process_run):
    """kill -9 one process after the checkpoint at step 4, then restart both: the run resumes from the
    last checkpoint and exports the drafter of the uninterrupted run."""
    root, _ = workspace
    out = root / "killed"
    config = _config(root, "killed")
    args = ["train.py", "--config", config, "--stage", "train"]
    start = time.perf_counter()
    procs = mp.start(args, 2, 4, str(root), "killed")
    try:
        deadline = time.time() + 300
        while time.time() < deadline:
            done = os.path.exists(out / "metrics.jsonl") and max(_losses(str(out)) or [0]) >= 6
            if done and (out / "checkpoints" / "4").is_dir() or any(p.poll() is not None for p in procs):
                break
            time.sleep(0.02)
        assert all(p.poll() is None for p in procs), "the run ended before it could be killed"
        procs[1].send_signal(signal.SIGKILL)
        procs[1].wait()
        procs[0].send_signal(signal.SIGKILL)  # the scheduler restarts the whole job
        procs[0].wait()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    killed_at = max(_losses(str(out)))
    assert killed_at < 12
    mp.run(args, 2, 4, str(root), "resumed")
    seconds = time.perf_counter() - start
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    resumed = [r for r in records if r.get("event") == "resumed"]
    assert len(resumed) == 1 and 4 <= resumed[0]["step"] < 12, resumed
    assert resumed[0]["step"] % 4 == 0
    _assert_same_drafter(_drafter(two_process_run[0]), _drafter(str(out)))
    full = _losses(two_process_run[0])
    after = {r["step"]: r["loss"] for r in records[records.index(resumed[0]):] if "loss" in r}
    np.testing.assert_allclose([after[s] for s in after], [full[s] for s in after], rtol=1e-5)
    print(f"killed at step {killed_at}, resumed from {resumed[0]['step']}; kill + resume {seconds:.1f} s")


@pytest.mark.slow
def test_generation_on_a_mesh_across_processes(tmp_path):
    start = time.perf_counter()
    logs = mp.run(["tests/parallel/multiprocess_generate.py", str(tmp_path)], 2, 4, str(tmp_path), "gen")
    assert all(log.strip().endswith("ok") for log in logs), logs
    print(f"two-process generation: {time.perf_counter() - start:.1f} s")
