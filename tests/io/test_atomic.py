"""Saving over a checkpoint that others read: a reader gets one whole checkpoint, never parts of two."""

import os
import threading
import time

import numpy as np
import pytest
from flax import nnx

import retrace_jax as rj
from retrace_jax.io import atomic


@pytest.fixture(scope="module")
def target():
    return rj.tiny.tiny_target()


def _drafter(target, seed, **kwargs):
    return rj.init_drafter(target.cfg, mask_token_id=5 + seed, num_layers=1, block_size=4, seed=seed, **kwargs)


def _params(module) -> dict:
    return {p: np.asarray(v.get_value()) for p, v in nnx.to_flat_state(nnx.state(module))}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)


def test_readers_see_one_whole_drafter_while_another_is_saved_over_it(target, tmp_path):
    """One thread saves two drafters in turn onto one path for two seconds while two threads load it: every
    load succeeds and returns exactly one of the two (its config, the mask token, and all its weights)."""
    drafters = {d.cfg.mask_token_id: d for d in (_drafter(target, 0), _drafter(target, 1))}
    expected = {mask: _params(d) for mask, d in drafters.items()}
    path = str(tmp_path / "drafter")
    rj.save_drafter(drafters[5], path)
    stop = threading.Event()
    saves, loads, errors, mixed = [0], [], [], []

    def write():
        while not stop.is_set():
            rj.save_drafter(drafters[6 if saves[0] % 2 == 0 else 5], path)
            saves[0] += 1

    def read():
        while not stop.is_set():
            try:
                loaded = rj.load_drafter(path, target)
            except Exception as err:  # noqa: BLE001 -- every failure counts
                errors.append(f"{type(err).__name__}: {err}")
                continue
            mask = loaded.cfg.mask_token_id
            loads.append(mask)
            if not _same(_params(loaded), expected[mask]):
                mixed.append(mask)

    threads = [threading.Thread(target=write)] + [threading.Thread(target=read) for _ in range(2)]
    for t in threads:
        t.start()
    time.sleep(2.0)
    stop.set()
    for t in threads:
        t.join()
    assert not errors, f"{len(errors)} of {len(errors) + len(loads)} loads failed, e.g. {errors[:3]}"
    assert not mixed, f"{len(mixed)} of {len(loads)} loads paired one drafter's config with other weights"
    assert saves[0] >= 5 and len(loads) >= 5 and set(loads) == {5, 6}, (saves, loads)
    assert _same(_params(rj.load_drafter(path, target)), expected[6 if saves[0] % 2 else 5])


def _save(path, text):
    """A checkpoint of one file, saved as checkpoints are."""

    def write(tmp):
        with open(os.path.join(tmp, "config.json"), "w") as f:
            f.write(text)

    atomic.replace_directory(path, write, "test")


def _text(directory):
    with open(os.path.join(directory, "config.json")) as f:
        return f.read()


def test_a_save_is_a_new_version_behind_the_link_and_old_versions_go(tmp_path, monkeypatch):
    path = str(tmp_path / "a" / "ckpt")
    for i in range(4):
        _save(path, f"v{i}")
    assert os.readlink(path) == "ckpt.versions/4" and _text(path) == "v3"
    assert sorted(os.listdir(tmp_path / "a" / "ckpt.versions")) == ["1", "2", "3", "4"]  # replaced < 60 s ago
    monkeypatch.setattr(atomic, "GRACE_SECONDS", 0.0)
    _save(path, "v4")
    assert sorted(os.listdir(tmp_path / "a" / "ckpt.versions")) == ["4", "5"]  # the newest two
    os.rename(tmp_path / "a", tmp_path / "b")  # the link is relative: the parent may move
    assert _text(tmp_path / "b" / "ckpt") == "v4"


def test_a_reader_starts_again_when_its_version_is_removed_or_its_directory_replaced(tmp_path, monkeypatch):
    monkeypatch.setattr(atomic, "GRACE_SECONDS", 0.0)
    path = str(tmp_path / "ckpt")
    _save(path, "first")
    seen = []

    def read(directory):  # a slow reader: two saves happen while it reads, and its version is removed
        seen.append(_text(directory))
        if len(seen) == 1:
            _save(path, "second")
            _save(path, "third")
        return _text(directory)

    assert atomic.read_directory(path, read) == "third" and seen == ["first", "third"]
    # A plain directory (an earlier release's layout) that a save replaces while it is read
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "config.json").write_text("old")
    seen.clear()

    def read_plain(directory):
        seen.append(_text(directory))
        if len(seen) == 1:
            _save(str(plain), "new")
        return _text(directory)

    assert atomic.read_directory(str(plain), read_plain) == "new" and seen == ["old", "new"]


def test_a_reader_fails_at_once_where_nothing_changes(tmp_path):
    calls = []

    def read(directory):
        calls.append(directory)
        return _text(directory)

    with pytest.raises(FileNotFoundError):
        atomic.read_directory(str(tmp_path / "missing"), read)
    assert calls == [str(tmp_path / "missing")]
    _save(str(tmp_path / "ckpt"), "x")
    os.remove(tmp_path / "ckpt" / "config.json")
    with pytest.raises(FileNotFoundError):
        atomic.read_directory(str(tmp_path / "ckpt"), read)
    assert calls[1:] == [str(tmp_path / "ckpt.versions" / "1")]


def test_a_plain_directory_loads_and_the_first_save_replaces_it_with_the_link(target, tmp_path):
    old, new = _drafter(target, 0), _drafter(target, 1)
    saved = tmp_path / "saved"
    rj.save_drafter(old, str(saved))
    plain = tmp_path / "plain"
    plain.mkdir()  # the layout of earlier releases: the files in the directory itself
    for name in os.listdir(saved):
        (plain / name).write_bytes((saved / name).read_bytes())
    (plain / "tokenizer.json").write_text("{}")
    assert _same(_params(rj.load_drafter(str(plain), target)), _params(old))
    rj.save_drafter(new, str(plain))
    assert os.path.islink(plain) and os.readlink(plain) == "plain.versions/1"
    assert sorted(os.listdir(plain)) == ["config.json", "model.safetensors", "tokenizer.json"]  # kept the tokenizer
    assert os.listdir(tmp_path / "plain.versions") == ["1"]  # the plain directory is gone
    assert _same(_params(rj.load_drafter(str(plain), target)), _params(new))


def test_to_plain_directory_keeps_the_current_version_as_files(target, tmp_path):
    """For a checkpoint kept in a repository: the link and its versions become one plain directory
    holding the newest version's files; a plain directory is left alone."""
    path = tmp_path / "shipped"
    first, second = _drafter(target, 0), _drafter(target, 1)
    rj.save_drafter(first, str(path))
    rj.save_drafter(second, str(path))
    atomic.to_plain_directory(str(path))
    assert not os.path.islink(path) and os.path.isdir(path)
    assert not os.path.exists(str(path) + atomic.VERSIONS)
    assert sorted(os.listdir(path)) == ["config.json", "model.safetensors"]
    assert _same(_params(rj.load_drafter(str(path), target)), _params(second))
    atomic.to_plain_directory(str(path))  # already plain: unchanged
    assert _same(_params(rj.load_drafter(str(path), target)), _params(second))
    assert sorted(os.listdir(tmp_path)) == ["shipped"]  # no temporary left behind


def _listing(directory):
    return sorted(os.listdir(directory)), os.path.islink(directory)


def test_a_save_refuses_the_current_directory_and_a_directory_of_other_files(target, tmp_path, monkeypatch):
    """An empty path, ".", the current directory by name, or a directory of someone else's files: the save
    refuses, naming the path, and leaves everything as it was (no link, no versions, the files in place)."""
    drafter = _drafter(target, 0)
    work = tmp_path / "work"
    work.mkdir()
    (work / "my_model.pt").write_bytes(b"weights")
    (work / "notes.txt").write_text("mine")
    monkeypatch.chdir(work)
    before = _listing(work)
    with pytest.raises(rj.CheckpointError, match="empty"):
        rj.save_drafter(drafter, "")
    for path in (".", str(work)):
        with pytest.raises(rj.CheckpointError, match=f"{work}.*current directory"):
            rj.save_drafter(drafter, path)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(rj.CheckpointError, match=f"{work} is not a checkpoint.*my_model.pt, notes.txt"):
        rj.save_drafter(drafter, str(work))
    with pytest.raises(rj.CheckpointError, match="not a checkpoint"):
        _save(str(work), "x")
    assert _listing(work) == before and (work / "my_model.pt").read_bytes() == b"weights"
    assert sorted(os.listdir(tmp_path)) == ["work"]  # no versions directory, no link left behind
    # What a save may replace: a new path, an empty directory, one holding only a tokenizer, a checkpoint
    # that a save wrote, and a plain checkpoint directory (config.json and weights)
    (tmp_path / "empty").mkdir()
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_text("{}")
    for name in ("new", "empty", "tok", "new"):
        rj.save_drafter(drafter, str(tmp_path / name))
    assert sorted(os.listdir(tmp_path / "tok")) == ["config.json", "model.safetensors", "tokenizer.json"]
    atomic.to_plain_directory(str(tmp_path / "new"))
    (tmp_path / "new" / "old_weights.bin").write_bytes(b"old")
    rj.save_drafter(drafter, str(tmp_path / "new"))
    assert os.path.islink(tmp_path / "new") and sorted(os.listdir(tmp_path / "new")) == ["config.json",
                                                                                          "model.safetensors"]


def test_a_save_carries_symbolic_links_as_links(target, tmp_path):
    """A link among the files that a save carries over stays a link to the same file: its target's content
    is never copied into the checkpoint (``tokenizer.json -> /etc/passwd`` must not become a copy)."""
    secret = tmp_path / "secret.txt"
    secret.write_text("not for the checkpoint")
    drafter = _drafter(target, 0)
    path = tmp_path / "plain"
    path.mkdir()
    (path / "tokenizer.json").symlink_to(secret)  # absolute
    (path / "tokenizer_config.json").symlink_to("../secret.txt")  # relative, out of the directory
    (path / "vocab.json").write_text("{}")
    (path / "merges.txt").symlink_to("vocab.json")  # relative, to a carried file beside it
    for _ in range(2):  # the plain directory's first save, then a save over the version it made
        rj.save_drafter(drafter, str(path))
        version = os.path.realpath(path)
        for name in ("tokenizer.json", "tokenizer_config.json", "merges.txt"):
            assert os.path.islink(os.path.join(version, name)), name
        assert os.path.realpath(os.path.join(version, "tokenizer.json")) == str(secret)
        assert os.path.realpath(os.path.join(version, "tokenizer_config.json")) == str(secret)
        assert os.readlink(os.path.join(version, "merges.txt")) == "vocab.json"
    atomic.to_plain_directory(str(path))  # the plain copy keeps the links too
    assert os.path.islink(path / "tokenizer.json") and os.path.islink(path / "tokenizer_config.json")
    assert (path / "tokenizer_config.json").read_text() == "not for the checkpoint"
    assert os.readlink(path / "merges.txt") == "vocab.json"
    # A link that leads nowhere (a loop) is refused, as a FIFO is: the save names it and changes nothing
    (path / "README.md").symlink_to("README.md")
    with pytest.raises(ValueError, match="README.md"):
        rj.save_drafter(drafter, str(path))
    os.remove(path / "README.md")
    os.mkfifo(path / "tokenizer.fifo")
    with pytest.raises(ValueError, match="tokenizer.fifo"):
        rj.save_drafter(drafter, str(path))
