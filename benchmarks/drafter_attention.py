"""Where a drafter's block slots look: the attention weights of drafted blocks on the teacher-forced sets of
the recipe probe.

    python benchmarks/drafter_attention.py --target ~/.cache/retrace_jax/models/qwen2.5-coder-0.5b-instruct \\
        --sets runs/probes/_sets --drafter base=runs/probes/base/drafter --drafter qknorm=runs/probes/qknorm/drafter

For each drafter and layer, and for block slots 0, 1 and 5 (slot 0 holds the anchor token ``x[p]``, the
others the mask token), the mean over heads, anchors and sequences of the attention weight on the last
context position ``p - 1`` (whose target features predicted ``x[p]``), on the block's slot 0, and on the
whole context, and the attention entropy over the keys the slot sees relative to its maximum (1: flat).
A drafter whose first drafted slot barely reads slot 0 drafts ``x[p + 1]`` without the token before it.

The blocks are those of :mod:`retrace_jax.training.probe` (anchors spread over each response, the
block's positions all in it) on the dev set that ``recipe_probe.py run`` keeps in ``--sets`` (its
sequences and their float32 target features). The weights are read by wrapping the reference attention
that training's block drafting calls (``retrace_jax.models.drafter.attention_beside_context``): the same
arithmetic, with the probabilities kept.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.recipe_probe import _digest, features_of  # noqa: E402
from benchmarks.report import write_json  # noqa: E402

SLOTS = (0, 1, 5)


@contextlib.contextmanager
def kept_attention():
    """Inside the block, training's block attention (``attention_beside_context``, run eagerly) appends its
    probabilities ``[B, H, T, S + T]`` to the list it yields, one entry per layer call."""
    import retrace_jax.models.drafter as drafter_module
    from retrace_jax.attention.reference import attention_beside_context

    kept = []

    def keep(q_bthd, k_btkd, v_btkd, ctx_k_bskd, ctx_v_bskd, mask_bt_st):
        keys = jnp.concatenate([ctx_k_bskd, k_btkd.astype(ctx_k_bskd.dtype)], axis=1)
        groups = q_bthd.shape[2] // keys.shape[2]
        keys = jnp.repeat(keys, groups, axis=2)
        scores = jnp.einsum("bthd,bshd->bhts", q_bthd.astype(jnp.float32), keys.astype(jnp.float32))
        scores = jnp.where(mask_bt_st[:, None], scores * q_bthd.shape[-1] ** -0.5, -jnp.inf)
        kept.append(np.asarray(jax.nn.softmax(scores, axis=-1)))
        return attention_beside_context(q_bthd, k_btkd, v_btkd, ctx_k_bskd, ctx_v_bskd, mask_bt_st)

    original = drafter_module.attention_beside_context
    drafter_module.attention_beside_context = keep
    try:
        yield kept
    finally:
        drafter_module.attention_beside_context = original


def slot_readout(probs_bhtk, anchors_ba, valid_ba, seq_len: int, block_size: int, slots=SLOTS) -> dict:
    """The means (over heads, valid anchors and rows) of one layer's probabilities ``[B, H, A*W, S + A*W]``
    for each of ``slots``: weight on position ``anchor - 1``, on the block's slot 0, on the context, and
    the entropy over the visible keys relative to its maximum."""
    b, h, t, _ = probs_bhtk.shape
    a = t // block_size
    p = np.asarray(probs_bhtk).reshape(b, h, a, block_size, -1)
    out = {}
    for slot in slots:
        last, own, ctx, flat = [], [], [], []
        for row in range(b):
            for i in range(a):
                if not valid_ba[row, i]:
                    continue
                anchor = int(anchors_ba[row, i])
                w = p[row, :, i, slot]  # [H, S + A*W]
                last.append(w[:, anchor - 1].mean())
                own.append(w[:, seq_len + i * block_size].mean())
                ctx.append(w[:, :seq_len].sum(-1).mean())
                visible = anchor + block_size
                flat.append((-(w * np.log(np.where(w > 0, w, 1.0))).sum(-1)).mean() / np.log(visible))
        out[f"slot {slot}"] = {"on p-1": round(float(np.mean(last)), 3), "on slot 0": round(float(np.mean(own)), 3),
                               "on the context": round(float(np.mean(ctx)), 3),
                               "entropy / max": round(float(np.mean(flat)), 3)}
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True, help="a Hugging Face directory")
    p.add_argument("--sets", required=True, help="recipe_probe's sets folder (ROOT/_sets)")
    p.add_argument("--drafter", action="append", required=True, help="NAME=DIR, repeatable")
    p.add_argument("--sequences", type=int, default=16, help="dev sequences read")
    p.add_argument("--anchors", type=int, default=8, help="anchors per sequence")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)

    import retrace_jax as rj
    from retrace_jax.training.dflash_loss import build_blocks, draft_blocks, sequence_context
    from retrace_jax.training.probe import acceptance_anchors

    dev = sorted(glob.glob(os.path.join(args.sets, "dev-*.npz")))
    if len(dev) != 1:
        raise SystemExit(f"expected one dev-*.npz in {args.sets}, found {len(dev)}")
    with np.load(dev[0]) as z:
        all_tokens, mask = z["tokens"], z["loss_mask"][: args.sequences]
    tokens, dev_digest = all_tokens[: args.sequences], _digest(all_tokens.tolist())  # the digest names its features
    target_path = os.path.abspath(os.path.expanduser(args.target))
    target = rj.load_target(target_path)
    anchors, valid = acceptance_anchors(mask, args.block_size, args.anchors)
    result = {"target": args.target, "sets": args.sets, "dev": os.path.basename(dev[0]), "sequences": len(tokens),
              "anchors": args.anchors, "block_size": args.block_size, "drafters": {}}
    print("| drafter | layer | slot | on p-1 | on slot 0 | on the context | entropy / max |")
    print("|---|---|---|---|---|---|---|")
    for spec in args.drafter:
        name, _, path = spec.partition("=")
        drafter = rj.load_drafter(os.path.expanduser(path), target)
        layers = list(drafter.cfg.target_layer_ids)
        key = {"target": target_path, "set": dev_digest, "layers": layers}  # as recipe_probe keeps them
        features = features_of(target, all_tokens, layers, args.sets, key)[: args.sequences]
        blocks = build_blocks(jnp.asarray(tokens), jnp.asarray(mask), jnp.asarray(anchors), jnp.asarray(valid),
                              args.block_size, drafter.cfg.mask_token_id, 1.0)
        with kept_attention() as kept:
            draft_blocks(drafter, target, sequence_context(drafter, jnp.asarray(features, drafter.dtype)), blocks)
        readout = {}
        for layer, probs in enumerate(kept):
            readout[layer] = slot_readout(probs, anchors, valid, tokens.shape[1], args.block_size)
            for slot, r in readout[layer].items():
                print(f"| {name} | {layer} | {slot} | {r['on p-1']} | {r['on slot 0']} | {r['on the context']} "
                      f"| {r['entropy / max']} |")
        result["drafters"][name] = {"path": path, "layers": readout}
    write_json(result, args.out)


if __name__ == "__main__":
    main()
