"""Train a DFlash drafter on its target's own greedy outputs.

    python train.py --config configs/tiny_dflash.yaml [--set key=value ...]

Regenerates responses to the prompts with the target (``rj.generate``), fits the drafter with the
DFlash loss, reports τ on held-out prompts with real speculative generation, and writes the drafter
in the official DFlash layout to ``out`` (plus ``metrics.jsonl``). Prompts are random token ids for now.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import numpy as np
import yaml

import retrace_jax as rj
from retrace_jax.self_distill import regenerate, train_dflash
from retrace_jax.tiny import tiny_target


def load_config(path: str, overrides: list[str]) -> dict:
    if not os.path.isfile(path):
        raise SystemExit(f"config file not found: {path}")
    with open(path) as f:
        cfg = yaml.safe_load(f)
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise SystemExit(f"--set expects key=value, got {item!r}")
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        if leaf not in node:
            raise SystemExit(f"unknown config key {key!r}")
        node[leaf] = yaml.safe_load(value)
    return cfg


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config value")
    args = p.parse_args(argv)
    cfg = load_config(args.config, args.set)
    os.makedirs(cfg["out"], exist_ok=True)
    metrics_path = os.path.join(cfg["out"], "metrics.jsonl")
    metrics = open(metrics_path, "w")

    def log(record):
        print(json.dumps(record))
        metrics.write(json.dumps(record) + "\n")
        metrics.flush()

    target = tiny_target() if cfg["target"] == "tiny" else rj.load_target(cfg["target"])
    vocab = target.cfg.vocab_size
    rng = np.random.RandomState(cfg["seed"])
    n_train, n_eval = cfg["num_prompts"], cfg["eval_prompts"]
    prompts = [rng.randint(0, vocab, (cfg["prompt_len"],)).tolist() for _ in range(n_train + n_eval)]
    start = time.perf_counter()
    tokens, mask = regenerate(target, prompts[:n_train], cfg["response_len"])
    log({"event": "regenerated", "sequences": len(tokens), "tokens": int(mask.sum()),
         "seconds": round(time.perf_counter() - start, 1)})

    dcfg = cfg["drafter"]
    mask_id = dcfg["mask_token_id"] if dcfg.get("mask_token_id") is not None else vocab - 1
    drafter = rj.init_drafter(target.cfg, mask_token_id=mask_id, num_layers=dcfg["num_layers"],
                              block_size=dcfg["block_size"], seed=cfg["seed"])
    drafter = train_dflash(target, drafter, tokens, mask, steps=cfg["steps"], batch_size=cfg["batch_size"],
                           lr=cfg["lr"], num_anchors=cfg["num_anchors"], seed=cfg["seed"], log=log)
    held_out = prompts[n_train:]
    out = rj.generate(target, held_out, cfg["response_len"], drafter=drafter)
    log({"event": "eval", "prompts": len(held_out), "tau": round(out.tau(), 3), "tau_pooled": round(out.tau_pooled(), 3)})
    rj.save_drafter(drafter, cfg["out"])
    print(f"drafter written to {cfg['out']}; metrics in {metrics_path}")
    metrics.close()


if __name__ == "__main__":
    main()
