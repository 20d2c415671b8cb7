"""The device kernels behind ``implementation="pallas_gpu"``, ``"pallas_tpu"`` and ``"cudnn"`` (and the
helpers of ``"split_gpu"``, whose kernel is in ``split_decode.py``).

The Pallas kernels are imported when first used, so a JAX without them fails with a clear error at that
call, never at ``import retrace_jax``. They run on their device only, unless :func:`pallas_interpret` is
active while a program is traced: then they run in Pallas' interpret mode on any backend (slow; the CPU
tests compare them with the reference that way). Shape letters: :mod:`retrace_jax.attention`.
"""

from __future__ import annotations

import contextlib
import contextvars
import importlib

import jax
import jax.numpy as jnp

_INTERPRET = contextvars.ContextVar("retrace_jax_pallas_interpret", default=False)


@contextlib.contextmanager
def pallas_interpret(on: bool = True):
    """Inside this block, programs traced with a Pallas implementation run its kernels in Pallas'
    interpret mode on any backend (slow; for tests and for checking a script on a CPU). The choice is
    made when a program is traced, so a program compiled inside the block keeps it."""
    token = _INTERPRET.set(on)
    try:
        yield
    finally:
        _INTERPRET.reset(token)


def interpreting() -> bool:
    """Whether the Pallas kernels run in interpret mode (see :func:`pallas_interpret`)."""
    return _INTERPRET.get()


_PALLAS_BACKENDS = {"pallas_gpu": "gpu", "split_gpu": "gpu", "pallas_tpu": "tpu"}


def check_pallas_backend(implementation: str) -> None:
    """Refuses a Pallas implementation off its device (unless interpreting), with the way out."""
    backend = _PALLAS_BACKENDS[implementation]
    if jax.default_backend() != backend and not interpreting():
        raise ValueError(f"attention={implementation!r} needs a {backend.upper()} (JAX's backend here is "
                         f"{jax.default_backend()!r}); use attention='auto' or 'chunked', or trace the program "
                         f"inside retrace_jax.attention.pallas_interpret() to run the kernel in Pallas' "
                         f"interpret mode (slow; for tests)")


def pallas_op(module: str):
    """Imports ``jax.experimental.pallas.ops.<module>`` when a kernel is first used, with a clear error
    where this JAX does not ship it; ``"split_gpu"``: this library's own kernel
    (:mod:`retrace_jax.attention.split_decode`, which imports Pallas)."""
    own = module == "split_gpu"
    name = "retrace_jax.attention.split_decode" if own else f"jax.experimental.pallas.ops.{module}"
    needs = "jax.experimental.pallas and its Triton module" if own else name
    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise RuntimeError(f"this attention implementation needs {needs}, which JAX {jax.__version__} does not "
                           f"provide ({e}); use attention='auto' or 'chunked'") from e


def decode_kernel_plan(s: int, d: int) -> tuple[int, int] | None:
    """``(k_splits, block_k)`` for the Pallas GPU decode kernel over ``S`` slots, or None where the call
    stays chunked: the kernel splits the slots into ``k_splits`` parts walked in parallel, each in blocks
    of ``block_k >= 16`` slots, and its tiles need a power-of-two head dim of at least 16."""
    if d < 16 or d & (d - 1):
        return None
    for block_k in (64, 32, 16):
        for k_splits in (16, 8, 4, 2, 1):
            if s % (k_splits * block_k) == 0:
                return k_splits, block_k
    return None


def decode_kernel_cached(q_btkgd, limit_bt, k_lbksd, v_lbksd, layer, plan, walk):
    """The Pallas GPU decode kernel over the slots ``s < min_t limit[b, t]`` that every query of row ``b``
    sees (all ``T * G`` queries of a KV head go through the kernel as one head group), then the chunked
    walk over the extra keys and the slots ``min_t limit[b, t] <= s < limit[b, t]``, continuing the
    kernel's online softmax from its residuals (row maximum and sum)."""
    b, t, kv, g, d = q_btkgd.shape
    k_splits, block_k = plan
    lo_b = jnp.min(limit_bt, axis=1)
    # The kernel takes [B, S, K, D] and swaps it to head-major itself: given the head-major layer swapped
    # once, XLA folds the two transposes away.
    k, v = (jax.lax.dynamic_index_in_dim(buf, layer, 0, keepdims=False).astype(q_btkgd.dtype).swapaxes(1, 2)
            for buf in (k_lbksd, v_lbksd))
    q_bhd = q_btkgd.transpose(0, 2, 1, 3, 4).reshape(b, kv * t * g, d)  # head (k, t, g): one group per KV head
    decode = pallas_op("gpu.decode_attention")
    o_bhd, (l_bh, m_bh) = decode.gqa(q_bhd, k, v, kv_seq_len=lo_b, block_k=block_k, k_splits=k_splits,
                                     return_residuals=True, interpret=interpreting())
    m = m_bh.reshape(b, kv, t, g).transpose(0, 1, 3, 2)  # [B, K, G, T]
    l = l_bh.reshape(b, kv, t, g).transpose(0, 1, 3, 2)
    o = o_bhd.reshape(b, kv, t, g, d).transpose(0, 1, 3, 2, 4).astype(jnp.float32)  # [B, K, G, T, D]
    return walk(q_btkgd, limit_bt, lo_b=lo_b, state=(m, l, o * l[..., None]))


def splash_fresh(q_bthd, k_btkd, v_btkd):
    """Causal prefill through Pallas TPU splash attention: one MQA kernel per (row, KV head) with its
    ``G`` query heads. ``T`` is padded up to the block size (128, or 512 where it divides): padding keys
    come after every real query, so the causal mask hides them and the real outputs are exact."""
    splash = pallas_op("tpu.splash_attention")
    b, t, h, d = q_bthd.shape
    kv = k_btkd.shape[2]
    g = h // kv
    padded = -(-t // 128) * 128
    blk = 512 if padded % 512 == 0 else 128
    pad = ((0, 0), (0, padded - t), (0, 0), (0, 0))
    q = jnp.pad(q_bthd.astype(jnp.float32) * d**-0.5, pad).astype(q_bthd.dtype)
    k = jnp.pad(k_btkd.astype(q_bthd.dtype), pad)
    v = jnp.pad(v_btkd.astype(q_bthd.dtype), pad)
    mask = splash.MultiHeadMask([splash.CausalMask((padded, padded))] * g)
    sizes = splash.BlockSizes(block_q=blk, block_kv=blk, block_kv_compute=blk)
    kernel = splash.make_splash_mqa_single_device(mask, block_sizes=sizes, interpret=interpreting())
    q_bkgtd = q.reshape(b, padded, kv, g, d).transpose(0, 2, 3, 1, 4)
    k_bktd, v_bktd = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)
    out = jax.vmap(jax.vmap(kernel))(q_bkgtd, k_bktd, v_bktd)  # [B, K, G, T', D]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, padded, h, d)[:, :t].astype(q_bthd.dtype)
