import os

import pytest

# decode.py turns on JAX's persistent compilation cache; the tests neither write to the user's cache nor
# load programs from it (a cache hit would hide the compilations that some tests count).
os.environ["RETRACE_JAX_CACHE_DIR"] = ""

from tests.helpers import FAMILIES, make_hf_model, save_hf_model


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
def trained_drafter(hf_model_dir):
    """A one-layer drafter (block 4) fitted for a few hundred steps on the qwen3 target's own greedy
    outputs, so that many of its proposals are right. Returns ``(drafter, training_prompts)``."""
    import numpy as np

    import retrace_jax as rj
    from retrace_jax.self_distill import regenerate, train_dflash

    _, directory = hf_model_dir("qwen3")
    target = rj.load_target(directory)
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, 127, (4,)).tolist() for _ in range(64)]
    tokens, mask = regenerate(target, prompts, max_new_tokens=48)
    drafter = rj.init_drafter(target.cfg, mask_token_id=127, num_layers=1, block_size=4, seed=1)
    return train_dflash(target, drafter, tokens, mask, steps=300, lr=3e-3), prompts
