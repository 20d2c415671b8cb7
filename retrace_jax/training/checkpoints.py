"""Training checkpoints with Orbax: drafter parameters, optimizer state and the step (which fixes the
data position and the random stream), saved asynchronously, the last ``keep`` retained.

Each checkpoint also stores the run's settings (``meta``) as plain JSON. :meth:`Checkpoints.read_meta`
reads them straight from the file, so a resume with other settings is refused before Orbax restores
anything. With several processes every process calls ``save`` and ``restore`` (Orbax coordinates them;
each writes and reads its own shards), and the directory must be one that all processes see.

A checkpoint that would not fit in the free disk space is refused before Orbax writes any of it, and a
write that fails anyway (the disk filled meanwhile) is reported as an ``OSError`` naming the checkpoint:
Orbax itself reports it from background threads, later, as a ``ValueError`` with the errno in its text.

Once a save has finished (Orbax has committed the step directory), process 0 records the sha256 of each of
its files in ``STEP/SHA256SUMS`` (``sha256sum``'s format: ``cd STEP && sha256sum -c SHA256SUMS`` checks it
too). A restore first compares the files with it: a file changed since (a flipped bit that Orbax would read
without complaint) makes the checkpoint unreadable, as a truncated one is. A checkpoint without the file (an
earlier release's, or one whose run was killed between the commit and the recording) is restored unchecked,
with a warning.

Checkpoints written before the decoder block joined q/k/v and gate/up into one parameter each
(``qkv_proj``, ``gate_up_proj``: ``retrace_jax/models/layers.py``) hold them separately, in the parameters
and in the optimizer's moments: :meth:`Checkpoints.restore` reads them as they are and joins them, with a
deprecation warning (AdamW's state is elementwise, so the joined moments are the separate ones, moved).
"""

from __future__ import annotations

import contextlib
import errno
import gc
import json
import logging
import os
import shutil
import sys

import jax
import orbax.checkpoint as ocp
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from retrace_jax.errors import CheckpointError
from retrace_jax.io.atomic import write_error
from retrace_jax.io.digest import CHECKSUMS, changed_files, read_checksums, write_checksums
from retrace_jax.models.layers import JOINED, join_projections, separate_projections
from retrace_jax.parallel.distributed import agree_any, barrier
from retrace_jax.training.data import settings_differences  # noqa: F401 -- still importable from here


class Checkpoints:
    def __init__(self, directory: str, keep: int = 3, async_save: bool = True, read_only: bool = False):
        """``read_only``: only restore; nothing is created or cleaned up, so a run that is still writing
        checkpoints into ``directory`` is left alone."""
        self.directory = os.path.abspath(directory)
        if read_only and not os.path.isdir(self.directory):
            raise FileNotFoundError(f"no checkpoints in {self.directory}")
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                                 create=not read_only, cleanup_tmp_directories=not read_only,
                                                 read_only=read_only),
        )
        # Orbax removes the directories of unfinished saves in a background thread. One still running when
        # the process ends (right after a refused resume, say) fails on the executors that the interpreter
        # has shut down and prints its traceback after the run's error line, so it finishes here.
        await_cleanup = getattr(self.manager, "_maybe_await_cleanup_tmp_directory", None)
        if await_cleanup is not None:
            await_cleanup()
        self._writing: int | None = None  # the step of the last save started (asynchronous saves end later)
        self._unrecorded: int | None = None  # a save whose checksums are recorded once it has finished
        self._checked: dict[int, bool | str] = {}  # verify's answers: True, False (no checksums) or the error
        self._quiet = _QuietWriteFailures(sys.unraisablehook)
        logging.getLogger("absl").addFilter(self._quiet)
        sys.unraisablehook = self._quiet.unraisable

    def latest_step(self) -> int | None:
        """The last finished checkpoint (one whose write was interrupted does not count)."""
        return self.manager.latest_step()

    def all_steps(self) -> list[int]:
        """The finished checkpoints, newest first."""
        return sorted(self.manager.all_steps(), reverse=True)

    def set_aside(self, step: int) -> str:
        """Renames checkpoint ``step`` to ``STEP.unreadable`` (Orbax ignores the name, so the step can be
        saved again); returns the new path. Every process calls this; process 0 renames."""
        path = os.path.join(self.directory, str(step))
        moved, n = path + ".unreadable", 1
        while os.path.exists(moved):
            n += 1
            moved = f"{path}.unreadable-{n}"
        barrier("retrace_jax.checkpoints.set_aside")  # every process chose the name before the rename
        if jax.process_index() == 0:
            os.rename(path, moved)
        barrier("retrace_jax.checkpoints.set_aside.done")
        self.manager.reload()
        self._checked.pop(step, None)
        return moved

    def save(self, step: int, drafter_state, opt_state, meta: dict) -> None:
        """Starts saving state after ``step`` steps (returns before the write finishes when async). Raises
        ``OSError`` (ENOSPC) when the checkpoint would not fit in the free space, before anything is written
        (every process raises together), and reports a failed earlier save first, as its own."""
        self.wait()
        tree = {"params": drafter_state, "opt_state": opt_state}
        # uncompressed (zstd saves little on weights), with room for Orbax's metadata and temporary files
        needed = int(sum(x.nbytes for x in jax.tree.leaves(tree)) * 1.05) + 2**20
        free = shutil.disk_usage(self.directory).free
        if agree_any(free < needed):
            err = OSError(f"no space left on device for checkpoint {step} in {self.directory}: it needs about "
                          f"{_size(needed)}, {_size(free)} are free")
            err.errno = errno.ENOSPC
            raise err
        self._writing = step
        self._checked.pop(step, None)
        try:
            self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                                            meta=ocp.args.JsonSave(dict(meta, step=step))), force=True)
        except Exception as err:
            _raise_io_error(err, f"checkpoint {step} in {self.directory} could not be written")
            raise
        self._unrecorded = step
        self.poll()  # a synchronous save has finished: its checksums are recorded now

    def poll(self) -> None:
        """Records the checksums of the last save if it has finished, without waiting for it. The training
        loop calls this after every step, so a run killed later leaves its newest checkpoint checkable."""
        in_progress = getattr(self.manager, "is_saving_in_progress", None)
        if self._unrecorded is not None and in_progress is not None and not in_progress():
            self.wait()

    def wait(self) -> None:
        """Waits for the last save to finish and records its checksums; its failure to write is an
        ``OSError`` naming it."""
        try:
            self.manager.wait_until_finished()
        except Exception as err:
            self._unrecorded = None  # nothing was committed
            _raise_io_error(err, f"checkpoint {self._writing} in {self.directory} could not be written")
            raise
        if self._unrecorded is not None:
            step, self._unrecorded = self._unrecorded, None
            if jax.process_index() == 0:  # Orbax committed the files of every process: process 0 sees them all
                self._record_checksums(step)

    def _record_checksums(self, step: int) -> None:
        path = os.path.join(self.directory, str(step))
        if not os.path.isdir(path):  # already removed (max_to_keep), or never committed
            return
        try:
            write_checksums(path)
        except OSError as err:
            target = os.path.join(path, CHECKSUMS)
            raise write_error(err, f"the checksums of checkpoint {step} could not be written to {target}") from err

    def verify(self, step: int) -> bool:
        """Compares the files of checkpoint ``step`` with the checksums recorded when it was saved: True
        when they match, False when it records none (an earlier release's checkpoint); a file that changed
        or is missing is a ``CheckpointError`` naming the checkpoint. Process 0 reads the
        files; every process calls this and gets the same answer (remembered until the step is saved again
        or set aside)."""
        if step not in self._checked:
            problem, recorded = None, True
            if jax.process_index() == 0:
                try:
                    recorded = self._compare_checksums(step)
                except CheckpointError as err:
                    problem = str(err)
            if agree_any(problem is not None):
                self._checked[step] = problem or (f"checkpoint {step} in {self.directory} cannot be read (its files "
                                                  f"differ from their checksums on process 0)")
            else:
                self._checked[step] = recorded
        answer = self._checked[step]
        if isinstance(answer, str):
            raise CheckpointError(answer)
        return answer

    def _compare_checksums(self, step: int) -> bool:
        path = os.path.join(self.directory, str(step))
        try:
            recorded = read_checksums(path)
            if recorded is None:
                return False
            bad = changed_files(path, recorded)
        except (OSError, ValueError) as err:
            raise CheckpointError(f"checkpoint {step} in {self.directory} cannot be read ({err})") from None
        if bad:
            named = ", ".join(bad[:3])
            more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
            raise CheckpointError(f"checkpoint {step} in {self.directory} cannot be read (its files differ from the "
                                  f"checksums recorded when it was saved: {named}{more})")
        return True

    def read_meta(self, step: int) -> dict:
        """The settings saved with checkpoint ``step``, read without Orbax (nothing is restored)."""
        path = os.path.join(self.directory, str(step), "meta", "metadata")
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, json.JSONDecodeError):
            return {}  # a checkpoint without readable settings: the restore itself checks the tree

    def restore(self, step: int, drafter_state, opt_state, warn=None):
        """Restores onto the structure, dtypes and shardings of the given (freshly built) states. A
        checkpoint that cannot be read (a truncated, lost or changed file: :meth:`verify`) is a
        ``CheckpointError`` naming it and the cause (Orbax raises bare ``Exception``s, with a TensorStore
        spec in the message). ``warn(message)`` is told (on process 0) when the checkpoint records no
        checksums and is restored unchecked."""
        if not self.verify(step) and warn is not None and jax.process_index() == 0:
            warn(f"checkpoint {step} in {self.directory} records no checksums (an earlier release wrote it, or its "
                 f"run ended before recording them): it is restored without checking its files")
        tree = {"params": drafter_state, "opt_state": opt_state}
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
        separate = self._separate_projections(step)
        if separate:
            if warn is not None and jax.process_index() == 0:
                warn(f"checkpoint {step} in {self.directory} holds separate q/k/v and gate/up projections (written "
                     f"before they were joined): they are joined as it is restored; this conversion is deprecated "
                     f"and will be removed, so resume from or export a newer checkpoint")
            abstract = _on_states(_separated, abstract)
        try:
            r = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                                   meta=ocp.args.JsonRestore()))
            state = r.state if not separate else jax.tree.map(
                lambda like, got: _joined(got, like) if isinstance(like, nnx.State) else got, tree, dict(r.state),
                is_leaf=lambda x: isinstance(x, nnx.State))
        except Exception as err:  # noqa: BLE001 -- any failure to read it
            reason = _reason(err)
        else:
            return state["params"], state["opt_state"], r.meta
        gc.collect()  # Orbax's abandoned reads end now (the traceback held them), while their echoes are silenced
        raise CheckpointError(f"checkpoint {step} in {self.directory} cannot be read ({reason})")

    def _separate_projections(self, step: int) -> bool:
        """Whether checkpoint ``step`` holds the separate projections of the decoder block's joined
        parameters (a checkpoint written before they were joined), read from Orbax's tree metadata."""
        path = os.path.join(self.directory, str(step), "state", "_METADATA")
        try:
            with open(path) as f:
                keys = json.load(f).get("tree_metadata", {})
        except (OSError, ValueError, AttributeError):
            return False  # unreadable: the restore itself reports it
        names = {repr(n) for parts in JOINED.values() for n in parts}
        return any(name in key for key in keys for name in names)

    def close(self) -> None:
        try:
            self.wait()
        except BaseException:
            with contextlib.suppress(Exception):  # Orbax's close waits again and raises the same failure
                self.manager.close()
            raise
        finally:
            logging.getLogger("absl").removeFilter(self._quiet)
            if sys.unraisablehook == self._quiet.unraisable:
                sys.unraisablehook = self._quiet.previous
        self.manager.close()


def _on_states(fn, tree):
    """``fn`` applied to every ``nnx.State`` in ``tree`` (the parameters and the optimizer's moments)."""
    return jax.tree.map(lambda x: fn(x) if isinstance(x, nnx.State) else x, tree,
                        is_leaf=lambda x: isinstance(x, nnx.State))


def _separated(state: nnx.State) -> nnx.State:
    """The abstract ``state`` with each joined parameter (:data:`JOINED`) as its separate parts: the tree a
    checkpoint written before the joining holds. A part is placed as the joined parameter splits its
    head (q/k/v) or neuron (gate/up) axis."""
    items = []
    for path, var in nnx.to_flat_state(state):
        value = var.get_value()
        if len(path) < 2 or path[-2] not in JOINED or not hasattr(value, "shape"):
            items.append((path, var))
            continue
        name = path[-2]
        parts = jax.eval_shape(lambda x, name=name: separate_projections(name, x), value)
        sharding = getattr(value, "sharding", None)
        for part_name, part in zip(JOINED[name], parts):
            if isinstance(sharding, NamedSharding):  # the leading (input) axes, then the head or neuron axis
                spec = tuple(sharding.spec) + (None,) * (len(value.shape) - len(sharding.spec))
                lead = len(value.shape) - (3 if name == "qkv_proj" else 2)
                spec = spec[:lead] + (spec[lead] if name == "qkv_proj" else spec[lead + 1],)
                part = jax.ShapeDtypeStruct(part.shape, part.dtype, sharding=NamedSharding(sharding.mesh,
                                                                                         PartitionSpec(*spec)))
            elif sharding is not None:
                part = jax.ShapeDtypeStruct(part.shape, part.dtype, sharding=sharding)
            items.append((path[:-2] + (part_name, path[-1]), var.replace(part)))
    return nnx.from_flat_state(items)


def _joined(restored: nnx.State, like: nnx.State) -> nnx.State:
    """The restored ``state`` of separate projections joined into the parameters of ``like`` (the
    current layout: its paths, shapes and shardings)."""
    got = dict(nnx.to_flat_state(restored))
    items = []
    for path, var in nnx.to_flat_state(like):
        value = var.get_value()
        if len(path) < 2 or path[-2] not in JOINED or not hasattr(value, "shape"):
            items.append((path, got[path]))
            continue
        name = path[-2]
        parts = [got[path[:-2] + (n, path[-1])].get_value() for n in JOINED[name]]
        sharding = getattr(value, "sharding", None)
        join = jax.jit(lambda *p, name=name, shape=tuple(value.shape): join_projections(name, p, shape),
                       out_shardings=sharding)
        items.append((path, var.replace(join(*parts))))
    return nnx.from_flat_state(items)


class _QuietWriteFailures(logging.Filter):
    """Silences the echoes of a failed write or read in Orbax's background threads, which the caller gets
    as one ``OSError`` (:meth:`Checkpoints.wait`) or ``CheckpointError`` (:meth:`Checkpoints.restore`):
    Orbax's error records of it (each with a traceback), TensorStore's callbacks that then find Orbax's
    event loop closed, and Orbax's abandoned reads as they are collected (each an "unraisable" traceback)."""

    def __init__(self, previous_hook):
        super().__init__()
        self.previous = previous_hook  # sys.unraisablehook before: everything else goes there

    def filter(self, record: logging.LogRecord) -> bool:
        err = record.exc_info[1] if record.exc_info else None
        while err is not None:
            if "orbax" in record.pathname and write_error(err, "").errno is not None:
                return False
            err = err.__cause__ or err.__context__
        return True

    def unraisable(self, unraisable) -> None:
        err, tb = unraisable.exc_value, unraisable.exc_traceback
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        closed_loop = (isinstance(err, RuntimeError) and str(err) == "Event loop is closed" and tb is not None
                       and tb.tb_frame.f_code.co_name == "_check_closed")
        # a read of a failed restore, abandoned by Orbax: the restore's CheckpointError reports the failure
        abandoned = "/orbax/" in getattr(getattr(unraisable.object, "cr_code", None), "co_filename", "")
        if not (closed_loop or abandoned):
            self.previous(unraisable)


def _reason(err: BaseException) -> str:
    """The first line of the innermost cause of ``err`` (Orbax's own message goes on with a TensorStore spec)."""
    while err.__cause__ is not None:
        err = err.__cause__
    text = (str(err).splitlines() or [type(err).__name__])[0]
    return text if len(text) <= 300 else text[:297] + "..."


def _raise_io_error(err: Exception, doing: str) -> None:
    """Raises ``err`` as an ``OSError`` saying ``doing`` when it is a failed write (its text gives an
    errno); returns otherwise."""
    io = write_error(err, doing)
    if io.errno is not None:
        raise io from err


def _size(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.2f} MiB"
