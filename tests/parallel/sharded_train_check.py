"""Run in its own process with 8 CPU devices (see test_sharding.py): a train step on a (2, 2, 2) mesh
equals the single-device step, and parameters stay sharded as the logical-axis rules say."""

import os
import sys

os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"


import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import retrace_jax as rj  # noqa: E402
from retrace_jax.io.weights import model_specs  # noqa: E402
from retrace_jax.parallel.sharding import batch_sharding, named_sharding  # noqa: E402
from retrace_jax.training.step import StepOptions, adamw, init_opt_state, make_train_step  # noqa: E402
from tests.helpers import make_hf_model, randomize, save_hf_model  # noqa: E402


def run(target, drafter, tokens, mask, opts, mesh):
    if mesh is not None:
        target, drafter = rj.shard_model(target, mesh), rj.shard_model(drafter, mesh)
        tokens, mask = (jax.device_put(x, batch_sharding(mesh, 2)) for x in (tokens, mask))
    optimizer = adamw(1e-2, 10)
    target_def, target_state = nnx.split(target)
    drafter_def, state = nnx.split(drafter)
    state = jax.tree.map(jnp.copy, state)  # the step donates it
    opt_state = init_opt_state(optimizer, state, mesh)
    shardings = dict(drafter_shardings=jax.tree.map(lambda x: x.sharding, state),
                     opt_shardings=jax.tree.map(lambda x: x.sharding, opt_state)) if mesh is not None else {}
    step = make_train_step(target_def, drafter_def, optimizer, opts, mesh=mesh, **shardings)
    losses = []
    for i in range(3):
        state, opt_state, metrics = step(target_state, state, opt_state, tokens, mask, jnp.int32(i), jnp.uint32(0))
        losses.append(float(metrics["loss"]))
    return losses, nnx.merge(drafter_def, state)


def main(workdir):
    assert jax.device_count() == 8
    target = rj.load_target(save_hf_model(make_hf_model("qwen3"), os.path.join(workdir, "t")))
    rng = np.random.RandomState(0)
    tokens = jnp.asarray(rng.randint(0, 127, (8, 40)), jnp.int32)
    mask = jnp.asarray(np.r_[np.zeros(6), np.ones(34)][None].repeat(8, 0), jnp.int32)
    mesh = rj.make_mesh("data=2,fsdp=2,tensor=2")
    for objective in ("dflash", "retrace"):
        drafter = rj.init_drafter(target.cfg, mask_token_id=127, num_layers=2, block_size=4,
                                  retrace=rj.ReTraceConfig() if objective == "retrace" else None)
        drafter = randomize(drafter, seed=1, scale=0.05)
        opts = StepOptions(objective=objective, num_anchors=4, beta_warmup_steps=2)
        ref_losses, ref = run(target, drafter, tokens, mask, opts, None)
        losses, got = run(target, drafter, tokens, mask, opts, mesh)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
        axes = {s.path: s.axes for s in model_specs(got)}
        for (path, a), (_, b) in zip(nnx.to_flat_state(nnx.state(ref)), nnx.to_flat_state(nnx.state(got))):
            # Three AdamW steps of lr 1e-2: a sharded reduction order moves a weight by up to ~2e-5 (0.2% of
            # one step) where the second moment is tiny.
            np.testing.assert_allclose(np.asarray(a.get_value()), np.asarray(b.get_value()), atol=5e-5, rtol=1e-4,
                                       err_msg=str(path))
            value = b.get_value()
            want = named_sharding(axes.get(path, (None,) * value.ndim), value.shape, mesh)
            assert value.sharding.is_equivalent_to(want, value.ndim), (path, value.sharding)
        q = got.layers[0].self_attn.qkv_proj.kernel[...]  # [d, kv_heads, heads / kv_heads + 2, head_dim]
        assert q.sharding.spec[0] == "fsdp" and q.sharding.spec[1] == "tensor", q.sharding.spec
        print(f"{objective}: (2, 2, 2) mesh step equals one device; losses {np.round(losses, 5).tolist()}")
    print("ok")


if __name__ == "__main__":
    main(sys.argv[1])
