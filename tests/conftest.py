import os

import pytest

# decode.py turns on JAX's persistent compilation cache; the tests neither write to the user's cache nor
# load programs from it (a cache hit would hide the compilations that some tests count).
os.environ["RETRACE_JAX_CACHE_DIR"] = ""

# The tests run tiny models, so compiling dominates their time. Two XLA flags make XLA's CPU backend
# compile their programs in about half the time (docs/performance.md measures it); the compiled code
# runs slower. LLVM's optimisations off leaves the HLO as it is; the elemental emitters instead of the
# MLIR fusion emitters also change how XLA fuses (tests/decoding/test_inplace.py, which reads the
# optimised HLO, compiles with the emitters users get). At XLA's default optimisation level the
# elemental emitters compile large programs more slowly, so only the tests use them.
# RETRACE_JAX_TEST_OPTIMIZE=1 keeps XLA's defaults (the suite passes either way). Set before jax is
# imported; the tests that start processes pass them on through the environment.
TEST_XLA_FLAGS = ("--xla_backend_optimization_level=0", "--xla_cpu_use_fusion_emitters=false")


def _xla_accepts(flags: str) -> bool:
    """Whether this jaxlib's XLA knows ``flags`` (an unknown flag in XLA_FLAGS aborts the process, so they
    are tried in a child process first)."""
    import subprocess
    import sys

    env = dict(os.environ, XLA_FLAGS=flags, JAX_PLATFORMS="cpu")
    try:
        probe = subprocess.run([sys.executable, "-c", "import jax.numpy as jnp; jnp.zeros(1).block_until_ready()"],
                               env=env, capture_output=True, timeout=120, check=False)
    except subprocess.TimeoutExpired:
        return False
    return probe.returncode == 0


if os.environ.get("RETRACE_JAX_TEST_OPTIMIZE", "") in ("", "0"):
    current = os.environ.get("XLA_FLAGS", "")
    # pytest-xdist's workers inherit the flags from the controller, which probed them already
    missing = [f for f in TEST_XLA_FLAGS if f.split("=")[0] not in current]
    if missing and not _xla_accepts(" ".join(missing)):
        missing = [f for f in missing if _xla_accepts(f)]
    os.environ["XLA_FLAGS"] = " ".join(filter(None, [current, *missing]))


def _accelerator_installed() -> bool:
    """Whether JAX may run on a GPU or TPU here: JAX_PLATFORMS names one, or (unset) a GPU or TPU plugin
    is installed. Decided without starting a backend (pytest-xdist's controller would hold the device)."""
    import importlib.util

    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms:
        return any(p.strip() not in ("", "cpu") for p in platforms.split(","))
    plugins = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin", "libtpu")
    return any(importlib.util.find_spec(m) is not None for m in plugins)


# The tests compare float32 programs token for token and against PyTorch. On a GPU JAX's default float32
# matmul is TF32 (on a TPU, bfloat16 passes), which rounds a verify pass and one-token steps differently:
# full float32 products there, as a CPU computes them anyway (set before jax is imported; the processes
# the tests start inherit it).
if _accelerator_installed():
    os.environ.setdefault("JAX_DEFAULT_MATMUL_PRECISION", "highest")
    import jax  # importing starts no backend

    jax.config.update("jax_default_matmul_precision", os.environ["JAX_DEFAULT_MATMUL_PRECISION"])

from tests.helpers import FAMILIES, built_once, make_hf_model, save_hf_model


def _memory_mappings() -> tuple[int, int] | None:
    """This process's memory mappings and the kernel's limit on them (``vm.max_map_count``), or None where
    /proc does not tell."""
    try:
        with open("/proc/self/maps") as maps, open("/proc/sys/vm/max_map_count") as limit:
            return sum(1 for _ in maps), int(limit.read())
    except (OSError, ValueError):
        return None


@pytest.fixture(scope="module", autouse=True)
def _release_compiled_programs():
    """Drops every compiled program after each test module. XLA's CPU backend keeps each executable's code
    in memory mappings of its own (about 3 for a one-operation program, hundreds for a decode loop), and
    JAX keeps the executables of every jitted function it has called. A worker that ran a few hundred
    tests held the kernel's limit of 65,530 mappings: its next compile failed and the process died
    (a segmentation fault or an abort inside ``backend_compile_and_load``, in whichever test came next).
    Past half the limit after the release, the module's last test errs with the count instead."""
    yield
    import gc

    import jax

    jax.clear_caches()
    gc.collect()
    counts = _memory_mappings()
    if counts is not None and counts[0] > counts[1] // 2:
        pytest.fail(f"this test process holds {counts[0]} memory mappings after releasing its compiled programs, "
                    f"more than half of the kernel's limit (vm.max_map_count = {counts[1]}): something keeps "
                    f"compiled programs alive across test modules", pytrace=False)


@pytest.fixture(scope="session", params=sorted(FAMILIES))
def family(request):
    return request.param


@pytest.fixture(scope="session")
def hf_model_dir(tmp_path_factory):
    """Returns ``(hf_model, directory)`` for a family, built once per session."""
    cache = {}

    def get(family: str):
        if family not in cache:
            model = make_hf_model(family)
            directory = save_hf_model(model, str(tmp_path_factory.mktemp(family)))
            cache[family] = (model, directory)
        return cache[family]

    return get


@pytest.fixture(scope="session")
def qwen3(hf_model_dir):
    """The qwen3 reference model of ``hf_model_dir`` loaded as a target (read-only: tests do not change it)."""
    import retrace_jax as rj

    return rj.load_target(hf_model_dir("qwen3")[1])


@pytest.fixture(scope="session")
def trained_drafter(hf_model_dir, tmp_path_factory):
    """A one-layer drafter (block 4) fitted for 150 steps on the qwen3 target's own greedy outputs, so
    that many of its proposals are right (τ about 1.8 on its training prompts, against 1.95 after 300
    steps at half the learning rate, which took twice as long). Returns ``(drafter, training_prompts)``.

    Trained once per test run: the first worker process to ask saves it (float32, exact), the others
    load it."""
    import numpy as np

    import retrace_jax as rj
    from retrace_jax.training.self_distill import regenerate, train_dflash

    _, directory = hf_model_dir("qwen3")
    target = rj.load_target(directory)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, 127, (4,)).tolist() for _ in range(64)]

    def build(path):
        tokens, mask = regenerate(target, prompts, max_new_tokens=48)
        drafter = rj.init_drafter(target.cfg, mask_token_id=127, num_layers=1, block_size=4, seed=1)
        rj.save_drafter(train_dflash(target, drafter, tokens, mask, steps=150, lr=6e-3), str(path / "drafter"),
                        dtype="float32")

    return rj.load_drafter(str(built_once(tmp_path_factory, "trained_drafter", build) / "drafter"), target), prompts


@pytest.fixture(params=["row_walk", "batch_walk"])
def walk(request, monkeypatch):
    """Runs a test with each walk of a batch's KV cache for decode-sized calls: each row its own chunks
    (``walk_rows``, the default), or every row up to the longest one (``walk_cache``, what prefill runs)."""
    from retrace_jax import attention

    if request.param == "batch_walk":
        monkeypatch.setattr(attention, "ROW_WALK_MAX_T", 0)
    return request.param
