"""Drafters this project trained and ships inside the package (``assets/drafters/``)."""

from __future__ import annotations

import os

# drafters this project trained and ships inside the package: target name -> {variant: directory under
# drafters/}; "default" is the one `decode.py --target MODEL` runs (retrace_jax/assets/drafters/README.md
# describes each)
SHIPPED = {"qwen2.5-coder-0.5b-instruct": {"default": "qwen2.5-coder-0.5b-instruct-dflash",
                                           "retrace": "qwen2.5-coder-0.5b-instruct-retrace"},
           "smollm2-135m-instruct": {"default": "smollm2-135m-instruct-dflash",
                                     "retrace": "smollm2-135m-instruct-retrace"}}


SHIPPED_DRAFTERS = {model: variants["default"] for model, variants in SHIPPED.items()}  # target -> the default


def shipped_drafter(model: str, variant: str = "default") -> str:
    """The directory of a drafter shipped for ``model``: its ``"default"`` (the one ``decode.py --target
    model`` runs) or another variant of :data:`SHIPPED` (``"retrace"``: a ReTrace drafter).
    retrace_jax/assets/drafters/README.md says how each was trained."""
    if model not in SHIPPED:
        raise ValueError(f"no drafter shipped for {model!r}; shipped: {', '.join(SHIPPED)}")
    if variant not in SHIPPED[model]:
        raise ValueError(f"no {variant!r} drafter shipped for {model!r}; there are: {', '.join(SHIPPED[model])}")
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "drafters", SHIPPED[model][variant])
    if not os.path.isfile(os.path.join(path, "model.safetensors")):
        raise FileNotFoundError(f"the shipped drafter is missing from {path} (a broken installation?)")
    return path
