"""Training checkpoints with Orbax: drafter parameters, optimizer state and the step (which fixes the
data position and the random stream), saved asynchronously, the last ``keep`` retained."""

from __future__ import annotations

import os

import jax
import orbax.checkpoint as ocp


class Checkpoints:
    def __init__(self, directory: str, keep: int = 3, async_save: bool = True):
        self.manager = ocp.CheckpointManager(
            os.path.abspath(directory),
            options=ocp.CheckpointManagerOptions(max_to_keep=keep, enable_async_checkpointing=async_save,
                                                 create=True),
        )

    def latest_step(self) -> int | None:
        return self.manager.latest_step()

    def save(self, step: int, drafter_state, opt_state, meta: dict) -> None:
        """Starts saving state after ``step`` steps (returns before the write finishes when async)."""
        tree = {"params": drafter_state, "opt_state": opt_state}
        self.manager.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(tree),
                                                        meta=ocp.args.JsonSave(dict(meta, step=step))), force=True)

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
