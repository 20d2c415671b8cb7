"""Commit arithmetic against a plain-Python reference, for any tokens, counts, stops and limits."""

import jax.numpy as jnp
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from retrace_jax.commit import OutputBuffer, commit

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


@settings(max_examples=200, deadline=None)
@given(rows=st.lists(row, min_size=1, max_size=4), max_new=st.integers(1, CAP),
       stops=st.lists(st.integers(0, VOCAB - 1), max_size=3))
def test_commit_matches_reference(rows, max_new, stops):
    rows = [(e[:max_new], d or len(e[:max_new]) >= max_new, n, c) for e, d, n, c in rows]
    tokens = np.zeros((len(rows), CAP), np.int32)
    for b, (existing, *_rest) in enumerate(rows):
        tokens[b, : len(existing)] = existing
    buf = OutputBuffer(jnp.asarray(tokens), jnp.asarray([len(r[0]) for r in rows], jnp.int32),
                       jnp.asarray([r[1] for r in rows]))
    stop_ids = jnp.asarray(stops + [-1] * (4 - len(stops)), jnp.int32)
    got = commit(buf, jnp.asarray([r[2] for r in rows], jnp.int32), jnp.asarray([r[3] for r in rows], jnp.int32),
                 jnp.int32(max_new), stop_ids)
    for b, (existing, done, new, count) in enumerate(rows):
        want, want_done = reference(existing, done, new, count, max_new, stops)
        n = int(got.num[b])
        assert np.asarray(got.tokens[b, :n]).tolist() == want
        assert bool(got.done[b]) == want_done
        # Nothing is written past the committed tokens.
        assert np.asarray(got.tokens[b, n:]).tolist() == tokens[b, n:].tolist()
