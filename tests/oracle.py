"""An oracle drafter for lossless tests: it proposes the target's own greedy continuation, with errors
injected at chosen positions, so that every acceptance length from 0 to ``block_size - 1`` occurs.

A drafter that is never right checks only the first slot of each verify pass: every proposal is
rejected, and the target's token at slot 0 is all that is committed. The oracle's proposals are right
wherever the plan says so, so the verify pass's later slots (their causal mask, their positions, their
keys in the cache) decide the output, and a fault there changes it.

    oracle = Oracle.build(target, prompts, max_new_tokens=24, block_size=5)
    out = rj.generate(target, prompts, 24, drafter=oracle.drafter)
    assert out.tokens == oracle.expected_tokens()
    assert out.acceptance_lengths == oracle.expected_acceptance()

The drafter is a real :class:`~retrace_jax.models.drafter.DFlashDrafter` (random weights; a ReTrace or
draft-vocabulary one if asked) whose ``draft`` still runs the whole drafter, then returns, for each block
slot, a hidden state whose logits under the target's head (or the draft vocabulary's rows of it) have
their maximum at the planned token. The plan is indexed by absolute position, the position of the
block's anchor being the drafter cache's length, so the oracle needs nothing from the loop but what a
drafter is given.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import retrace_jax as rj
from retrace_jax.models.drafter import DFlashDrafter


class Plan(nnx.Variable):
    """Non-trainable oracle state: the head-row index to propose at each (row, position)."""


class OracleDrafter(DFlashDrafter):
    """A DFlash drafter whose proposals follow a plan (see the module docstring)."""

    def draft(self, emb_btd, cache, memory=None, beta=1.0, attention: str = "auto"):
        hidden = super().draft(emb_btd, cache, memory, beta, attention=attention)
        plan = self.plan[...]
        b, t, _ = hidden.shape
        rows = jnp.minimum(jnp.arange(b), plan.shape[0] - 1)  # padding rows of a bucket reuse the last row
        positions = jnp.clip(cache.lengths[:, None] + jnp.arange(t), 0, plan.shape[1] - 1)
        steered = self.probe[...][plan[rows[:, None], positions]]  # [B, T, d]
        return steered.astype(hidden.dtype) + 0.0 * hidden  # the drafter's own pass stays in the program


def probe_vectors(head_ud: np.ndarray) -> np.ndarray:
    """``[U, d]`` vectors whose scores under the head ``[U, d]`` have their strict maximum at their own
    row: the columns of the head's pseudo-inverse (a projection onto its row space is largest on the
    diagonal for random heads), scaled so that the margin is large. Checked, not assumed."""
    head = head_ud.astype(np.float64)
    probe = np.linalg.pinv(head).T  # [U, d]: head @ probe.T is the projection onto head's column space
    scores = head @ probe.T
    diag = np.diag(scores)
    off = np.where(np.eye(len(head), dtype=bool), -np.inf, scores).max(axis=1)
    if not np.all(diag > off):
        raise ValueError(f"{int(np.sum(diag <= off))} head rows cannot be singled out by a probe vector")
    return (probe * (40.0 / np.min(diag - off))).astype(np.float32)


@dataclasses.dataclass
class Oracle:
    drafter: OracleDrafter
    prompts: list[list[int]]
    truth: list[list[int]]  # each row's greedy continuation (no stop tokens), longer than max_new_tokens
    proposed: list[np.ndarray]  # [P] per row: the token the drafter proposes at each absolute position
    max_new_tokens: int
    block_size: int
    stop_token_ids: tuple[int, ...] = ()

    @classmethod
    def build(cls, target, prompts, max_new_tokens: int, block_size: int, *, schedule=None, retrace=False,
              draft_vocab=None, stop_token_ids=(), seed: int = 0, **generate_kwargs) -> "Oracle":
        """The oracle for ``prompts``. ``schedule(row)`` gives the acceptance lengths (proposals accepted
        per round, 0..block_size-1) that row ``row`` should see, cycled; the default runs through every
        length, starting at a different one for each row. ``generate_kwargs`` go to the plain run that
        finds the greedy continuation."""
        j = block_size - 1
        if schedule is None:
            lengths = [j] + list(range(j)) + [j]
            schedule = lambda row: lengths[row % len(lengths):] + lengths[:row % len(lengths)]  # noqa: E731
        horizon = max_new_tokens + 2 * block_size
        truth = rj.generate(target, prompts, horizon, **generate_kwargs).tokens
        base = rj.init_drafter(target.cfg, mask_token_id=target.cfg.vocab_size - 1, num_layers=1,
                               block_size=block_size, retrace=_retrace_config(retrace),
                               draft_vocab=draft_vocab, dtype=target.dtype, seed=seed)
        head = np.asarray(jax.device_get(target.head_weight()), np.float32)
        ids = np.arange(target.cfg.vocab_size) if draft_vocab is None else np.asarray(draft_vocab)
        index_of = {int(t): i for i, t in enumerate(ids)}
        width = max(map(len, prompts)) + horizon + 2 * block_size
        plan = np.zeros((len(prompts), width), np.int32)
        proposed = []
        for row, (prompt, cont) in enumerate(zip(prompts, truth, strict=True)):
            wrong = _error_positions(len(prompt), len(cont), j, schedule(row))
            want = np.zeros(width, np.int64)
            want[len(prompt):len(prompt) + len(cont)] = cont
            for p in wrong:
                want[p] = (want[p] + 1) % target.cfg.vocab_size
            plan[row] = [index_of.get(int(t), 0) for t in want]
            proposed.append(ids[plan[row]])
        drafter = OracleDrafter(base.cfg, dtype=target.dtype, rngs=nnx.Rngs(seed))
        nnx.update(drafter, nnx.state(base))
        drafter.plan = Plan(jnp.asarray(plan))
        drafter.probe = Plan(jnp.asarray(probe_vectors(head[ids]), target.dtype))
        return cls(drafter, [list(p) for p in prompts], truth, proposed, max_new_tokens, block_size,
                   tuple(stop_token_ids))

    def expected_tokens(self) -> list[list[int]]:
        """Plain greedy decoding's output: the continuation up to max_new_tokens or a stop token."""
        return [self._cut(cont) for cont in self.truth]

    def expected_acceptance(self) -> list[list[int]]:
        """Tokens committed per round (``a + 1``) as the official loop counts them, simulated from the plan."""
        out = []
        for prompt, cont, proposed in zip(self.prompts, self.truth, self.proposed, strict=True):
            want, start, rounds = self._cut(cont), len(prompt), []
            done = len(want) == 1  # the prefill's token alone ends the row
            while not done:
                a = 0
                while a < self.block_size - 1 and proposed[start + a + 1] == cont[start + a + 1 - len(prompt)]:
                    a += 1
                rounds.append(a + 1)
                start += a + 1
                done = start - len(prompt) + 1 >= len(want)
            out.append(rounds)
        return out

    def _cut(self, cont: list[int]) -> list[int]:
        cont = cont[:self.max_new_tokens]
        stops = [i for i, t in enumerate(cont) if t in self.stop_token_ids]
        return cont[:stops[0] + 1] if stops else cont


def _error_positions(prompt_len: int, length: int, j: int, schedule: list[int]) -> set[int]:
    """The positions whose proposals are wrong so that the rounds accept ``schedule`` (cycled): a round
    whose anchor is at ``s`` and that should accept ``a < j`` proposals has a wrong one at ``s + a + 1``,
    which is where the next round's anchor goes."""
    wrong, start, i = set(), prompt_len, 0
    while start < prompt_len + length:
        a = schedule[i % len(schedule)]
        if a < j:
            wrong.add(start + a + 1)
        start += a + 1
        i += 1
    return wrong


def _retrace_config(retrace) -> "rj.ReTraceConfig | None":
    """``retrace``: False (DFlash), True (the default ReTrace module) or a ``ReTraceConfig``."""
    if isinstance(retrace, rj.ReTraceConfig):
        return retrace
    return rj.ReTraceConfig() if retrace else None
