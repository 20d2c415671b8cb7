"""Train DFlash and ReTrace drafters.

    python train.py --config configs/tiny_dflash.yaml                 # prepare the data, then train
    python train.py --config configs/tiny_dflash.yaml --stage prepare # only regenerate the responses
    python train.py --config configs/tiny_retrace.yaml --set train.steps=200
    python train.py --config configs/tiny_dflash.yaml --stage export  # the latest checkpoint -> OUT/drafter_stepN
    python train.py --describe                                        # every config key, its default and docs

Data preparation regenerates the responses to the prompts with the target (resumable shards); training
fits the drafter (DFlash, or ReTrace's R-round on-policy rollout), checkpoints with Orbax and resumes exactly
from the last checkpoint when rerun, evaluates τ with real speculative generation on held-out prompts,
and exports the drafter in the official DFlash layout to ``OUT/drafter``. Metrics go to stdout,
``OUT/metrics.jsonl`` and, when tensorboardX is installed, TensorBoard event files in ``OUT/tensorboard``.

Several processes (one per host) run the same command; see docs/training.md. On one machine:

    JAX_COORDINATOR_ADDRESS=127.0.0.1:12345 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=0 python train.py --config C &
    JAX_COORDINATOR_ADDRESS=127.0.0.1:12345 JAX_NUM_PROCESSES=2 JAX_PROCESS_ID=1 python train.py --config C

Errors (a bad configuration, a missing file, a diverged run) print one ``error: ...`` line and exit
with status 1; ``--traceback`` (or ``RETRACE_JAX_TRACEBACK=1``, as for decode.py) shows the traceback.
A command line that argparse refuses exits with status 2. A run stopped by SIGTERM (a preempting
scheduler) saves a checkpoint and exits with status 143 (128 + 15); the same command resumes it. Ctrl-C
(SIGINT) prints ``interrupted`` and exits with status 130 at once, without a checkpoint of its own: a
rerun resumes from the last periodic one (``train.checkpoint_every``).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

from retrace_jax.cli import TRAIN_ERRORS, compilation_cache, raise_if_interrupted, run_main


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", help="a YAML file (see configs/)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value, e.g. train.steps=200 (repeatable)")
    p.add_argument("--stage", choices=["all", "prepare", "train", "export"], default="all",
                   help="all: prepare the data if needed, then train; export: write the drafter of a checkpoint "
                        "(--step, default the latest) to OUT/drafter_stepN without training, e.g. to evaluate "
                        "a run that is still going")
    p.add_argument("--step", type=int, default=None, help="with --stage export: the checkpoint's step")
    p.add_argument("--describe", action="store_true", help="print every config key with its default and exit")
    p.add_argument("--traceback", action="store_true", help="on an error, show the full traceback")
    args = p.parse_args(argv)
    if not args.describe:  # --describe needs nothing else
        if not args.config:
            p.error("--config is required")
        if args.step is not None and args.stage != "export":
            p.error("--step goes with --stage export")
    return args


def main(argv=None):
    # Parsing runs inside run_main too, for its handling of Ctrl-C and of a closed standard output (--help);
    # the errors of the run are reported by the inner run_main, which knows whether --traceback was given.
    return run_main(_parse_and_run, argv, user_errors=())


def _parse_and_run(argv):
    args = parse_args(argv)
    return run_main(run, args, traceback=args.traceback, user_errors=TRAIN_ERRORS)


def run(args):
    if args.describe:
        from retrace_jax.training.config import describe

        print(describe())
        return None
    from retrace_jax.parallel.distributed import initialize
    from retrace_jax.training.config import load_config
    from retrace_jax.training.evaluate import MetricsLog
    from retrace_jax.training.lock import run_lock
    from retrace_jax.training.loop import export_checkpoint, train
    from retrace_jax.training.preflight import needs_preparing, preflight
    from retrace_jax.training.prepare import prepare

    cfg = load_config(args.config, args.set)
    initialize(cfg.train.distributed)  # before anything touches a device
    preflight(cfg, args.stage)  # what cannot run on the target or the devices, before any work
    compilation_cache()  # a rerun (e.g. a resume) loads its programs instead of compiling them
    if args.stage == "export":  # prints only: the run's own log files stay the run's
        return export_checkpoint(cfg, args.step, MetricsLog(None))
    with run_lock(cfg.out):  # one run at a time in OUT, refused before anything is written
        # a Ctrl-C that JAX swallowed is raised again at the next record (preparation and training log often)
        log = MetricsLog(cfg.out, cfg.train.tensorboard, before_record=raise_if_interrupted)
        try:
            if needs_preparing(cfg, args.stage):
                prepare(cfg, log)
            if args.stage in ("all", "train"):
                summary = train(cfg, log)
                if summary.get("stopped") == "SIGTERM":  # preempted: the job must not look finished
                    print(f"stopped by SIGTERM at step {summary['step']} of {cfg.train.steps} (checkpoint saved in "
                          f"{os.path.join(cfg.out, 'checkpoints')}); rerun the same command to resume",
                          file=sys.stderr, flush=True)
                    raise SystemExit(128 + signal.SIGTERM)
                return summary
        finally:
            log.close()

