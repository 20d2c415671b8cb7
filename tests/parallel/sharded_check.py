"""Run in its own process with N CPU devices (see test_sharding.py): sharded generation equals the
single-device run, parameters and caches carry the intended shardings.

    python tests/parallel/sharded_check.py WORKDIR                       # 8 devices, four meshes, four methods
    python tests/parallel/sharded_check.py WORKDIR --devices 4 --mesh data=2,tensor=2 --methods plain,retrace
"""

import argparse
import os
import sys


def parse_args(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("workdir")
    p.add_argument("--devices", type=int, default=8)
    p.add_argument("--mesh", action="append", help="mesh spec (repeatable); default: four 8-device meshes")
    p.add_argument("--methods", default="plain,oracle,dflash,retrace,sampled,stream,stream_plain")
    return p.parse_args(argv)


ARGS = parse_args()
# XLA reads the device count when jax is imported.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={ARGS.devices}"

import dataclasses  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import retrace_jax as rj  # noqa: E402
from retrace_jax.parallel.sharding import CACHE_AXES, named_sharding  # noqa: E402
from tests.helpers import make_hf_model, randomize, save_hf_model  # noqa: E402
from tests.oracle import Oracle  # noqa: E402

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15], [3], [40, 41, 42, 43]]


DEFAULT_MESHES = ("data=8", "data=2,tensor=4", "tensor=8", "data=2,fsdp=2,tensor=2")


def run_all(target, oracle, dflash, retrace, mesh, methods):
    kw = dict(max_new_tokens=20, mesh=mesh)
    runs = {
        "plain": lambda: rj.generate(target, PROMPTS, **kw),
        "oracle": lambda: rj.generate(target, PROMPTS, drafter=oracle.drafter, **kw),
        "dflash": lambda: rj.generate(target, PROMPTS, drafter=dflash, **kw),
        "retrace": lambda: rj.generate(target, PROMPTS, drafter=retrace, **kw),
        "sampled": lambda: rj.generate(target, PROMPTS, drafter=retrace, temperature=1.0, seed=3, **kw),
        # a stream of 8 prompts through 3 slots (on a mesh rounded up to the data axis): refills inside
        # the loop write one row of the sharded caches; the tokens are those of the static batch
        "stream": lambda: _stream_as_static(target, retrace, kw),
        "stream_plain": lambda: rj.generate(target, PROMPTS * 2, slots=3, temperature=1.0, seed=2, **kw),
    }
    return {name: runs[name]() for name in methods}


def _stream_as_static(target, drafter, kw):
    out = rj.generate(target, PROMPTS * 2, drafter=drafter, slots=3, **kw)
    static = rj.generate(target, PROMPTS * 2, drafter=drafter, **kw)
    assert (out.tokens, out.acceptance_lengths) == (static.tokens, static.acceptance_lengths)
    return out


def main(workdir, devices, specs, methods):
    assert jax.device_count() == devices, jax.devices()
    model = make_hf_model("qwen3", num_attention_heads=16, num_key_value_heads=8, head_dim=8)
    target_dir = save_hf_model(model, os.path.join(workdir, "target"))
    target = rj.load_target(target_dir)
    dflash = randomize(rj.init_drafter(target.cfg, mask_token_id=127, num_layers=2, block_size=4), seed=1, scale=0.1)
    retrace_cfg = dataclasses.replace(dflash.cfg, retrace=rj.ReTraceConfig())
    retrace = randomize(rj.DFlashDrafter(retrace_cfg, rngs=nnx.Rngs(0)), seed=4, scale=0.1)
    dflash_dir, retrace_dir = os.path.join(workdir, "dflash"), os.path.join(workdir, "retrace")
    rj.save_drafter(dflash, dflash_dir)
    rj.save_drafter(retrace, retrace_dir)
    oracle = Oracle.build(target, PROMPTS, 20, 4, retrace=True)  # every acceptance length 0..3, ReTrace memory on
    reference = run_all(target, oracle, dflash, retrace, None, methods)
    if "oracle" in methods:
        assert reference["oracle"].tokens == oracle.expected_tokens()
        assert reference["oracle"].acceptance_lengths == oracle.expected_acceptance()
    if {"retrace", "dflash"} <= set(methods):
        assert reference["retrace"].acceptance_lengths != reference["dflash"].acceptance_lengths

    for spec in specs:
        mesh = rj.make_mesh(spec)
        t = rj.load_target(target_dir, mesh=mesh)  # each device reads its own shards
        d = rj.load_drafter(dflash_dir, t, mesh=mesh)
        r = rj.load_drafter(retrace_dir, t, mesh=mesh)
        tensor, fsdp = mesh.shape["tensor"], mesh.shape["fsdp"]
        # q/k/v joined: [layers, d, kv_heads, heads / kv_heads + 2, head_dim], stacked, split over KV heads
        q = t.layers.self_attn.qkv_proj.kernel[...]
        want_q = P(None, "fsdp" if fsdp > 1 else None, "tensor" if tensor > 1 else None)
        assert tuple(q.sharding.spec[:3]) == tuple(want_q) and all(a is None for a in q.sharding.spec[3:]), (spec, q.sharding.spec)
        assert len(q.addressable_shards) == devices
        if tensor > 1:
            assert q.addressable_shards[0].data.shape[2] == q.shape[2] // tensor
        gate_up = t.layers.mlp.gate_up_proj.kernel[...]  # [layers, d, 2, I]: split over neurons
        assert tuple(gate_up.sharding.spec[3:]) == (("tensor",) if tensor > 1 else (None,)), gate_up.sharding.spec
        o = d.layers[0].self_attn.o_proj.kernel[...]
        assert o.sharding.spec == P("tensor" if tensor > 1 else None, "fsdp" if fsdp > 1 else None), o.sharding.spec
        emb = t.embed_tokens.embedding[...]
        assert emb.sharding.spec == P("tensor" if tensor > 1 else None, "fsdp" if fsdp > 1 else None)

        graphdef, state = nnx.split(t)

        @jax.jit
        def cache_after_prefill(state, tokens):  # the caches of the loops are built the same way
            model = nnx.merge(graphdef, state)
            return model(tokens, model.init_cache(tokens.shape[0], 16).constrain(mesh)).cache

        cache = cache_after_prefill(state, jnp.zeros((devices, 3), jnp.int32))
        assert cache.k.sharding.is_equivalent_to(named_sharding(CACHE_AXES, cache.k.shape, mesh), 5), cache.k.sharding

        got = run_all(t, oracle, d, r, mesh, methods)
        for name, out in reference.items():
            assert got[name] == out, (spec, name, got[name], out)
        print(f"mesh {spec}: {', '.join(methods)} outputs equal the single-device run")

    if 2 % devices:  # 2 KV heads over a tensor axis they do not divide
        small = save_hf_model(make_hf_model("qwen3"), os.path.join(workdir, "small"))  # 4 heads, 2 KV heads
        try:
            rj.load_target(small, mesh=rj.make_mesh(f"tensor={devices}"))
        except ValueError as err:
            assert f"do not divide over the tensor axis of size {devices}" in str(err), err
        else:
            raise AssertionError("a KV head count that does not divide the tensor axis must be refused")
    print("ok")


if __name__ == "__main__":
    main(ARGS.workdir, ARGS.devices, ARGS.mesh or DEFAULT_MESHES, ARGS.methods.split(","))
