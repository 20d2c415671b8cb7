"""Training checkpoints with Orbax: drafter parameters, optimizer state and the step (which fixes the
data position and the random stream), saved asynchronously, the last ``keep`` retained.

Each checkpoint also stores the run's settings (``meta``) as plain JSON. :meth:`Checkpoints.read_meta`
reads them straight from the file, so a resume with other settings is refused before Orbax restores
anything. With several processes every process calls ``save`` and ``restore`` (Orbax coordinates them;
each writes and reads its own shards), and the directory must be one that all processes see.
"""

from __future__ import annotations

import json
import os

import jax
import orbax.checkpoint as ocp


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

    def latest_step(self) -> int | None:
        """The last finished checkpoint (one whose write was interrupted does not count)."""
        return self.manager.latest_step()

    def save(self, step: int, drafter_state, opt_state, meta: dict) -> None:
        """Starts saving state after ``step`` steps (returns before the write finishes when async)."""
        tree = {"params": drafter_state, "opt_state": opt_state}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                                        meta=ocp.args.JsonSave(dict(meta, step=step))), force=True)

    def read_meta(self, step: int) -> dict:
        """The settings saved with checkpoint ``step``, read without Orbax (nothing is restored)."""
        path = os.path.join(self.directory, str(step), "meta", "metadata")
        try:
            with open(path) as f:
                return json.load(f)
        except (OSError, json.JSONDecodeError):
            return {}  # a checkpoint without readable settings: the restore itself checks the tree

    def restore(self, step: int, drafter_state, opt_state):
        """Restores onto the structure, dtypes and shardings of the given (freshly built) states."""
        tree = {"params": drafter_state, "opt_state": opt_state}
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, tree)
        r = self.manager.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract),
                                                               meta=ocp.args.JsonRestore()))
        return r.state["params"], r.state["opt_state"], r.meta

    def close(self) -> None:
        self.manager.wait_until_finished()
        self.manager.close()


def settings_differences(saved: dict, now: dict) -> dict:
    """``{key: (saved, now)}`` for the settings present in both that differ (JSON-normalised, so a
    tuple equals the list it was saved as)."""
    norm = lambda v: json.loads(json.dumps(v))  # noqa: E731
    return {k: (saved[k], v) for k, v in now.items() if k in saved and norm(saved[k]) != norm(v)}
