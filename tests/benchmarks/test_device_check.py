"""The accelerator check runs end to end on tiny shapes (``--smoke``) and writes its table and JSON."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_device_check_smoke(tmp_path):
    env = dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu")
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "device_check.py"), "--smoke",
                           "--out-dir", str(tmp_path)], env=env, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.load(open(tmp_path / "device_check.json"))["rows"]
    whats = {r["what"] for r in rows}
    assert {"plain decode step", "speculative round", "prefill (chunked)"} <= whats
    assert not [r for r in rows if "error" in r]
    assert any(w.startswith("verify pass") for w in whats)
    spec = [r for r in rows if r["what"].startswith("generate (speculative")]
    # at a short and a long prompt; lossless in float32, also with a random drafter
    assert [r["context"] for r in spec] == [64, 256] and all(r["same_tokens"] is True for r in spec)
    lossless = {(r["dtype"], r["precision"], r["what"]): r["same_tokens"] for r in rows
                if r["what"].startswith("lossless")}
    # a CPU's float32 products are full at both precisions
    assert lossless[("float32", "default", "lossless (auto)")] is True
    assert lossless[("float32", "default", "lossless (chunked)")] is True
    assert lossless[("float32", "highest", "lossless (auto)")] is True
    assert len(lossless) == 5
    assert all(float(r["max_abs_err"]) < 1e-4 for r in rows if "max_abs_err" in r)
    assert (tmp_path / "device_check.md").read_text().count("|") > 20
    # issue 57's variants, a row each: the layer loops under XLA's default options (a CPU has no option
    # sets here), with the weight-sized instructions of their step, and the projections joined or not
    loops = {r["what"]: r for r in rows if r.get("options") == "default"}
    assert loops["plain decode step (unrolled, one copy)"]["weight_copies"] == 0  # views of the stacked weights
    assert loops["plain decode step (unrolled, one copy)"]["kept_bytes"] < loops[
        "plain decode step (unrolled, per-layer copies)"]["kept_bytes"]
    assert loops["plain decode step (scan)"]["weight_copies"] > 0  # XLA:CPU copies each layer's slices
    assert {"projection products (joined)", "projection products (separate)"} <= whats
    # the attention rows: attention alone at each attention context, per implementation (a CPU: dense and
    # the chunked walk), then plain steps at the longer context
    attention = {(r["what"], r["batch"], r["context"], r["attention"]) for r in rows if "attention" in r}
    assert attention == {(w, b, c, a) for w, b in (("decode attention", 1), ("decode attention", 8),
                                                   ("verify attention", 1))
                         for c in (64, 256) for a in ("dense", "chunked")}
    assert {(r["what"], r["context"]) for r in rows if r["what"].startswith("plain decode step (")
            and r.get("context") == 256} == {("plain decode step (dense)", 256), ("plain decode step (chunked)", 256)}
