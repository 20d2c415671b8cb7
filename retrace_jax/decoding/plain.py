"""Plain autoregressive decoding as one program: prefill, then a ``lax.while_loop`` of one-token steps.

The step is a pure function :func:`plain_step` ``(model, constants, carry) -> carry``; the compiled loop
calls it, and :class:`PlainStepper` calls it one jitted step at a time (benchmarks time it alone).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx, struct

from retrace_jax.decoding.buffers import spare_or_new
from retrace_jax.decoding.commit import OutputBuffer, commit, stop_non_finite
from retrace_jax.decoding.layer_loop import decode_weights, merge_target
from retrace_jax.decoding.programs import DecodeProgram
from retrace_jax.decoding.sampling import SamplingMode, SamplingParams, row_keys, step_keys
from retrace_jax.models.kv_cache import KVCache
from retrace_jax.models.target import prefill


@struct.dataclass
class PlainCarry:
    cache: KVCache
    buf: OutputBuffer
    last_b: jax.Array  # [B] the token fed to the next step


@struct.dataclass
class StepConstants:
    keys_b: jax.Array  # [B, 2] each row's random stream
    max_new: jax.Array  # int32 scalar
    stop_ids: jax.Array  # int32, one entry per stop token, padded with -1
    sampling: SamplingParams
    mode: SamplingMode = struct.field(pytree_node=False, default=SamplingMode())
    mesh: object = struct.field(pytree_node=False, default=None)
    attention: str = struct.field(pytree_node=False, default="auto")


def plain_init(model, tokens_bp, prompt_lens_b, live_b, max_new, stop_ids, sampling: SamplingParams, *, capacity,
               mode: SamplingMode = SamplingMode(), mesh=None, cache_dtype=None, attention="auto", spare=None):
    """Prefill and the first token of each row (key step 0), into ``spare`` (a cache of the right shape
    whose contents are stale: see ``retrace_jax/decoding/buffers.py``) or a new empty cache."""
    batch, prompt_len = tokens_bp.shape
    cache = spare_or_new(model, batch, prompt_len + capacity, cache_dtype, spare, "plain_generate").constrain(mesh)
    logits_bv, cache, _ = prefill(model, tokens_bp, prompt_lens_b, cache, attention=attention)
    consts = StepConstants(row_keys(sampling.seed, batch), jnp.asarray(max_new, jnp.int32), stop_ids, sampling,
                           mode=mode, mesh=mesh, attention=attention)
    first_b = sampling.choose(step_keys(consts.keys_b, jnp.zeros((batch,), jnp.int32)), logits_bv, mode)
    buf = stop_non_finite(OutputBuffer.empty(batch, capacity, ~live_b), logits_bv)
    buf = commit(buf, first_b[:, None], jnp.ones((batch,), jnp.int32), consts.max_new, stop_ids)
    return consts, PlainCarry(cache, buf, first_b)


def plain_step(model, consts: StepConstants, c: PlainCarry, feature_layers: tuple[int, ...] = ()):
    """One token for every row; finished rows keep their cache length and output. With
    ``feature_layers`` (static) returns ``(carry, features_bf)`` as well: the target's features of the
    token each row fed, at its position ``c.cache.lengths`` (see :meth:`TargetModel.run_layers`)."""
    out = model(c.last_b[:, None], c.cache, feature_layers=feature_layers, attention=consts.attention)
    logits_bv = model.logits(out.hidden[:, 0])
    next_b = consts.sampling.choose(step_keys(consts.keys_b, c.buf.num), logits_bv, consts.mode)
    lengths = jnp.where(c.buf.done, c.cache.lengths, out.cache.lengths)
    buf = stop_non_finite(c.buf, logits_bv)
    buf = commit(buf, next_b[:, None], jnp.ones_like(next_b), consts.max_new, consts.stop_ids)
    carry = PlainCarry(out.cache.replace(lengths=lengths).constrain(consts.mesh), buf, next_b)
    return (carry, out.features[:, 0]) if feature_layers else carry


@functools.partial(DecodeProgram, static_argnames=("graphdef", "capacity", "mode", "mesh", "cache_dtype",
                                                   "attention", "layer_loop"), donate_argnames=("spare",))
def plain_generate(graphdef, state, tokens_bp, prompt_lens_b, live_b, max_new, stop_ids,
                   sampling: SamplingParams, *, capacity, mode: SamplingMode = SamplingMode(), mesh=None,
                   cache_dtype=None, attention="auto", layer_loop="auto", kept=None, spare=None):
    """Greedy or sampled decoding of a right-padded batch; rows with ``live_b`` False are padding.

    Row ``b`` draws its ``n``-th token with ``fold_in(fold_in(PRNGKey(seed), b), n)``. With a ``mesh``
    the cache is sharded (batch over data, KV heads over tensor) like the parameters.
    An unrolled ``layer_loop`` takes the per-layer weights and the LM head from ``kept`` (see
    :func:`~retrace_jax.decoding.layer_loop.decode_weights`), or slices the layers itself when it is None.
    Returns the output buffer (``capacity`` >= ``max_new`` slots per row). Given a ``spare`` cache
    (donated: see ``retrace_jax/decoding/buffers.py``), decodes in it and returns ``(buffer, cache)``.
    """
    model = merge_target(graphdef, state, layer_loop, kept)
    consts, init = plain_init(model, tokens_bp, prompt_lens_b, live_b, max_new, stop_ids, sampling,
                              capacity=capacity, mode=mode, mesh=mesh, cache_dtype=cache_dtype, attention=attention,
                              spare=spare)
    final = jax.lax.while_loop(lambda c: ~jnp.all(c.buf.done), lambda c: plain_step(model, consts, c), init)
    return final.buf if spare is None else (final.buf, final.cache)


class PlainStepper:
    """The plain program one jitted step per Python call, with the layer loop ``generate`` would use
    (unrolled on CPU, with the target's kept per-layer weights): ``init`` runs the prefill, ``step``
    one token for every row. For benchmarks and debugging; the tokens are those of
    :func:`plain_generate`."""

    def __init__(self, target, layer_loop: str = "auto", **static):
        self._def, self._state = nnx.split(target)
        self._kept = decode_weights(target, layer_loop, self._state)
        self.consts = self.carry = None

        def init(state, kept, *args):
            return plain_init(merge_target(self._def, state, layer_loop, kept), *args, **static)

        def step(state, kept, consts, carry):
            return plain_step(merge_target(self._def, state, layer_loop, kept), consts, carry)

        self._init, self._step = DecodeProgram(init), DecodeProgram(step, donate_argnums=3)  # carry updated in place

    def init(self, tokens_bp, prompt_lens_b, live_b, max_new, stop_ids, sampling: SamplingParams) -> PlainCarry:
        self.consts, self.carry = self._init(self._state, self._kept, tokens_bp, prompt_lens_b, live_b, max_new,
                                             stop_ids, sampling)
        return self.carry

    def step(self) -> PlainCarry:
        """One token per row; the previous carry is donated (keep a copy to run a step again)."""
        self.carry = self._step(self._state, self._kept, self.consts, self.carry)
        return self.carry
