"""One process of the multi-process inference test (tests/parallel/test_multiprocess.py): greedy plain and
speculative generation (the oracle drafter of tests/oracle.py: every acceptance length) on a (2, 2, 2) mesh
spanning the processes equal one process without a mesh."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from retrace_jax.parallel.distributed import initialize  # noqa: E402

initialize("auto")

import jax  # noqa: E402
import numpy as np  # noqa: E402

import retrace_jax as rj  # noqa: E402
from tests.oracle import Oracle  # noqa: E402


def main():
    assert jax.process_count() == 2 and jax.device_count() == 8, (jax.process_count(), jax.device_count())
    target = rj.tiny.tiny_target()
    rng = np.random.RandomState(0)
    prompts = [rng.randint(0, 511, (n,)).tolist() for n in (5, 9, 3, 7, 6)]
    oracle = Oracle.build(target, prompts, 12, 4)  # every acceptance length 0..3 (tests/oracle.py)
    drafter = oracle.drafter
    mesh = rj.make_mesh("data=2,fsdp=2,tensor=2")
    sharded = rj.generate(target, prompts, 12, drafter=drafter, mesh=mesh)
    plain = rj.generate(target, prompts, 12, mesh=mesh)
    local = rj.generate(target, prompts, 12, drafter=drafter)  # this process alone, no mesh
    assert sharded.tokens == local.tokens == plain.tokens, (sharded.tokens, local.tokens, plain.tokens)
    assert sharded.acceptance_lengths == local.acceptance_lengths == oracle.expected_acceptance()
    print(f"process {jax.process_index()}: the cross-process mesh gives the single-process tokens")
    print("ok")


if __name__ == "__main__":
    main()
