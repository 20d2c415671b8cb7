"""Train DFlash and ReTrace drafters.

    python train.py --config configs/tiny_dflash.yaml                 # prepare the data, then train
    python train.py --config configs/tiny_dflash.yaml --stage prepare # only regenerate the responses
    python train.py --config configs/tiny_retrace.yaml --set train.steps=200

Data preparation regenerates the responses to the prompts with the target (resumable shards); training
fits the drafter (DFlash, or ReTrace's two-round rollout), checkpoints with Orbax and resumes exactly
from the last checkpoint when rerun, evaluates τ with real speculative generation on held-out prompts,
and exports the drafter in the official DFlash layout to ``OUT/drafter``. Metrics go to stdout and
``OUT/metrics.jsonl``.
"""

from __future__ import annotations

import argparse
import json
import os

from retrace_jax import trainer


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True, help="a YAML file (see configs/)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. train.steps=200 (repeatable)")
    p.add_argument("--stage", choices=["all", "prepare", "train"], default="all",
                   help="all: prepare the data if needed, then train")
    args = p.parse_args(argv)
    try:
        return run(args)
    except (FileNotFoundError, ValueError) as err:  # ConfigError, CheckpointError, DataError, ConfigurationError
        raise SystemExit(f"error: {err}") from None


def run(args):
    cfg = trainer.load_config(args.config, args.set)
    os.makedirs(cfg["out"], exist_ok=True)
    metrics = open(os.path.join(cfg["out"], "metrics.jsonl"), "a")

    def log(record):
        line = json.dumps(record)
        print(line, flush=True)
        metrics.write(line + "\n")
        metrics.flush()

    try:
        if args.stage in ("all", "prepare"):
            manifest = os.path.join(trainer.data_dir(cfg), "manifest.json")
            if args.stage == "prepare" or not os.path.exists(manifest) or _unfinished(manifest):
                trainer.prepare(cfg, log)
        if args.stage in ("all", "train"):
            return trainer.train(cfg, log)
    finally:
        metrics.close()


def _unfinished(manifest_path: str) -> bool:
    with open(manifest_path) as f:
        m = json.load(f)
    shards = -(-m["settings"]["num_prompts"] // m["settings"]["shard_size"])
    return len(m["done"]) < shards


if __name__ == "__main__":
    main()
