"""The laboratory target's build pipeline (lab/build_target.py) on a tiny configuration: its tokenizer,
its export (loaded by transformers and by ``load_target`` with equal greedy tokens) and exact resume."""

import dataclasses
import importlib.util
import os
import shutil
import sys

import jax.numpy as jnp
import numpy as np
import pytest

import retrace_jax as rj
from tests.helpers import hf_greedy

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load_lab(name):
    """The script ``lab/{name}.py`` as a module."""
    spec = importlib.util.spec_from_file_location(f"lab_{name}", os.path.join(ROOT, "lab", f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


bt = _load_lab("build_target")


def tiny_config(work, out=None, **overrides):
    cfg = bt.BuildConfig(work=str(work), out=str(out or os.path.join(work, "target")), max_train_files=12,
                         max_heldout_files=4, vocab_size=400, hidden_size=64, num_layers=2, num_heads=4,
                         num_kv_heads=2, head_dim=16, intermediate_size=128, seq_len=32, batch_size=2, steps=3,
                         log_every=1, eval_every=2, eval_windows=4, checkpoint_every=2)
    return dataclasses.replace(cfg, **overrides)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """A work directory with the data and tokenizer stages done (tiny corpus)."""
    cfg = tiny_config(tmp_path_factory.mktemp("lab"))
    records = []
    bt.build(cfg, ("data", "tokenizer"), log=records.append)
    return cfg, records


def copy_prepared(cfg, work):
    """A fresh work directory sharing ``cfg``'s data and tokenizer."""
    for name in ("data", "tokenizer"):
        shutil.copytree(os.path.join(cfg.work, name), os.path.join(work, name))
    return dataclasses.replace(cfg, work=str(work), out=str(work / "target"))


def test_data_never_trains_on_held_out_files(prepared):
    cfg, records = prepared
    data = next(r for r in records if r.get("event") == "data")
    assert data["train"]["files"] > 0 and data["heldout"]["files"] > 0
    train = bt._read_json(os.path.join(cfg.data_dir, "train_docs.json"))
    held = bt._read_json(os.path.join(cfg.data_dir, "heldout_docs.json"))
    assert all(d["path"].split(os.sep)[0] in bt.HELD_OUT_PACKAGES for d in held)
    assert not any(set(d["path"].split(os.sep)) & set(bt.EXCLUDED_DIRS) for d in train)
    assert not {d["sha256"] for d in train} & {d["sha256"] for d in held}


def test_tokenizer_round_trips_text_and_reserves_a_mask(prepared):
    from transformers import AutoTokenizer

    cfg, _ = prepared
    tok = AutoTokenizer.from_pretrained(cfg.tokenizer_dir)
    assert len(tok) == cfg.vocab_size
    assert (tok.eos_token_id, tok.pad_token_id, tok.mask_token_id) == (0, 1, 2) and tok.bos_token_id == 0
    texts = ["def f(x):\n\treturn x  # trailing  \n\n", "    if a != b:\r\n        raise ValueError('é∑ 日本')\n",
             bt._read_json(os.path.join(cfg.data_dir, "heldout_docs.json"))[0]["text"]]
    for text in texts:
        ids = tok(text, add_special_tokens=False)["input_ids"]
        assert tok.decode(ids) == text
        assert bt.MASK not in tok.convert_ids_to_tokens(ids)
    stream = np.load(os.path.join(cfg.data_dir, "train_tokens.npy"))
    assert stream.dtype == np.uint16 and stream.max() < cfg.vocab_size and 2 not in set(stream.tolist())


@pytest.fixture(scope="module")
def built(prepared, tmp_path_factory):
    """The tiny configuration built through every stage in one go, with its log records."""
    cfg = copy_prepared(prepared[0], tmp_path_factory.mktemp("built"))
    records = []
    bt.build(cfg, bt.STAGES, log=records.append)
    return cfg, records


def test_tiny_build_exports_a_target_that_transformers_and_load_target_agree_on(built):
    import torch
    import transformers

    cfg, records = built
    assert [r["step"] for r in records if "loss" in r] == [1, 2, 3]
    assert [r["step"] for r in records if r.get("event") == "eval"] == [2, 3]
    assert {r["stage"] for r in records if r.get("event") == "skip"} == {"data", "tokenizer"}
    tok = transformers.AutoTokenizer.from_pretrained(cfg.out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(cfg.out, dtype=torch.float32).eval()
    target = rj.load_target(cfg.out, dtype="float32")
    assert hf.config.eos_token_id == tok.eos_token_id == 0
    prompts = [tok(p)["input_ids"] for p in ("import os\n\ndef main(", "class A:\n    def __init__(self")]
    for ids in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].numpy()
        out = target(jnp.asarray([ids]), target.init_cache(1, len(ids)), attention="dense")
        np.testing.assert_allclose(np.asarray(target.logits(out.hidden))[0], ref, atol=1e-4, rtol=1e-4)
    assert rj.generate(target, prompts, 12).tokens == [hf_greedy(hf, ids, 12) for ids in prompts]
    info = bt._read_json(os.path.join(cfg.out, "build_info.json"))
    assert info["step"] == 3 and info["mask_token_id"] == tok.mask_token_id == 2
    assert info["heldout_loss"] == next(r["heldout_loss"] for r in records if r.get("event") == "eval" and r["step"] == 3)
    assert abs(info["heldout_loss_bf16_weights"] - info["heldout_loss"]) < 0.05
    # the export stage again replaces the directory's weights and tokenizer, nothing else
    bt.build(cfg, ("export",), log=[].append)
    assert sorted(os.listdir(cfg.out)) == ["build_info.json", "config.json", "model.safetensors", "tokenizer.json",
                                           "tokenizer_config.json"]


def test_resume_repeats_the_uninterrupted_run(built, tmp_path):
    from flax import nnx

    cfg_a, straight = built
    resumed = []
    cfg_b = copy_prepared(cfg_a, tmp_path)
    bt.build(dataclasses.replace(cfg_b, stop_after=1), ("train",), log=resumed.append)
    assert resumed[-1] == {"event": "stopped", "step": 1, "reason": "stop_after"}
    bt.build(cfg_b, ("train",), log=resumed.append)
    assert {"event": "resumed", "step": 1} in resumed
    losses = lambda records: [(r["step"], r["last_loss"]) for r in records if "last_loss" in r]  # noqa: E731
    assert losses(resumed) == losses(straight)
    evals = lambda records: [(r["step"], r["heldout_loss"]) for r in records if r.get("event") == "eval"]  # noqa: E731
    assert evals(resumed) == evals(straight)
    a, _, _ = bt.restore_model(cfg_a)
    b, _, _ = bt.restore_model(cfg_b)
    for (p, x), (_, y) in zip(nnx.to_flat_state(nnx.state(a)), nnx.to_flat_state(nnx.state(b))):
        np.testing.assert_array_equal(np.asarray(x.get_value()), np.asarray(y.get_value()), err_msg=str(p))
    # a finished run is skipped; other settings are refused before anything is restored
    done = []
    bt.build(cfg_b, ("train",), log=done.append)
    assert done[0]["event"] == "skip"
    with pytest.raises(SystemExit, match="lr"):
        bt.build(dataclasses.replace(cfg_b, lr=1e-3, steps=5), ("train",), log=done.append)


def test_code_pieces_are_whole_lines_within_the_token_range(prepared):
    """lab/build_prompts.py: every piece is a run of whole lines of its file (the last newline left off),
    between min and max tokens, never cut, and the set is a function of the seed."""
    from transformers import AutoTokenizer

    bp = _load_lab("build_prompts")
    cfg, _ = prepared
    tokenizer = AutoTokenizer.from_pretrained(cfg.tokenizer_dir)
    texts = [(d["path"], d["text"]) for d in bt._read_json(os.path.join(cfg.data_dir, "train_docs.json"))]
    pieces = bp.code_pieces(texts, 20, tokenizer, seed=3, min_tokens=12, max_tokens=40)
    by_path = dict(texts)
    for piece in pieces:
        path, line = piece["source"].rsplit(":", 1)
        lines = by_path[path].splitlines(keepends=True)
        first = int(line) - 1
        assert not piece["prompt"].endswith("\n")
        assert (by_path[path].splitlines(keepends=True)[first:] and
                "".join(lines[first:]).startswith(piece["prompt"] + "\n"))
        assert 12 <= len(tokenizer.encode(piece["prompt"] + "\n")) <= 40
    assert len({p["source"] for p in pieces}) == 20
    assert pieces == bp.code_pieces(texts, 20, tokenizer, seed=3, min_tokens=12, max_tokens=40)
    assert pieces != bp.code_pieces(texts, 20, tokenizer, seed=4, min_tokens=12, max_tokens=40)


def test_bootstrap_ratio_of_tau_over_prompts_and_seeds():
    """lab/evaluate.py: the point ratio in both conventions, a degenerate interval when nothing varies,
    and an interval that contains the point and widens when the seeds disagree."""
    ev = _load_lab("evaluate")
    y = {0: [[2, 2], [3, 1]], 1: [[2, 2], [3, 1]]}  # τ per prompt 2, 2; pooled 8/4
    same = ev.bootstrap_ratio(y, y, samples=200)
    assert same["tau"]["ratio"] == 1.0 and same["tau"]["ci95"] == [1.0, 1.0]
    # prompts of different τ: only a bootstrap that draws the same prompts for both keeps the ratio at 2
    y2 = {0: [[2, 2], [4, 4], [1, 1, 1]]}
    x2 = {0: [[4, 4], [8, 8], [2, 2, 2]]}
    double = ev.bootstrap_ratio(x2, y2, samples=200)
    assert double["tau"]["ratio"] == pytest.approx(2.0) and double["tau_pooled"]["ratio"] == pytest.approx(2.0)
    assert double["tau"]["ci95"] == pytest.approx([2.0, 2.0]) and double["tau_pooled"]["ci95"] == pytest.approx([2.0, 2.0])
    with pytest.raises(ValueError, match="before their first round"):
        ev.bootstrap_ratio({0: [[2], []]}, {0: [[2], [3]]}, samples=10)
    noisy = {0: [[4, 4], [6, 2]], 1: [[2, 2], [3, 1]], 2: [[3], [3, 3]]}
    r = ev.bootstrap_ratio(noisy, y, samples=500)
    lo, hi = r["tau"]["ci95"]
    assert lo < r["tau"]["ratio"] < hi and hi - lo > 0.3
    # pooled: tokens over rounds of the resampled seeds and prompts
    assert r["tau_pooled"]["ratio"] == pytest.approx(np.mean([16 / 4, 8 / 4, 9 / 3]) / 2.0)
    assert ev.parse_drafters(["A=x", "B:1=y", "B:2=z"]) == {"A": {0: "x"}, "B": {1: "y", 2: "z"}}
    with pytest.raises(SystemExit, match="--drafter expects NAME=DIR or NAME:SEED=DIR, got 'B:one=y'"):
        ev.parse_drafters(["B:one=y"])


def test_reuse_adds_an_earlier_runs_seeds_and_refuses_other_settings():
    """lab/evaluate.py --reuse: a new seed's lengths join the earlier run's seeds of the same method (and its
    methods that this run does not have), τ and the lossless counts over all of them; an earlier run on
    other prompts or settings, or a seed in both runs, is refused."""
    ev = _load_lab("evaluate")
    header = {"target": "/a/lab/target", "prompts": "/a/lab/work/prompts/heldout.jsonl", "num_prompts": 2,
              "prompt_ids_sha256": "h", "max_new_tokens": 8, "skipped_too_long": 0, "batch_size": 64}
    old = {**header, "target": "/elsewhere/lab/target", "prompts": "/elsewhere/lab/work/prompts/heldout.jsonl",
           "drafters": {"B": {"0": "b0"}, "C": {"0": "c0"}},
           "lengths": {"T=0": {"B": {"0": [[2, 2], [4]]}, "C": {"0": [[3], [5]]}}},
           "lossless_T0": {"B": {"rows": 2, "differing_from_plain": 0}, "C": {"rows": 2, "differing_from_plain": 1}}}
    assert ev.reusable(old, header, {"B": {1: "b1"}}) is old
    result = {**header, "tau": {"T=0": {}}, "lengths": {"T=0": {"B": {1: [[1, 3], [6]]}}},
              "lossless_T0": {"B": {"rows": 2, "differing_from_plain": 0}}}
    result["tau"]["T=0"]["B"] = ev.summary(result["lengths"]["T=0"]["B"])
    ev.merge_reused(result, old, "T=0", batch_size=64)
    assert result["lengths"]["T=0"]["B"] == {0: [[2, 2], [4]], 1: [[1, 3], [6]]}
    assert result["tau"]["T=0"]["B"]["tau"] == pytest.approx(np.mean([(2 + 4) / 2, (2 + 6) / 2]))
    assert result["tau"]["T=0"]["C"]["tau"] == pytest.approx(4.0)  # only in the earlier run
    assert result["lossless_T0"] == {"B": {"rows": 4, "differing_from_plain": 0},
                                     "C": {"rows": 2, "differing_from_plain": 1}}
    with pytest.raises(SystemExit, match="B seed"):
        ev.reusable(old, header, {"B": {0: "again"}})
    for key, value in (("max_new_tokens", 16), ("prompt_ids_sha256", "other"), ("prompts", "/a/other.jsonl")):
        with pytest.raises(SystemExit, match=key):
            ev.reusable(old, {**header, key: value}, {})
    sampled = {**old, "batch_size": 32, "lengths": {"T=1": old["lengths"]["T=0"]}}
    with pytest.raises(SystemExit, match="batch size"):
        ev.merge_reused({**result, "tau": {"T=1": {}}, "lengths": {"T=1": {}}}, sampled, "T=1", batch_size=64)


def test_shipped_lab_drafters_load_and_decode_losslessly():
    """lab/drafters/{A,B,C} load with the public API next to lab/target (C with its ReTrace module), and
    their greedy output equals the target's own."""
    from transformers import AutoTokenizer

    lab = os.path.join(ROOT, "lab")
    target = rj.load_target(os.path.join(lab, "target"))
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(lab, "target"))
    prompts = [tokenizer.encode("def mean(values):\n    total = 0\n    for v in values:"),
               tokenizer.encode("class Stack:\n    def __init__(self):")]
    plain = rj.generate(target, prompts, 40, stop_token_ids=[tokenizer.eos_token_id]).tokens
    for name in ("A", "B", "C"):
        drafter = rj.load_drafter(os.path.join(lab, "drafters", name), target)
        assert drafter.cfg.block_size == 16 and drafter.cfg.mask_token_id == tokenizer.mask_token_id
        assert (drafter.cfg.retrace is not None) == (name == "C")
        out = rj.generate(target, prompts, 40, drafter=drafter, stop_token_ids=[tokenizer.eos_token_id])
        assert out.tokens == plain, name
        assert out.tau() > 1.0, name


def test_long_prompts_have_the_asked_length(tmp_path):
    """``lab/long_prompts.py``: held-out prompts of exactly N tokens (after the text round trip) for
    ``lab/evaluate.py --prompts``."""
    import json

    from transformers import AutoTokenizer

    out = tmp_path / "p.jsonl"
    _load_lab("long_prompts").main(["--tokens", "96", "--num-prompts", "5", "--new-tokens", "16", "--out", str(out)])
    tokenizer = AutoTokenizer.from_pretrained(os.path.join(ROOT, "lab", "target"))
    records = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(records) == 5 and len({r["prompt"] for r in records}) == 5
    assert all(len(tokenizer.encode(r["prompt"])) == 96 for r in records)
