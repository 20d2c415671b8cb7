"""Bad input gets a clear error naming the file, field or value; checkpoints are written atomically.

Nothing here compiles a generation: every error is raised before the first program runs."""

import errno
import json
import os
import re
import shutil

import numpy as np
import pytest
from safetensors import SafetensorError
from safetensors.numpy import load_file, save_file

import decode
import retrace_jax as rj
from retrace_jax.assets import models, prompts, shipped
from retrace_jax.cli import assets as cli_assets
from retrace_jax.cli import run_main
from retrace_jax.io import checkpoints
from retrace_jax.training.data import DataError, read_prompts
from tests.helpers import cli_error, copy_model_dir, edit_config, edit_tensors

# ------------------------------------------------------------------------------------ loading checkpoints


def _truncate(path):
    with open(path, "rb") as f:
        data = f.read()
    with open(path, "wb") as f:
        f.write(data[: len(data) // 2])


def _write(path, text):
    with open(path, "w") as f:
        f.write(text)


def _add_index(directory, index):
    _write(os.path.join(directory, "model.safetensors.index.json"), json.dumps(index))


CHECKPOINT_CASES = {
    # name: (edit of a copied qwen3 directory, error type, message pattern)
    "config.json with a JSON syntax error": (
        lambda d: _write(os.path.join(d, "config.json"), '{"model_type": "qwen3",,}'),
        rj.ConfigError, r"config\.json is not valid JSON: .* line 1, column"),
    "config.json holding a list": (
        lambda d: _write(os.path.join(d, "config.json"), "[1, 2]"),
        rj.ConfigError, r"config\.json must hold a JSON object, not list"),
    "config.json with a field of the wrong type": (
        lambda d: edit_config(d, lambda c: c.update(num_attention_heads="four")),
        rj.ConfigError, r"config\.json: num_attention_heads: expected an integer, got 'four'"),
    "truncated model.safetensors": (
        lambda d: _truncate(os.path.join(d, "model.safetensors")),
        rj.CheckpointError, r"model\.safetensors is not a readable safetensors file \(truncated or corrupt\?\)"),
    "index without weight_map": (
        lambda d: (os.rename(os.path.join(d, "model.safetensors"), os.path.join(d, "part.safetensors")),
                   _add_index(d, {"metadata": {}})),
        rj.CheckpointError, r"model\.safetensors\.index\.json has no 'weight_map'"),
    "index that is not JSON": (
        lambda d: (os.rename(os.path.join(d, "model.safetensors"), os.path.join(d, "part.safetensors")),
                   _write(os.path.join(d, "model.safetensors.index.json"), "{")),
        rj.CheckpointError, r"model\.safetensors\.index\.json is not valid JSON"),
    "stale index beside the single file": (
        lambda d: _add_index(d, {"weight_map": {"model.norm.weight": "old-00001.safetensors"}}),
        rj.CheckpointError, r"both model\.safetensors and model\.safetensors\.index\.json.*stale"),
    "NaN in a weight": (
        lambda d: edit_tensors(d, lambda t: t["model.layers.1.mlp.up_proj.weight"].__setitem__((3, 4), np.nan)),
        rj.CheckpointError, r"tensor model\.layers\.1\.mlp\.up_proj\.weight in .*model\.safetensors has 1 non-finite"),
    "inf in the embedding": (
        lambda d: edit_tensors(d, lambda t: t["model.embed_tokens.weight"].__setitem__((0, slice(None)), np.inf)),
        rj.CheckpointError, r"tensor model\.embed_tokens\.weight .* has 64 non-finite"),
}


@pytest.mark.parametrize("case", sorted(CHECKPOINT_CASES))
def test_bad_target_checkpoint(case, hf_model_dir, tmp_path):
    edit, error, pattern = CHECKPOINT_CASES[case]
    directory = copy_model_dir(hf_model_dir("qwen3")[1], tmp_path / "model")
    edit(directory)
    with pytest.raises(error, match=pattern):
        rj.load_target(directory)


def test_index_listing_a_tensor_its_shard_lacks(hf_model_dir, tmp_path):
    directory = copy_model_dir(hf_model_dir("qwen3")[1], tmp_path / "model")
    os.rename(os.path.join(directory, "model.safetensors"), os.path.join(directory, "part.safetensors"))
    names = list(load_file(os.path.join(directory, "part.safetensors")))
    _add_index(directory, {"weight_map": {**{n: "part.safetensors" for n in names}, "lm_head.bias": "part.safetensors"}})
    with pytest.raises(rj.CheckpointError, match=r"part\.safetensors lacks tensors .*: lm_head\.bias"):
        rj.load_target(directory)


def test_non_finite_weight_is_found_when_reading_shards_onto_a_mesh(hf_model_dir, tmp_path):
    directory = copy_model_dir(hf_model_dir("qwen3")[1], tmp_path / "model")
    edit_tensors(directory, lambda t: t["model.norm.weight"].__setitem__(5, -np.inf))
    with pytest.raises(rj.CheckpointError, match=r"tensor model\.norm\.weight .* 1 non-finite"):
        rj.load_target(directory, mesh=rj.make_mesh("data=1"))


# ------------------------------------------------------------------------------------ drafters: save, load

@pytest.fixture
def target():
    return rj.tiny.tiny_target()


def _drafter(target, seed=0, **kwargs):
    return rj.init_drafter(target.cfg, mask_token_id=5, num_layers=1, block_size=4, seed=seed, **kwargs)


def _fc(module):
    return np.asarray(module.fc.kernel[...])


def test_drafter_with_nan_weights_is_refused(target, tmp_path):
    path = str(tmp_path / "d")
    rj.save_drafter(_drafter(target), path)
    edit_tensors(path, lambda t: t["layers.0.self_attn.q_norm.weight"].__setitem__(0, np.nan))
    with pytest.raises(rj.CheckpointError, match=r"tensor layers\.0\.self_attn\.q_norm\.weight .* 1 non-finite"):
        rj.load_drafter(path, target)


def test_save_drafter_failure_leaves_the_old_checkpoint(target, tmp_path, monkeypatch):
    path = str(tmp_path / "d")
    old = _drafter(target, seed=0)
    rj.save_drafter(old, path)
    before = {f: open(os.path.join(path, f), "rb").read() for f in os.listdir(path)}

    def fail(*args, **kwargs):
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(checkpoints, "save_file", fail)  # after config.json is written, before the weights
    with pytest.raises(OSError, match="simulated"):
        rj.save_drafter(_drafter(target, seed=1, retrace=rj.ReTraceConfig()), path)
    assert {f: open(os.path.join(path, f), "rb").read() for f in os.listdir(path)} == before
    assert sorted(os.listdir(tmp_path)) == ["d", "d.versions"]
    assert os.listdir(tmp_path / "d.versions") == ["1"]  # no temporary directory left behind
    monkeypatch.undo()
    np.testing.assert_array_equal(_fc(rj.load_drafter(path, target)), _fc(old))


@pytest.mark.parametrize("failure", [
    SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)"),  # safetensors'
    OSError(errno.ENOSPC, "No space left on device"),  # open() or json.dump
])
def test_save_drafter_on_a_full_disk_raises_an_os_error_naming_the_path(failure, target, tmp_path, monkeypatch):
    path = str(tmp_path / "d")

    def fail(*args, **kwargs):
        raise failure

    monkeypatch.setattr(checkpoints, "save_file", fail)
    with pytest.raises(OSError) as err:
        rj.save_drafter(_drafter(target), path)
    assert err.value.errno == errno.ENOSPC
    assert str(err.value) == f"save_drafter could not write {path}: No space left on device"
    assert not os.path.exists(path) and os.listdir(tmp_path / "d.versions") == []


def test_save_drafter_replaces_stale_weights_of_another_layout(target, tmp_path):
    path = str(tmp_path / "d")
    rj.save_drafter(_drafter(target, seed=0), path)
    # an older sharded save of another drafter: its index would shadow the new single file
    shard = load_file(os.path.join(path, "model.safetensors"))
    save_file(shard, os.path.join(path, "model-00001-of-00001.safetensors"))
    _add_index(path, {"weight_map": {n: "model-00001-of-00001.safetensors" for n in shard}})
    _write(os.path.join(path, "pytorch_model.bin"), "old")
    _write(os.path.join(path, "tokenizer.json"), "{}")  # not a weight file: kept
    new = _drafter(target, seed=1)
    rj.save_drafter(new, path)
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors", "tokenizer.json"]
    np.testing.assert_array_equal(_fc(rj.load_drafter(path, target)), _fc(new))
    assert sorted(os.listdir(tmp_path)) == ["d", "d.versions"]


def test_save_drafter_refuses_what_is_not_a_checkpoint_directory(target, tmp_path):
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="not a directory"):
        rj.save_drafter(_drafter(target), str(tmp_path / "file"))
    os.makedirs(tmp_path / "project" / "src")
    with pytest.raises(ValueError, match=r"holds other things \(src\)"):
        rj.save_drafter(_drafter(target), str(tmp_path / "project"))
    assert os.listdir(tmp_path / "project") == ["src"]


def test_drafter_config_json_errors_name_the_file(target, tmp_path):
    path = str(tmp_path / "d")
    rj.save_drafter(_drafter(target), path)
    edit_config(path, lambda c: c.update(num_hidden_layers=0))
    with pytest.raises(rj.ConfigError, match=r"config.json: num_hidden_layers: must be >= 1, got 0"):
        rj.load_drafter(path, target)
    _write(os.path.join(path, "config.json"), "{oops")
    with pytest.raises(rj.ConfigError, match=r"d\.versions/1/config\.json is not valid JSON"):  # the file itself
        rj.load_drafter(path, target)


# ------------------------------------------------------------------------------------ arguments

ARGUMENT_CASES = {
    "mesh as a string": (dict(mesh="data=1"), TypeError, r"mesh must be a jax\.sharding\.Mesh .*got str 'data=1'"),
    "stop_token_ids as an int": (dict(stop_token_ids=5), TypeError, r"stop_token_ids must be a list .*; write \[5\]"),
    "stop_token_ids holding strings": (dict(stop_token_ids=["</s>"]), TypeError, r"stop_token_ids must hold integer"),
    "a flat list of ints as the prompts": (dict(prompts=[1, 2, 3]), TypeError,
                                           r"prompts must be a list of token-id lists.*pass \[ids\]"),
    "an empty prompt list": (dict(prompts=[]), ValueError, r"prompts must be a non-empty list"),
    "prompts as None": (dict(prompts=None), ValueError, r"prompts must be a non-empty list"),
    "temperature as a string": (dict(temperature="0.5"), TypeError,
                                r"generate: temperature: expected a number, got '0\.5'"),
    "a negative temperature": (dict(temperature=-1.0), ValueError, r"generate: temperature: must be >= 0, got -1\.0"),
    "top_k as a float": (dict(top_k=1.5), TypeError, r"generate: top_k: expected an integer, got 1\.5"),
    "a negative top_k": (dict(top_k=-1), ValueError, r"generate: top_k: must be >= 0, got -1"),
    "top_p as a string": (dict(top_p="0.9"), TypeError, r"generate: top_p: expected a number, got '0\.9'"),
    "top_p above 1": (dict(top_p=1.5), ValueError, r"generate: top_p: must be <= 1, got 1\.5"),
    "block_size as a string": (dict(block_size="4"), TypeError,
                               r"generate: block_size: expected an integer, got '4'"),
    "block_size 1": (dict(block_size=1), ValueError, r"generate: block_size: must be >= 2, got 1"),
    "use_retrace as a string": (dict(use_retrace="no"), TypeError,
                                r"generate: use_retrace: expected true or false, got 'no'"),
    "max_new_tokens as a float": (dict(max_new_tokens=4.0), TypeError,
                                  r"generate: max_new_tokens: expected an integer, got 4\.0"),
    "seed as a float": (dict(seed=1.5), TypeError, r"generate: seed: expected an integer, got 1\.5"),
    "a seed past 2**32": (dict(seed=2**32), ValueError, r"generate: seed: must be < 4294967296"),
    "the target as the drafter": (dict(drafter="TARGET"), TypeError,
                                  r"generate: drafter must be a DFlashDrafter .* or None, got TargetModel"),
    "a drafter as the target": (dict(target="DRAFTER"), TypeError,
                                r"generate: target must be a TargetModel .*, got DFlashDrafter"),
}


@pytest.mark.parametrize("case", sorted(ARGUMENT_CASES))
def test_bad_generate_arguments(case, target):
    kwargs, error, pattern = ARGUMENT_CASES[case]
    drafter = _drafter(target)
    kwargs = {"target": target, "prompts": [[1, 2, 3]], "max_new_tokens": 4, **kwargs}
    kwargs = {k: {"TARGET": target, "DRAFTER": drafter}.get(v, v) if isinstance(v, str) else v
              for k, v in kwargs.items()}
    with pytest.raises(error, match=pattern):
        rj.generate(**kwargs)


def test_top_k_and_top_p_none_mean_off():
    """``top_k=None`` and ``top_p=None`` turn the filter off, as 0 and 1.0 do (as in transformers)."""
    from retrace_jax.validation import generate_arguments

    args = generate_arguments(max_new_tokens=4, temperature=0.5, top_k=None, top_p=None, seed=0, block_size=None,
                              use_retrace=True)
    assert (args.top_k, args.top_p) == (0, 1.0)
    args = generate_arguments(max_new_tokens=np.int32(4), temperature=np.float32(0.5), top_k=np.int64(3), top_p=1,
                              seed=np.uint32(7), block_size=None, use_retrace=np.bool_(False))
    assert (args.max_new_tokens, args.temperature, args.top_k, args.top_p, args.seed, args.use_retrace) == (
        4, 0.5, 3, 1.0, 7, False)


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(num_layers=0), r"num_layers must be an integer >= 1, got 0"),
    (dict(num_layers=1.5), r"num_layers must be an integer >= 1, got 1\.5"),
    (dict(block_size=1), r"block_size must be an integer >= 2, got 1"),
    (dict(mask_token_id=512), r"mask_token_id must be a token id in \[0, 512\), got 512"),
])
def test_bad_init_drafter_arguments(kwargs, pattern, target):
    kwargs = {"mask_token_id": 5, "num_layers": 1, "block_size": 4, **kwargs}
    with pytest.raises(ValueError, match=pattern):
        rj.init_drafter(target.cfg, **kwargs)


# ------------------------------------------------------------------------------------ prompt files

JSONL_CASES = {
    "a message without content": ({"messages": [{"role": "user"}]}, r"messages\[0\] has no 'content'"),
    "empty turns": ({"turns": []}, r"'turns' must be a non-empty list of strings, got \[\]"),
    "conversations given as a string": ({"conversations": "hi"},
                                        r"'conversations' must be a non-empty list of messages, got 'hi'"),
    "a conversation turn that is not an object": ({"conversations": ["hi"]}, r"conversations\[0\] must be an object"),
    "a ShareGPT turn without value": ({"conversations": [{"from": "human"}]}, r"conversations\[0\] has no 'value'"),
    "a prompt that is not a string": ({"prompt": 5}, r"record\.prompt must be a string, got 5"),
    "turns holding a number": ({"turns": [7]}, r"record\.turns\[0\] must be a string, got 7"),
    "an empty first user message": ({"messages": [{"role": "user", "content": " "}]},
                                    r"the first user message \(messages\[0\]\.content\) is empty"),
    "no user message": ({"messages": [{"role": "system", "content": "s"}]}, r"no user message"),
    "an unknown record": ({"content": "hi"}, r"a record needs 'messages', 'conversations', 'prompt', 'turns' or 'text'"),
    "an empty raw text": ({"text": " "}, r"'text' must be a non-empty string"),
}


@pytest.mark.parametrize("case", sorted(JSONL_CASES))
def test_bad_jsonl_record_names_file_and_line(case, tmp_path):
    record, pattern = JSONL_CASES[case]
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"prompt": "fine"}) + "\n\n" + json.dumps(record) + "\n")
    with pytest.raises(DataError, match=rf"prompts\.jsonl:3: {pattern}"):
        read_prompts(str(path))


@pytest.mark.parametrize("name", ["prompts.jsonl", "prompts.jsonl.gz"])
def test_a_byte_that_is_not_utf8_is_named_by_its_line(name, tmp_path):
    """The line of the bad byte, not that of the decoder's first buffer (8 KiB and more: line 1)."""
    import gzip

    lines = [json.dumps({"prompt": f"w{i} " * 20}).encode() for i in range(300)]
    lines[250] = b'{"prompt": "caf\xe9"}'
    data = b"\n".join(lines) + b"\n"
    path = tmp_path / name
    path.write_bytes(gzip.compress(data) if name.endswith(".gz") else data)
    with pytest.raises(DataError, match=rf"{name}:251: not UTF-8 text \(invalid continuation byte at byte 15 "
                                        rf"of the line\)"):
        read_prompts(str(path))


def test_messages_after_the_first_user_turn_are_not_checked(tmp_path):
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"conversations": [{"from": "human", "value": "q"}, {"from": "gpt"}]}) + "\n")
    assert read_prompts(str(path)) == [[{"role": "user", "content": "q"}]]


# ------------------------------------------------------------------------------------ assets, command lines

@pytest.mark.parametrize("call, pattern", [
    (lambda: models.fetch("gpt-5"), r"unknown model 'gpt-5'; available: smollm2-135m-instruct"),
    (lambda: prompts.fetch_dataset("mmlu"), r"unknown dataset 'mmlu'; available: sharegpt, humaneval"),
    (lambda: shipped.shipped_drafter("qwen3-8b"), r"no drafter shipped for 'qwen3-8b'; shipped: "),
    (lambda: shipped.shipped_drafter("smollm2-135m-instruct", "eagle"), r"no 'eagle' drafter shipped for "
                                                                        r"'smollm2-135m-instruct'; there are: default"),
])
def test_assets_raise_value_error_not_system_exit(call, pattern):
    with pytest.raises(ValueError, match=pattern):
        call()


def test_fetch_assets_prints_one_line(monkeypatch, capsys):
    def fail(name, cache, keep_gguf=False):
        raise ValueError(f"[{name}] sha256 mismatch: got 0, expected 1")

    monkeypatch.setattr(cli_assets, "fetch", fail)
    with pytest.raises(SystemExit) as exit_info:
        run_main(cli_assets.main, ["smollm2-135m-instruct"])
    assert exit_info.value.code == 1
    assert capsys.readouterr().err == "error: [smollm2-135m-instruct] sha256 mismatch: got 0, expected 1\n"


@pytest.mark.parametrize("argv, pattern", [
    (["--target", "/nonexistent/model"], "error: target directory not found: /nonexistent/model"),
    (["--target", "tiny", "--drafter", "/nonexistent/d"], "error: drafter directory not found: /nonexistent/d"),
    (["--target", "tiny", "--max-new-tokens", "-3"], "error: --max-new-tokens must be at least 1, got -3"),
    (["--drafter", "somewhere"], "error: --drafter needs --target (the model it was trained for)"),
    (["--target", "tiny", "--runs", "0"], "error: --runs must be at least 1, got 0"),
    (["--target", "tiny", "--mesh", "model=2"], "error: unknown mesh axis 'model'"),
    # an empty --target ran (and on a clean machine fetched) the default model; an empty --drafter ran without
    (["--target", ""], "error: --target must not be empty (leave it out for the demo, qwen2.5-coder-0.5b-instruct)"),
    (["--target", "tiny", "--drafter", ""], "error: --drafter must not be empty"),
    (["--target", "tiny", "--temperature", "1", "--top-k", "1099511627776"],  # an OverflowError's traceback
     "error: --top-k must be between 0 (off) and 2147483647, got 1099511627776"),
])
def test_decode_prints_one_line_and_exits_1(argv, pattern, capsys, monkeypatch):
    monkeypatch.setenv("RETRACE_JAX_CACHE_DIR", "")
    monkeypatch.delenv("RETRACE_JAX_TRACEBACK", raising=False)
    with pytest.raises(SystemExit) as exit_info:
        decode.main(argv)
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith(pattern) and err.count("\n") == 1 and "Traceback" not in err


def test_decode_bad_checkpoint_is_one_line(hf_model_dir, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RETRACE_JAX_CACHE_DIR", "")
    directory = copy_model_dir(hf_model_dir("qwen3")[1], tmp_path / "model")
    _truncate(os.path.join(directory, "model.safetensors"))
    with pytest.raises(SystemExit) as exit_info:
        decode.main(["--target", directory])
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "model.safetensors is not a readable safetensors file" in err
    assert err.count("\n") == 1
    shutil.rmtree(directory)


def test_decode_prints_a_bad_drafter_config_as_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("RETRACE_JAX_CACHE_DIR", "")
    monkeypatch.delenv("RETRACE_JAX_TRACEBACK", raising=False)
    drafter_dir = str(tmp_path / "d")
    rj.save_drafter(rj.init_drafter(rj.tiny.TINY_QWEN3, mask_token_id=5, block_size=4), drafter_dir)
    edit_config(drafter_dir, lambda c: c.update(retrace_config={"rank": 2.5}))
    line = cli_error(capsys, decode.main, ["--target", "tiny", "--drafter", drafter_dir])
    # the file read: the version the saved link points at (a save is a link to a version directory)
    assert re.search(r"/d(\.versions/\d+)?/config\.json: retrace_config\.rank: expected an integer, got 2\.5$", line), line


@pytest.mark.parametrize("target, line", [
    ("smollm3", "error: target directory not found: smollm3 (nor a named target: tiny, "
                "qwen2.5-coder-0.5b-instruct, smollm2-135m-instruct); did you mean smollm2-135m-instruct?"),
    ("qwen-coder", "error: target directory not found: qwen-coder (nor a named target: tiny, "
                   "qwen2.5-coder-0.5b-instruct, smollm2-135m-instruct); did you mean qwen2.5-coder-0.5b-instruct?"),
    ("/nonexistent/model", "error: target directory not found: /nonexistent/model (nor a named target: tiny, "
                           "qwen2.5-coder-0.5b-instruct, smollm2-135m-instruct)"),
])
def test_decode_names_the_targets_it_knows_and_the_closest_one(target, line, capsys, monkeypatch):
    """--target smollm2 said "target directory not found: smollm2" without naming a model it knows."""
    monkeypatch.delenv("RETRACE_JAX_TRACEBACK", raising=False)
    assert cli_error(capsys, decode.main, ["--target", target]) == line


@pytest.mark.parametrize("target, name", [
    ("smollm2", "smollm2-135m-instruct"),
    ("qwen2.5-coder-0.5b", "qwen2.5-coder-0.5b-instruct"),
    ("qwen", "qwen2.5-coder-0.5b-instruct"),
    ("tiny", "tiny"),
])
def test_decode_takes_an_unambiguous_start_of_a_named_target(target, name):
    from retrace_jax.cli import decode as cli_decode

    args = cli_decode.parse_args(["--target", target])
    cli_decode.check_args(args)
    assert args.target == name


def test_decode_refuses_the_start_of_several_named_targets(capsys, monkeypatch):
    from retrace_jax.cli import decode as cli_decode

    monkeypatch.delenv("RETRACE_JAX_TRACEBACK", raising=False)
    monkeypatch.setitem(cli_decode.DEMO_PAIRS, "smollm2-360m-instruct", cli_decode.DEMO_PAIRS["smollm2-135m-instruct"])
    assert cli_error(capsys, decode.main, ["--target", "smollm2"]) == (
        "error: --target smollm2 is the start of several named targets: smollm2-135m-instruct, smollm2-360m-instruct")


def test_a_directory_named_like_a_start_of_a_named_target_is_a_directory(tmp_path, monkeypatch):
    from retrace_jax.cli import decode as cli_decode

    (tmp_path / "smollm2").mkdir()
    monkeypatch.chdir(tmp_path)
    args = cli_decode.parse_args(["--target", "smollm2"])
    cli_decode.check_args(args)
    assert args.target == "smollm2"


def _unusable_cache_dirs(tmp_path):
    (tmp_path / "a_file").write_text("")
    return {"a file": (str(tmp_path / "a_file"), "is not a directory"),
            "/dev/null": (os.devnull, "is not a directory"),
            "under a file": (str(tmp_path / "a_file" / "xla"), "cannot be written: Not a directory")}


@pytest.mark.parametrize("case", ["a file", "/dev/null", "under a file"])
def test_an_unusable_cache_dir_is_a_warning_naming_the_variable_and_the_cache_stays_off(case, tmp_path, monkeypatch):
    """RETRACE_JAX_CACHE_DIR=/dev/null ended the command with "[Errno 17] File exists: '/dev/null'"."""
    import jax

    from retrace_jax.decoding.programs import CacheWarning

    path, problem = _unusable_cache_dirs(tmp_path)[case]
    monkeypatch.setenv("RETRACE_JAX_CACHE_DIR", path)
    before = jax.config.jax_compilation_cache_dir
    with pytest.warns(CacheWarning) as caught:
        assert rj.enable_compilation_cache() == ""
    assert str(caught[0].message).startswith(f"the persistent compilation cache is off: RETRACE_JAX_CACHE_DIR={path} "
                                             f"{problem}")
    with pytest.warns(CacheWarning, match=rf"the persistent compilation cache is off: {re.escape(path)} {problem}"):
        assert rj.enable_compilation_cache(path) == ""
    assert jax.config.jax_compilation_cache_dir == before


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_read_only_cache_dir_is_a_warning(tmp_path, monkeypatch):
    from retrace_jax.decoding.programs import CacheWarning

    (tmp_path / "xla").mkdir(mode=0o555)
    monkeypatch.setenv("RETRACE_JAX_CACHE_DIR", str(tmp_path / "xla"))
    with pytest.warns(CacheWarning, match=r"RETRACE_JAX_CACHE_DIR=.*/xla cannot be written: Permission denied"):
        assert rj.enable_compilation_cache() == ""


def test_decode_with_an_unusable_cache_dir_warns_in_one_line_and_runs_without_it(monkeypatch, capsys):
    from retrace_jax.cli import decode as cli_decode

    monkeypatch.setattr(cli_decode, "timed_generate",
                        lambda target, ids, label, runs, **kwargs: (rj.GenerateOutput([[5, 6]], [[2]]), 1.0, 0.5, 0.1))
    monkeypatch.setenv("RETRACE_JAX_CACHE_DIR", os.devnull)
    capsys.readouterr()
    decode.main(["--target", "tiny", "--runs", "1"])
    out, err = capsys.readouterr()
    assert err.startswith(f"warning: the persistent compilation cache is off: RETRACE_JAX_CACHE_DIR={os.devnull} is not "
                          f"a directory") and err.count("\n") == 1, err
    assert "compilation cache: off" in out.splitlines()
