"""The scales a new drafter starts from, against the target's: why a drafter whose norms start at ones
learns slowly.

    python benchmarks/drafter_scales.py --target ~/.cache/retrace_jax/models/qwen2.5-coder-0.5b-instruct \\
        --layers 22,23 --features runs/probe_data_8/features-0719d5962192 --feature-layers 1,11,21

Prints one table:

- **The LM head's input.** The drafter's hidden state reaches the target's (frozen) LM head through its
  own final norm. The standard deviation of the logits of random hidden states of RMS 1 (an untrained
  drafter's direction) through the head, with the norm's weight at ones and at the target's: the ratio is
  how much flatter an untrained drafter's softmax is than the target's (``drafter.init_final_norm``).
- **The copied layers' norms.** The mean of each ``--layers`` layer's input and post-attention norm
  weights: a copied layer's projections expect inputs of that scale, while the context keys and values
  come through ``hidden_norm`` (ones).
- **The features** (``--features``: a feature store's directory, ``features-*/`` beside prepared data):
  for each target layer of the store, the share of the features' energy in their 6 largest channels and
  in each channel's mean over positions, and the mean cosine between the context vectors of two
  positions after a random feature projection and ``hidden_norm`` (``drafter.init_fc: random``), which
  the drafter's attention must see past: 0 would be positions as different as random vectors.

- **The data's floor** (``--data``: a prepared data directory, ``shard_*.npz``): the entropy of the response
  tokens' frequencies (the loss of a drafter that learnt only which tokens are common) and how often the
  token after the anchor is the one most often seen after the anchor's token in the same data (the first
  slot's accuracy of a bigram table fitted to the data itself), the two first stages a drafter's training
  passes through.

Every number comes from the weights, stored features and data; nothing is trained.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import numpy as np  # noqa: E402

from benchmarks.report import report  # noqa: E402


def logit_spread(head_vd: np.ndarray, norm_weight_d: np.ndarray, samples: int = 64, seed: int = 0) -> float:
    """The standard deviation of the logits ``(h * weight) @ head.T`` over random ``h`` of RMS 1."""
    h = np.random.default_rng(seed).standard_normal((samples, head_vd.shape[1])).astype(np.float32)
    return float(((h * norm_weight_d) @ head_vd.T).std())


def feature_statistics(features_nf: np.ndarray, width: int, seed: int = 0) -> dict:
    """Per target layer (``width`` channels each) of features ``[N, n * width]``: the energy shares of the
    6 largest channels and of the channel means; and the mean pairwise cosine of RMS-normed random
    projections of all layers' features together (``fc`` then ``hidden_norm`` at ones)."""
    x = np.asarray(features_nf, np.float32)
    out = {}
    for i in range(x.shape[1] // width):
        f = x[:, i * width:(i + 1) * width]
        energy = (f**2).mean(0)
        top = np.sort(energy)[::-1][:6]
        out[f"layer slot {i}: energy in its 6 largest channels"] = round(float(top.sum() / energy.sum()), 3)
        out[f"layer slot {i}: energy in the channel means"] = round(float((f.mean(0) ** 2).sum() / energy.sum()), 3)
    rng = np.random.default_rng(seed)
    fc = rng.standard_normal((x.shape[1], width)).astype(np.float32) / np.sqrt(x.shape[1])
    ctx = x @ fc
    ctx /= np.linalg.norm(ctx, axis=1, keepdims=True)
    cos = ctx @ ctx.T
    pairs = np.triu_indices(len(ctx), 1)
    out["context vectors after a random projection: mean cosine of two positions"] = round(float(cos[pairs].mean()), 3)
    out["... of neighbouring positions"] = round(float((ctx[1:] * ctx[:-1]).sum(1).mean()), 3)
    return out


def data_floor(sequences) -> dict:
    """The unigram entropy of the labels and the in-sample bigram accuracy at the first slot, over the
    response positions ``p`` whose next position is a response position too, of ``(tokens, loss_mask)``
    pairs."""
    pairs = []
    for tokens, mask in sequences:
        tokens, mask = np.asarray(tokens, np.int64), np.asarray(mask).astype(bool)
        at = np.nonzero(mask[:-1] & mask[1:])[0]
        pairs.append(np.stack([tokens[at], tokens[at + 1]], 1))
    pairs = np.concatenate(pairs)
    _, counts = np.unique(pairs[:, 1], return_counts=True)
    freq = counts / counts.sum()
    keys, bigram = np.unique(pairs, axis=0, return_counts=True)
    best = np.zeros(int(keys[:, 0].max()) + 1, np.int64)
    np.maximum.at(best, keys[:, 0], bigram)
    return {"labels": len(pairs), "unigram entropy (nats)": round(float(-(freq * np.log(freq)).sum()), 3),
            "most frequent token's share": round(float(freq.max()), 3),
            "first slot right by the data's own bigram table": round(float(best.sum() / len(pairs)), 3)}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="a Hugging Face directory")
    p.add_argument("--layers", default="", help="comma-separated target layers a drafter copies (init_layers)")
    p.add_argument("--features", default=None, help="a feature store's directory (features-*/)")
    p.add_argument("--feature-layers", default=None, help="the store's target layers, for the labels")
    p.add_argument("--positions", type=int, default=2000, help="consecutive stored positions to read")
    p.add_argument("--start", type=int, default=50000, help="the first of them")
    p.add_argument("--data", default=None, help="a prepared data directory (shard_*.npz)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import retrace_jax as rj

    target = rj.load_target(os.path.expanduser(args.target))
    head = np.asarray(target.head_weight(), np.float32)
    head = head if head.shape[0] == target.cfg.vocab_size else head.T  # [V, d]
    weight = np.asarray(target.norm.weight.get_value(), np.float32)
    ones, own = logit_spread(head, np.ones_like(weight)), logit_spread(head, weight)
    result = {"target": args.target, "final norm weight: mean / max": f"{weight.mean():.2f} / {weight.max():.2f}",
              "logit std of RMS-1 hidden states, norm at ones": round(ones, 3),
              "... norm at the target's": round(own, 3), "... ratio": round(own / ones, 2)}
    slices = target.layer_slices()
    for layer in [int(v) for v in args.layers.split(",") if v]:
        block = slices[layer]
        for name in ("input_layernorm", "post_attention_layernorm"):
            w = np.asarray(getattr(block, name).weight.get_value(), np.float32)
            result[f"layer {layer} {name} weight: mean"] = round(float(w.mean()), 2)
    if args.features:
        with open(os.path.join(args.features, "meta.json")) as f:
            meta = json.load(f)
        stored = np.load(os.path.join(args.features, "features.npy"), mmap_mode="r")
        stats = feature_statistics(stored[args.start:args.start + args.positions], target.cfg.hidden_size)
        names = args.feature_layers.split(",") if args.feature_layers else [str(i) for i in meta["layer_ids"]]
        for key, value in stats.items():
            for i, name in enumerate(names):
                key = key.replace(f"layer slot {i}:", f"target layer {name}:")
            result[key] = value
    if args.data:
        import glob

        sequences = []
        for path in sorted(glob.glob(os.path.join(args.data, "shard_*.npz"))):
            with np.load(path) as shard:
                tokens, mask, offsets = shard["tokens"], shard["loss_mask"], shard["offsets"]
            sequences += [(tokens[a:b], mask[a:b]) for a, b in itertools.pairwise(offsets)]
        result.update({f"data: {k}": v for k, v in data_floor(sequences).items()})
    report(result, args.out)


if __name__ == "__main__":
    main()
