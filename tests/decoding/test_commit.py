"""Commit arithmetic against a plain-Python reference, for any tokens, counts, stops and limits."""

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from retrace_jax.decoding.commit import OutputBuffer, commit

K, CAP, VOCAB = 5, 12, 6


def reference(existing, done, new, count, max_new, stops):
    out = list(existing)
    if done:
        return out, True
    for tok in new[:count]:
        if len(out) >= max_new:
            break
        out.append(tok)
        if tok in stops:
            return out, True
    return out, len(out) >= max_new


row = st.tuples(
    st.lists(st.integers(0, VOCAB - 1), max_size=CAP),  # already committed
    st.booleans(),  # done
    st.lists(st.integers(0, VOCAB - 1), min_size=K, max_size=K),  # offered tokens
    st.integers(0, K),  # count
)


ROWS, STOPS = 4, 4
# One compiled program for every drawn case: the batch is padded to ROWS with finished rows (which must
# stay unchanged) and the stop list to STOPS with -1.
jit_commit = jax.jit(commit)


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(row, min_size=1, max_size=ROWS), max_new=st.integers(1, CAP),
       stops=st.lists(st.integers(0, VOCAB - 1), max_size=STOPS - 1))
def test_commit_matches_reference(rows, max_new, stops):
    rows = [(e[:max_new], d or len(e[:max_new]) >= max_new, n, c) for e, d, n, c in rows]
    rows += [([], True, [0] * K, K)] * (ROWS - len(rows))  # padding rows: finished, so unchanged
    tokens = np.zeros((ROWS, CAP), np.int32)
    for b, (existing, *_rest) in enumerate(rows):
        tokens[b, : len(existing)] = existing
    buf = OutputBuffer(jnp.asarray(tokens), jnp.asarray([len(r[0]) for r in rows], jnp.int32),
                       jnp.asarray([r[1] for r in rows]))
    stop_ids = jnp.asarray(stops + [-1] * (STOPS - len(stops)), jnp.int32)
    got = jit_commit(buf, jnp.asarray([r[2] for r in rows], jnp.int32), jnp.asarray([r[3] for r in rows], jnp.int32),
                     jnp.int32(max_new), stop_ids)
    got_tokens, got_num, got_done = (np.asarray(x) for x in (got.tokens, got.num, got.done))
    for b, (existing, done, new, count) in enumerate(rows):
        want, want_done = reference(existing, done, new, count, max_new, stops)
        n = int(got_num[b])
        assert got_tokens[b, :n].tolist() == want
        assert bool(got_done[b]) == want_done
        # Nothing is written past the committed tokens.
        assert got_tokens[b, n:].tolist() == tokens[b, n:].tolist()
