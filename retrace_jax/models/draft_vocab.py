"""A draft vocabulary: the drafter proposes only from the ``U`` tokens the target emits most often.

The drafter has no LM head of its own: it scores its block with the target's. Over the whole vocabulary
that head is most of a small target's drafting cost and most of a drafter training step (SmolLM2-135M:
49,152 x 576, about 21% of the target's weights, run on every drafted slot). With a draft vocabulary the
drafter scores only the rows of the target's head for ``U`` token ids (ascending, so that an argmax over
them breaks ties as an argmax over the whole vocabulary does), as EAGLE-3 (``d2t``) and FR-Spec do.

Lossless either way: the target still verifies every proposal over its full vocabulary. A token outside
the draft vocabulary is never proposed; at that slot the round ends and the target commits its own
token. With ``draft_rule="sample"`` the drafter's distribution q is zero outside the draft vocabulary,
which rejection sampling handles exactly. Training counts a label outside the draft vocabulary as a
wrong slot (no loss: no row of the head can score it).

Stored beside the official DFlash checkpoint: ``config.json`` gains ``draft_vocab_size`` and the ids go to
``draft_vocab.safetensors`` (tensor ``draft_token_ids``). ``model.safetensors`` stays the official layout;
a checkpoint without the two files is an ordinary DFlash drafter with the whole vocabulary.

Shape letters as in ``retrace_jax/attention/``; ``U`` is the draft vocabulary (``U <= V``).
"""

from __future__ import annotations

import hashlib
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from retrace_jax.models.layers import products

FILE = "draft_vocab.safetensors"
TENSOR = "draft_token_ids"


class DraftVocab(nnx.Variable):
    """The draft vocabulary's target token ids ``[U]``, int32, strictly ascending (never trained)."""


def check_ids(ids, vocab_size: int, where: str = "draft vocabulary") -> np.ndarray:
    """``ids`` as an int32 array after checking it is a non-empty, strictly ascending list of ids in
    ``[0, vocab_size)``; raises ``ValueError`` naming ``where`` otherwise.

    Every id is range-checked (not only the ends: the order is not known yet), and the order is checked
    in int64, since differences of int8 or uint16 ids wrap around (``int8: -100 - 100 == 56``)."""
    array = np.asarray(ids)
    if array.ndim != 1 or array.size == 0 or not np.issubdtype(array.dtype, np.integer):
        raise ValueError(f"{where}: expected a non-empty 1-D list of token ids, got shape {array.shape} "
                         f"of {array.dtype}")
    low, high = int(array.min()), int(array.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(f"{where}: token ids must lie in [0, {vocab_size}), got {low}...{high}")
    array = array.astype(np.int64)
    if np.any(np.diff(array) <= 0):
        raise ValueError(f"{where}: token ids must be strictly ascending (sorted, no repeats)")
    return array.astype(np.int32)


def token_counts(sequences, masks, vocab_size: int) -> np.ndarray:
    """How often each token id occurs at the masked-in positions (the responses) of ``sequences``."""
    tokens = [np.asarray(t)[np.asarray(m).astype(bool)] for t, m in zip(sequences, masks)]
    flat = np.concatenate(tokens) if tokens else np.zeros((0,), np.int64)
    return np.bincount(flat, minlength=vocab_size)[:vocab_size].astype(np.int64)


def frequent_tokens(counts, size: int) -> np.ndarray:
    """The ``size`` most frequent token ids of ``counts [V]`` (ties: the lower id), ascending."""
    counts = np.asarray(counts, np.int64)
    vocab = counts.shape[0]
    if isinstance(size, bool) or not isinstance(size, (int, np.integer)) or not 1 <= size <= vocab:
        raise ValueError(f"draft vocabulary size must be an integer in [1, {vocab}], got {size!r}")
    order = np.lexsort((np.arange(vocab), -counts))  # count descending, then id ascending
    return np.sort(order[:size]).astype(np.int32)


def coverage(counts, ids) -> float:
    """The share of the counted tokens that the draft vocabulary ``ids`` holds."""
    counts = np.asarray(counts, np.int64)
    total = counts.sum()
    return float(counts[np.asarray(ids)].sum() / total) if total else 1.0


class DraftHead(NamedTuple):
    """The columns of the target's LM head that score a draft vocabulary (computed once per program),
    laid out ``[d, U]`` as the CPU multiplies fastest (see ``retrace_jax.decoding.layer_loop.DecodeWeights``)."""

    weight_du: jax.Array  # [d, U]
    ids_u: jax.Array  # [U] target token ids, ascending


def draft_head(target, drafter) -> DraftHead | None:
    """The drafter's head over its draft vocabulary, or None when it drafts over the whole vocabulary."""
    vocab = getattr(drafter, "draft_vocab", None)
    return None if vocab is None else vocab_head(target, vocab.get_value())


def vocab_head(target, ids_u) -> DraftHead:
    """The head over the draft vocabulary of token ids ``ids_u`` (ascending): those rows of the target's."""
    return DraftHead(jnp.take(target.head_weight(), ids_u, axis=0).T, ids_u)


def draft_vocab_ids(drafter) -> np.ndarray | None:
    """The drafter's draft vocabulary as host token ids ``[U]``, or None when it drafts over the whole
    vocabulary."""
    vocab = getattr(drafter, "draft_vocab", None)
    return None if vocab is None else np.asarray(jax.device_get(vocab.get_value()), np.int32)


def vocab_digest(ids_u) -> str:
    """A short digest of a draft vocabulary's token ids, which names it in run settings and store keys."""
    return hashlib.sha256(np.asarray(ids_u, np.int32).tobytes()).hexdigest()[:16]


def head_logits(target, head: DraftHead | None, hidden_btd):
    """Logits over the draft vocabulary ``[..., U]`` (the whole vocabulary ``[..., V]`` without one)."""
    if head is None:
        return target.logits(hidden_btd)
    hidden = hidden_btd.astype(head.weight_du.dtype)
    return products(hidden, head.weight_du, (((hidden.ndim - 1,), (0,)), ((), ())))


def to_target_ids(head: DraftHead | None, index):
    """Target token ids of draft-vocabulary indices (unchanged without a draft vocabulary)."""
    return index if head is None else jnp.take(head.ids_u, index)


def to_draft_index(head: DraftHead | None, token_ids, vocab_size: int):
    """Draft-vocabulary indices of target token ids, -1 for ids outside it (unchanged without one)."""
    if head is None:
        return token_ids
    lookup = jnp.full((vocab_size,), -1, jnp.int32).at[head.ids_u].set(jnp.arange(head.ids_u.shape[0],
                                                                                   dtype=jnp.int32))
    return jnp.take(lookup, token_ids)


def to_full_vocab(head: DraftHead | None, values_u, vocab_size: int, fill=-jnp.inf):
    """Values over the draft vocabulary ``[..., U]`` spread to ``[..., V]`` (``fill`` elsewhere), e.g.
    logits or log-probabilities that the full-vocabulary code paths read."""
    if head is None:
        return values_u
    full = jnp.full(values_u.shape[:-1] + (vocab_size,), fill, values_u.dtype)
    return full.at[..., head.ids_u].set(values_u)
