import os

import pytest

# decode.py turns on JAX's persistent compilation cache; the tests neither write to the user's cache nor
# load programs from it (a cache hit would hide the compilations that some tests count).
os.environ["RETRACE_JAX_CACHE_DIR"] = ""

# The tests run tiny models, so compiling dominates their time. XLA's CPU backend compiles about twice as
# fast with LLVM's optimisations off; the programs (the HLO after XLA's own passes) are the same, only
# their machine code is slower. RETRACE_JAX_TEST_OPTIMIZE=1 keeps the default level. Set before jax is
# imported; the tests that start processes pass it on through the environment.
if os.environ.get("RETRACE_JAX_TEST_OPTIMIZE", "") in ("", "0"):
    os.environ["XLA_FLAGS"] = " ".join(filter(None, [os.environ.get("XLA_FLAGS"),
                                                     "--xla_backend_optimization_level=0"]))

from tests.helpers import FAMILIES, built_once, make_hf_model, save_hf_model

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
def trained_drafter(hf_model_dir, tmp_path_factory):
    """A one-layer drafter (block 4) fitted for a few hundred steps on the qwen3 target's own greedy
    outputs, so that many of its proposals are right. Returns ``(drafter, training_prompts)``.

    Trained once per test run: the first worker process to ask saves it (float32, exact), the others
    load it."""
    import numpy as np

    import retrace_jax as rj
    from retrace_jax.self_distill import regenerate, train_dflash

    _, directory = hf_model_dir("qwen3")
    target = rj.load_target(directory)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, 127, (4,)).tolist() for _ in range(64)]

    def build(path):
        tokens, mask = regenerate(target, prompts, max_new_tokens=48)
        drafter = rj.init_drafter(target.cfg, mask_token_id=127, num_layers=1, block_size=4, seed=1)
        rj.save_drafter(train_dflash(target, drafter, tokens, mask, steps=300, lr=3e-3), str(path / "drafter"),
                        dtype="float32")

    return rj.load_drafter(str(built_once(tmp_path_factory, "trained_drafter", build) / "drafter"), target), prompts
