"""What a newcomer installs and runs first: the demo's extra needs no PyTorch, and the tiny recipes that
the README runs build their drafters without a warning."""

import os
import tomllib
import warnings

import pytest

import retrace_jax as rj
from retrace_jax.training.config import load_config
from retrace_jax.training.loop import build_drafter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_the_demo_extra_needs_no_pytorch():
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]

    def names(requirements):
        return {r.split("=")[0].split(">")[0].split("<")[0].split("[")[0].strip().lower() for r in requirements}

    demo = names(project["optional-dependencies"]["assets"]) | names(project["dependencies"])
    assert "gguf" in demo and not {"torch", "accelerate", "torchvision"} & demo
    # what PyTorch used to bring along and the demo still needs: transformers' chat templates render with it
    assert "jinja2" in demo


@pytest.mark.parametrize("config", ["tiny_dflash.yaml"])
def test_readme_recipes_build_their_drafter_without_warnings(config):
    cfg = load_config(os.path.join(ROOT, "configs", config), ["train.steps=1"])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        drafter = build_drafter(cfg, rj.tiny.tiny_target(), None)
    assert len(set(drafter.cfg.target_layer_ids)) == len(drafter.cfg.target_layer_ids)
