"""The benchmarks' two speed conventions (benchmarks/speed.py): end to end and decode only."""

import math

import pytest

import retrace_jax as rj
from benchmarks.speed import rates, time_methods
from retrace_jax.models.tiny import tiny_target


def test_rates_pool_end_to_end_and_decode_only():
    runs = [{"tokens": 11, "total_s": 2.0, "prefill_s": 1.0}, {"tokens": 21, "total_s": 3.0, "prefill_s": 1.0}]
    got = rates(runs)
    assert got["end_to_end"] == pytest.approx(32 / 5.0)
    assert got["decode"] == pytest.approx(30 / 3.0)  # the first token of each run belongs to prefill
    assert math.isnan(rates([{"tokens": 1, "total_s": 1.0, "prefill_s": 1.0}])["decode"])


def test_time_methods_times_prefill_as_the_same_program_stopped_at_its_first_token():
    target = tiny_target()
    drafter = rj.init_drafter(target.cfg, mask_token_id=target.cfg.vocab_size - 1, num_layers=1, block_size=4)
    ids = [5, 9, 14, 3]
    methods = {"plain": {}, "spec": {"drafter": drafter}}
    timed = time_methods(target, ids, 24, methods, repeats=3, stop_token_ids=[7], temperature=1.0, seed=3)
    assert set(timed) == {"plain", "spec"}
    for name, t in timed.items():
        full = rj.generate(target, [ids], 24, stop_token_ids=[7], temperature=1.0, seed=3, **methods[name])
        assert t["tokens"] == len(full.tokens[0])
        assert 0 < t["prefill_s"] and 0 < t["total_s"]
    with pytest.raises(ValueError, match="repeats"):
        time_methods(target, ids, 24, methods, repeats=0)


@pytest.mark.slow  # CI time; pytest -m slow runs it
def test_compile_time_benchmark_runs_and_reports_every_program(tmp_path, capsys):
    """benchmarks/compile_time.py on a small model: a row per program, layer loop and option set, with
    positive stage times (the numbers of docs/performance.md come from its full-size run)."""
    import json

    import jax

    from benchmarks import compile_time

    out = tmp_path / "compile_time.json"
    cache = jax.config.jax_enable_compilation_cache
    try:
        compile_time.main(["--layers", "4", "--quick", "--tokens", "8", "--repeats", "1", "--compile-repeats", "1",
                           "--variants", "unrolled", "--options", "cpu-preset", "--retrace", "--out", str(out)])
    finally:
        jax.config.update("jax_enable_compilation_cache", cache)  # the benchmark turns it off
    rows = json.loads(out.read_text())["rows"]
    assert [(r["program"], r["layer_loop"], r["options"]) for r in rows] == [
        ("plain", "unrolled", "cpu-preset"), ("speculative", "unrolled", "cpu-preset"),
        ("retrace", "unrolled", "cpu-preset")]
    assert all(r["compile_s"] > 0 and r["ms_per_token"] > 0 for r in rows)
    with pytest.raises(SystemExit) as exit_:
        compile_time.main(["--variants", "python"])
    assert exit_.value.code == 2 and "unknown variants ['python']" in capsys.readouterr().err
