"""Drafters this project trained and ships inside the package (``assets/drafters/``).

Each ships with ``SHA256SUMS``, the sha256 of its files (``sha256sum``'s format, as a training checkpoint
records them: ``retrace_jax/io/digest.py``), written by :func:`ship_drafter` and compared by
:func:`shipped_drafter` before it gives the directory: a changed file (a flipped bit, which would load
without complaint) makes the drafter unusable rather than silently another one than the one measured.
"""

from __future__ import annotations

import os
import shutil

from retrace_jax.errors import CheckpointError
from retrace_jax.io.digest import CHECKSUMS, changed_files, read_checksums, write_checksums
from retrace_jax.io.files import regular_file

# drafters this project trained and ships inside the package: target name -> {variant: directory under
# drafters/}; "default" is the one `decode.py --target MODEL` runs (retrace_jax/assets/drafters/README.md
# describes each)
SHIPPED = {"qwen2.5-coder-0.5b-instruct": {"default": "qwen2.5-coder-0.5b-instruct-dflash",
                                           "retrace": "qwen2.5-coder-0.5b-instruct-retrace"},
           "smollm2-135m-instruct": {"default": "smollm2-135m-instruct-dflash",
                                     "retrace": "smollm2-135m-instruct-retrace"}}


SHIPPED_DRAFTERS = {model: variants["default"] for model, variants in SHIPPED.items()}  # target -> the default
DRAFTERS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "drafters")


def shipped_drafter(model: str, variant: str = "default") -> str:
    """The directory of a drafter shipped for ``model``: its ``"default"`` (the one ``decode.py --target
    model`` runs) or another variant of :data:`SHIPPED` (``"retrace"``: a ReTrace drafter).
    retrace_jax/assets/drafters/README.md says how each was trained. Its files are first compared with
    the checksums recorded when it shipped (:func:`check_shipped`)."""
    if model not in SHIPPED:
        raise ValueError(f"no drafter shipped for {model!r}; shipped: {', '.join(SHIPPED)}")
    if variant not in SHIPPED[model]:
        raise ValueError(f"no {variant!r} drafter shipped for {model!r}; there are: {', '.join(SHIPPED[model])}")
    path = os.path.join(DRAFTERS_DIR, SHIPPED[model][variant])
    try:  # there but no regular file (a directory, a FIFO) is said to be what it is, and never opened
        regular_file(os.path.join(path, "model.safetensors"),
                     f"the shipped drafter is missing from {path} (a broken installation?)")
    except CheckpointError as err:
        raise CheckpointError(f"the shipped drafter in {path} is damaged: {err} (reinstall retrace-jax)") from None
    check_shipped(path)
    return path


def check_shipped(path: str) -> None:
    """A ``CheckpointError`` naming ``path`` unless its files are exactly those its ``SHA256SUMS`` lists,
    with the content recorded there."""
    where = f"the shipped drafter in {path}"
    try:
        if os.path.lexists(os.path.join(path, CHECKSUMS)):  # a FIFO would never be read to its end
            regular_file(os.path.join(path, CHECKSUMS), "")
        recorded = read_checksums(path)
        for name in recorded or ():  # what is there but no regular file is said to be what it is, not missing
            if os.path.lexists(os.path.join(path, name)):
                regular_file(os.path.join(path, name), "")
        names = os.listdir(path)
        bad = [] if recorded is None else changed_files(path, recorded)
    except CheckpointError as err:
        raise CheckpointError(f"{where} is damaged: {err} (reinstall retrace-jax)") from None
    except (OSError, ValueError) as err:
        raise CheckpointError(f"{where} cannot be checked ({err}); reinstall retrace-jax") from None
    if recorded is None:
        raise CheckpointError(f"{where} has no {CHECKSUMS} to check its files against (a broken installation? "
                              f"reinstall retrace-jax)")
    unlisted = sorted(n for n in names if n not in recorded and n != CHECKSUMS)
    if unlisted:
        raise CheckpointError(f"{where} holds files that its {CHECKSUMS} does not list: {', '.join(unlisted)} "
                              f"(remove them, or reinstall retrace-jax)")
    if bad:
        raise CheckpointError(f"{where} differs from the checksums recorded when it shipped: {', '.join(bad)} (a "
                              f"damaged or edited file; reinstall retrace-jax)")


def ship_drafter(drafter, directory: str) -> None:
    """Writes ``drafter`` where a shipped drafter lives (``assets/drafters/NAME``), replacing what is there:
    bfloat16 tensors in a plain directory (package data cannot hold the symbolic link of
    :func:`~retrace_jax.save_drafter`'s versioned layout) and the ``SHA256SUMS`` that
    :func:`shipped_drafter` checks. For the scripts that ship (scripts/qwen25coder05.sh,
    scripts/smollm2_demo.sh)."""
    from retrace_jax.io.atomic import to_plain_directory
    from retrace_jax.io.checkpoints import save_drafter

    directory = os.path.abspath(directory)
    tmp = directory + ".shipping"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(tmp + ".versions", ignore_errors=True)
    save_drafter(drafter, tmp, dtype="bfloat16")
    to_plain_directory(tmp)
    write_checksums(tmp)
    check_shipped(tmp)
    shutil.rmtree(directory, ignore_errors=True)
    os.replace(tmp, directory)
