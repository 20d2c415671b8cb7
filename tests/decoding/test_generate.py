"""Greedy generation as one program: equal to transformers, batch-invariant, exact stopping."""

import pytest

import retrace_jax as rj
from tests.helpers import count_compiles, hf_greedy
from tests.oracle import Oracle

PROMPTS = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16, 17], [3], [40, 41]]


def test_batched_greedy_equals_hf_generate(family, hf_model_dir):
    model, directory = hf_model_dir(family)
    target = rj.load_target(directory)
    out = rj.generate(target, PROMPTS, max_new_tokens=24)
    for prompt, tokens in zip(PROMPTS, out.tokens):
        assert tokens == hf_greedy(model, prompt, 24)
    assert out.acceptance_lengths == [[1] * 24] * len(PROMPTS)


def test_rows_equal_prompts_run_alone(hf_model_dir):
    _, directory = hf_model_dir("qwen2")
    target = rj.load_target(directory)
    batched = rj.generate(target, PROMPTS, max_new_tokens=10).tokens
    alone = [rj.generate(target, [p], max_new_tokens=10).tokens[0] for p in PROMPTS]
    assert batched == alone


def test_stop_token_is_kept_and_ends_the_row(hf_model_dir):
    _, directory = hf_model_dir("llama")
    target = rj.load_target(directory)
    free = rj.generate(target, PROMPTS, max_new_tokens=30).tokens
    stop = free[0][4]  # a token row 0 emits at step 4 (or earlier)
    cut = free[0].index(stop) + 1
    out = rj.generate(target, PROMPTS, max_new_tokens=30, stop_token_ids=[stop])
    assert out.tokens[0] == free[0][:cut]
    for full, got, rounds in zip(free, out.tokens, out.acceptance_lengths):
        expected = full[: full.index(stop) + 1] if stop in full else full
        assert got == expected
        assert len(rounds) == len(got)


@pytest.mark.parametrize("n", [1, 7, 17])
def test_exactly_max_new_tokens(hf_model_dir, n):
    _, directory = hf_model_dir("qwen3")
    target = rj.load_target(directory)
    out = rj.generate(target, PROMPTS, max_new_tokens=n)
    assert [len(t) for t in out.tokens] == [n] * len(PROMPTS)


def test_second_call_in_same_bucket_compiles_nothing(hf_model_dir):
    _, directory = hf_model_dir("qwen3")
    target = rj.load_target(directory)
    rj.generate(target, [[1, 2, 3], [4, 5]], max_new_tokens=12, stop_token_ids=[2])
    with count_compiles() as compiled:
        # New prompts, lengths, batch size, max_new_tokens and stops, all inside the same buckets.
        out = rj.generate(target, [[7, 8, 9, 10, 11], [12]], max_new_tokens=9, stop_token_ids=[3, 4])
    assert compiled == []
    assert len(out.tokens) == 2
    with count_compiles() as compiled:  # the counter counts: another max_new_tokens bucket compiles
        rj.generate(target, [[7, 8, 9, 10, 11], [12]], max_new_tokens=40)
    assert compiled


def test_bad_inputs_give_clear_errors(hf_model_dir):
    _, directory = hf_model_dir("qwen3")
    target = rj.load_target(directory)
    limit = target.cfg.max_position_embeddings
    with pytest.raises(ValueError, match="max_position_embeddings=256"):
        rj.generate(target, [[1] * (limit - 4)], max_new_tokens=5)
    with pytest.raises(ValueError, match="outside"):
        rj.generate(target, [[1, 999]])
    with pytest.raises(ValueError, match="non-empty"):
        rj.generate(target, [[1], []])
    with pytest.raises(ValueError, match="non-empty list"):
        rj.generate(target, [])
    with pytest.raises(ValueError, match="max_new_tokens"):
        rj.generate(target, [[1]], max_new_tokens=0)
    with pytest.raises(ValueError, match="stop_token_ids"):
        rj.generate(target, [[1]], stop_token_ids=[-3])
    with pytest.raises(ValueError, match="temperature"):
        rj.generate(target, [[1]], temperature=-0.7)


def test_layer_loops_and_attention_paths_give_the_same_tokens():
    """Scanned or unrolled layers, chunked or dense attention: the same greedy tokens of plain decoding
    (tests/decoding/test_lossless.py runs speculative decoding, with a drafter whose rounds accept every
    length, on every path). A bfloat16 cache of a float32 model runs with that drafter (its rounding may
    change tokens, so only the lengths are checked)."""
    import retrace_jax as rj
    from retrace_jax.models.tiny import tiny_target

    target = tiny_target()
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    want = rj.generate(target, prompts, 20, layer_loop="scan", attention="dense").tokens
    drafter = Oracle.build(target, prompts, 20, 4).drafter
    for kwargs in ({"layer_loop": "unrolled"}, {"layer_loop": "scan", "attention": "chunked"}):
        assert rj.generate(target, prompts, 20, **kwargs).tokens == want, kwargs
    half = rj.generate(target, prompts, 20, cache_dtype="bfloat16", drafter=drafter)
    assert [len(t) for t in half.tokens] == [20, 20]
    with pytest.raises(ValueError, match="layer_loop"):
        rj.generate(target, prompts, 4, layer_loop="python")
    with pytest.raises(ValueError, match="attention"):
        rj.generate(target, prompts, 4, attention="flash")


@pytest.mark.parametrize("layer_loop", ["unrolled", pytest.param("scan", marks=pytest.mark.slow)])
def test_steppers_commit_what_generate_commits(layer_loop):
    """The step-at-a-time drivers (with the kept per-layer weights when unrolled) give generate's tokens."""
    import jax.numpy as jnp
    import numpy as np

    from retrace_jax.decoding.plain import PlainStepper
    from retrace_jax.decoding.sampling import SamplingParams
    from retrace_jax.decoding.speculative import SpeculativeStepper
    from retrace_jax.models.tiny import tiny_target

    target = tiny_target()
    oracle = Oracle.build(target, [[5, 6, 7, 8]], 12, 4)  # rounds of every acceptance length
    drafter = oracle.drafter
    tokens = jnp.asarray([[5, 6, 7, 8]], jnp.int32)
    args = (tokens, jnp.asarray([4], jnp.int32), jnp.ones((1,), bool), np.int32(12), jnp.full((8,), -1, jnp.int32),
            SamplingParams.make())
    want = rj.generate(target, [[5, 6, 7, 8]], 12, layer_loop=layer_loop).tokens[0]
    plain = PlainStepper(target, layer_loop=layer_loop, capacity=16)
    carry = plain.init(*args)
    while not bool(jnp.all(carry.buf.done)):
        carry = plain.step()
    assert carry.buf.tokens[0, : int(carry.buf.num[0])].tolist() == want
    spec = SpeculativeStepper(target, drafter, layer_loop=layer_loop, capacity=16, block_size=4)
    spec.init(*args)
    rounds = []
    while not spec.done:
        rounds.append(int(spec.step().accepted_b[0]) + 1)
    assert spec.carry.buf.tokens[0, : int(spec.carry.buf.num[0])].tolist() == want
    assert rounds == oracle.expected_acceptance()[0]


def test_unrolled_programs_keep_per_layer_weights_that_follow_the_target():
    """An unrolled program takes the target's layers as per-layer copies, and a tied head as a [d, V]
    copy, made once and kept beside the target: the same copies for every call, new ones when the
    weights change (never stale ones), and none left once the target is gone."""
    import gc
    import weakref

    import numpy as np

    from retrace_jax.decoding.layer_loop import decode_weights
    from retrace_jax.models.tiny import tiny_target

    target = tiny_target()
    assert target.cfg.tie_word_embeddings
    first = decode_weights(target, "unrolled")
    assert decode_weights(target, "unrolled") is first
    assert decode_weights(target, "scan") is None
    stacked = target.layers.mlp.down_proj.kernel[...]
    assert len(first.layers) == target.cfg.num_layers
    for i, layer in enumerate(first.layers):
        np.testing.assert_array_equal(layer["mlp"]["down_proj"]["kernel"][...], stacked[i])
    np.testing.assert_array_equal(first.head_dv, target.embed_tokens.embedding[...].T)

    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    before = rj.generate(target, prompts, 12, layer_loop="unrolled").tokens
    target.layers.mlp.down_proj.kernel.set_value(-stacked)
    after = rj.generate(target, prompts, 12, layer_loop="unrolled").tokens
    assert after != before  # the new weights were used
    assert after == rj.generate(target, prompts, 12, layer_loop="scan").tokens
    again = decode_weights(target, "unrolled")
    assert again is not first
    np.testing.assert_array_equal(again.layers[1]["mlp"]["down_proj"]["kernel"][...], -stacked[1])

    embedding = target.embed_tokens.embedding[...]  # a new embedding: a new head copy
    target.embed_tokens.embedding.set_value(embedding[::-1])
    moved = rj.generate(target, prompts, 12, layer_loop="unrolled").tokens
    assert moved == rj.generate(target, prompts, 12, layer_loop="scan").tokens
    np.testing.assert_array_equal(decode_weights(target, "unrolled").head_dv, embedding[::-1].T)

    kept = weakref.ref(again.layers[0]["mlp"]["down_proj"]["kernel"][...])
    del target, first, again, layer
    gc.collect()
    assert kept() is None


def test_decode_programs_compile_with_the_cpu_options_on_cpu(monkeypatch):
    """On CPU the decode programs go to XLA with CPU_COMPILER_OPTIONS: a bad option there fails the
    compilation, so the options do reach XLA; with the real ones the result is the plain jit's. Extra
    options are added where this XLA takes them; an option XLA does not know is dropped, not an error."""
    import jax
    import pytest

    from retrace_jax.decoding import programs
    from retrace_jax.decoding.plain import plain_generate
    from retrace_jax.decoding.speculative import speculative_generate

    if jax.default_backend() != "cpu":
        pytest.skip("the CPU compiler options apply on the CPU backend only")
    for program in (plain_generate, speculative_generate):
        assert isinstance(program, programs.DecodeProgram)
    assert plain_generate.cpu_extra_options is None and speculative_generate.cpu_extra_options is None
    assert programs.cpu_compiler_options(programs.SEVERAL_ROW_CPU_OPTIONS) == {
        **programs.CPU_COMPILER_OPTIONS, **programs.SEVERAL_ROW_CPU_OPTIONS}  # jax 0.10 takes them
    good = programs.DecodeProgram(lambda x: x * 2.0 + 1.0)
    assert float(good(3.0)) == float(good.default(3.0)) == 7.0
    unknown = {"xla_cpu_no_such_option_in_any_xla": "1"}
    assert programs.cpu_compiler_options(unknown) == programs.CPU_COMPILER_OPTIONS
    tolerant = programs.DecodeProgram(lambda x: x * 2.0 + 1.0, cpu_extra_options=unknown)
    assert float(tolerant(3.0)) == 7.0
    monkeypatch.setattr(programs, "CPU_COMPILER_OPTIONS", {"xla_cpu_opt_preset": "NO_SUCH_PRESET"})
    bad = programs.DecodeProgram(lambda x: x * 2.0 + 1.0)
    assert float(bad.default(3.0)) == 7.0
    with pytest.raises(jax.errors.JaxRuntimeError, match="xla_cpu_opt_preset"):
        bad(3.0)


def test_cpu_products_choose_the_speculative_programs_options(monkeypatch):
    """``cpu_products``: "auto" sends a speculative program's several-row products to Eigen for targets
    whose largest layer matrix holds 16 MiB or more (a Qwen2.5-0.5B-shaped config in float32, not a
    bfloat16 copy of half the bytes or the tiny target), the named choices are taken as they are, and a
    bad one is refused before anything compiles. Each choice reaches the speculative program (and
    nothing else) and decodes the same tokens as plain decoding, with a random drafter's rejections and
    through a stream."""
    import dataclasses

    import jax

    import retrace_jax as rj
    from retrace_jax.decoding import programs
    from retrace_jax.models.tiny import TINY_QWEN3, tiny_target

    qwen05 = dataclasses.replace(TINY_QWEN3, hidden_size=896, intermediate_size=4864, num_heads=14,
                                 num_kv_heads=2, head_dim=64)
    assert programs.resolve_cpu_products(qwen05, 4) == "eigen"  # 896 x 9,728 x 4 bytes: 34.9 MB
    assert programs.resolve_cpu_products(qwen05, 2) == "eigen"  # 17.4 MB
    smollm = dataclasses.replace(qwen05, hidden_size=576, intermediate_size=1536, num_heads=9, num_kv_heads=3)
    assert programs.resolve_cpu_products(smollm, 4) == "ynnpack"  # 7.1 MB: measured as fast either way
    assert programs.resolve_cpu_products(TINY_QWEN3, 4) == "ynnpack"
    assert programs.resolve_cpu_products(TINY_QWEN3, 4, "eigen") == "eigen"
    assert programs.resolve_cpu_products(qwen05, 4, "ynnpack") == "ynnpack"
    assert programs.cpu_products_options(qwen05, 4) == programs.SEVERAL_ROW_CPU_OPTIONS
    assert programs.cpu_products_options(qwen05, 4, "ynnpack") is None
    assert programs.cpu_products_options(TINY_QWEN3, 4) is None

    target = tiny_target()
    drafter = rj.init_drafter(target.cfg, mask_token_id=target.cfg.vocab_size - 1, num_layers=1, block_size=4)
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13]]
    with pytest.raises(ValueError, match="cpu_products must be one of"):
        rj.generate(target, prompts, 4, drafter=drafter, cpu_products="fast")
    seen = []
    real = programs.DecodeProgram.with_cpu_options

    def spy(self, extra):
        seen.append((self.__name__, extra))
        return real(self, extra)

    monkeypatch.setattr(programs.DecodeProgram, "with_cpu_options", spy)
    want = rj.generate(target, prompts, 24).tokens
    for choice, extra in (("eigen", programs.SEVERAL_ROW_CPU_OPTIONS), ("ynnpack", None), ("auto", None)):
        seen.clear()
        assert rj.generate(target, prompts, 24, drafter=drafter, cpu_products=choice).tokens == want, choice
        assert rj.generate(target, prompts, 24, drafter=drafter, cpu_products=choice, slots=1).tokens == want
        assert {name for name, _ in seen} == {"speculative_generate", "stream_chunk"}
        assert all(got == extra for _, got in seen), (choice, seen)
    if jax.default_backend() == "cpu":
        from retrace_jax.decoding.speculative import speculative_generate
        assert speculative_generate.with_cpu_options(None) is speculative_generate.cpu
        assert speculative_generate.with_cpu_options(programs.SEVERAL_ROW_CPU_OPTIONS) is \
            speculative_generate.with_cpu_options(dict(programs.SEVERAL_ROW_CPU_OPTIONS))  # made once


def test_unrolled_layers_trace_one_block_whatever_the_depth(monkeypatch):
    """Inside a trace, the unrolled layer loop calls one jitted decoder block per layer: JAX traces (and
    lowers) the block once, so tracing and lowering time do not grow with depth; the tokens are checked
    against transformers and the scan by the parity tests."""
    import dataclasses

    import jax
    import jax.numpy as jnp

    from retrace_jax.models import layers
    from retrace_jax.models.tiny import TINY_QWEN3, tiny_target

    traced = []
    call = layers.DecoderBlock.__call__

    def counting(self, *args, **kwargs):
        traced.append(self)
        return call(self, *args, **kwargs)

    monkeypatch.setattr(layers.DecoderBlock, "__call__", counting)
    counts = []
    for depth in (3, 6):
        target = tiny_target(cfg=dataclasses.replace(TINY_QWEN3, num_layers=depth)).unroll_layers()
        cache = target.init_cache(1, 16)
        traced.clear()
        jax.make_jaxpr(lambda tokens, c: target(tokens, c).hidden)(jnp.zeros((1, 2), jnp.int32), cache)
        counts.append(len(traced))
    assert counts == [1, 1]


def test_compile_seconds_sees_each_stage_of_a_compilation_once():
    """decode.py's "compile s": JAX's own timings of tracing, lowering and XLA compiling inside the block,
    for new programs only (a second call in the same bucket adds nothing)."""
    import dataclasses

    from retrace_jax.decoding import programs
    from retrace_jax.models.tiny import TINY_QWEN3, tiny_target

    target = tiny_target(cfg=dataclasses.replace(TINY_QWEN3, num_layers=1))  # a program no other test compiles
    with programs.compile_seconds() as first:
        rj.generate(target, [[3, 4, 5]], max_new_tokens=5)
    assert set(first) == {"trace", "lower", "xla"} and all(s > 0 for s in first.values())
    with programs.compile_seconds() as again:
        rj.generate(target, [[6, 7]], max_new_tokens=5)
    assert again == {}


def test_prompt_buckets_pad_at_most_a_third_of_the_prefill():
    from retrace_jax.decoding.generation import MIN_BUCKET, prompt_bucket

    assert [prompt_bucket(n) for n in (1, 16, 17, 25, 33, 49, 65, 96, 97, 129, 193)] == \
        [16, 16, 24, 32, 48, 64, 96, 96, 128, 192, 256]
    sizes = [prompt_bucket(n) for n in range(1, 5000)]
    assert sizes == sorted(sizes) and all(s >= n for n, s in enumerate(sizes, 1))
    assert all(n > (2 * s) // 3 or s == MIN_BUCKET for n, s in enumerate(sizes, 1))  # padding below a third
