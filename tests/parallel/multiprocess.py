"""Helpers for the multi-process tests: several processes on this machine stand in for several hosts,
each with its own CPU devices, joined by ``jax.distributed`` through a local coordinator."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env_for(process_id: int | None, num_processes: int, devices: int, port: int | None) -> dict:
    env = dict(os.environ, XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}", JAX_PLATFORMS="cpu",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    for key in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
        env.pop(key, None)
    if process_id is not None:
        env.update(JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}", JAX_NUM_PROCESSES=str(num_processes),
                   JAX_PROCESS_ID=str(process_id))
    return env


def start(args: list[str], num_processes: int, devices: int, log_dir: str, tag: str) -> list[subprocess.Popen]:
    """Starts ``python *args`` as ``num_processes`` processes of one run (1: a plain single process)."""
    port = free_port()
    procs = []
    for i in range(num_processes):
        env = env_for(i if num_processes > 1 else None, num_processes, devices, port)
        out = open(os.path.join(log_dir, f"{tag}.{i}.log"), "w")
        procs.append(subprocess.Popen([sys.executable, *args], env=env, cwd=ROOT, stdout=out,
                                      stderr=subprocess.STDOUT))
    return procs


def wait(procs, log_dir: str, tag: str, timeout: float = 600) -> list[str]:
    """Waits for every process; fails with their logs unless all exit 0. Returns the logs."""
    try:
        codes = [p.wait(timeout=timeout) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    logs = [open(os.path.join(log_dir, f"{tag}.{i}.log")).read() for i in range(len(procs))]
    assert codes == [0] * len(procs), "\n".join(f"--- process {i} (exit {c})\n{log[-4000:]}"
                                                 for i, (c, log) in enumerate(zip(codes, logs)))
    return logs


def run(args: list[str], num_processes: int, devices: int, log_dir: str, tag: str, timeout: float = 600):
    return wait(start(args, num_processes, devices, log_dir, tag), log_dir, tag, timeout)
