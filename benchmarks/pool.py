"""A pool of long-lived worker processes, one per rank, that run the same jobs in the same order.

Starting a process that imports Lightning takes seconds on a small machine, so the benchmark starts its
workers once and hands them jobs instead of launching a fresh pair for every measurement. The workers look
like processes started by torchrun (``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR`` in the environment), so a
``Trainer`` built inside a job leaves process creation to us and each rank can be configured on its own
(a straggler's sleep, its number of steps). Jobs meet through their own rendezvous (RPC, gloo); the pool only
delivers them: job ``i`` is a JSON file ``jobs/i.json``, and every rank answers with ``results/i_r<rank>.json``.

A job that raises, hangs past its timeout or kills a worker ends the pool (every process it started,
including a parameter-server process, which lives in the worker's session); the next job starts a new one.
"""

import argparse
import importlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:
    from benchmarks.hosts import Host

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POLL_S = 0.02


class JobFailed(RuntimeError):
    pass


def _write_json(path: str, obj: Any) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


class Pool:
    """``size`` worker processes; ``env`` is added to their environment (and so to processes they start)."""

    def __init__(
        self,
        name: str,
        size: int = 2,
        env: Optional[dict[str, str]] = None,
        preload: tuple[str, ...] = (),
        start_timeout: float = 180.0,
        hosts: Sequence["Host"] = (),
    ) -> None:
        """``hosts`` (:func:`benchmarks.hosts.two_hosts`): the workers run on these hosts, ``size / len(hosts)``
        on each, rank by rank (the first ones on the first host), as a launcher started on each machine would."""
        self.name = name
        self.size = size
        self.hosts = list(hosts)
        self.env = dict(env or {})
        self.preload = preload
        self.start_timeout = start_timeout
        self.procs: list[subprocess.Popen] = []
        self.dir: Optional[str] = None
        self.next_job = 0
        self.logs: list[Any] = []

    # ---- life cycle ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start the workers (returns at once; :meth:`wait_ready` waits for their imports)."""
        if self.procs:
            return
        self.dir = tempfile.mkdtemp(prefix=f"rudra-bench-{self.name}-")
        os.makedirs(os.path.join(self.dir, "jobs"))
        os.makedirs(os.path.join(self.dir, "results"))
        self.next_job = 0
        env = dict(os.environ)
        env.update(
            {
                "MASTER_ADDR": "127.0.0.1",
                "WORLD_SIZE": str(self.size),
                "NODE_RANK": "0",
                "OMP_NUM_THREADS": "1",
                "PYTHONPATH": os.pathsep.join(
                    [REPO_ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
                ),
                "PYTHONWARNINGS": "ignore",
            }
        )
        env.update(self.env)
        if self.hosts:
            self._start_on_hosts(env)
            return
        for rank in range(self.size):
            log = open(os.path.join(self.dir, f"worker{rank}.log"), "w")
            self.logs.append(log)
            self.procs.append(
                subprocess.Popen(
                    self._worker(rank),
                    env={**env, "LOCAL_RANK": str(rank), "RANK": str(rank)},
                    cwd=REPO_ROOT,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )

    def _worker(self, rank: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "benchmarks.pool",
            "--dir",
            str(self.dir),
            "--rank",
            str(rank),
            "--preload",
            ",".join(self.preload),
        ]

    def _start_on_hosts(self, env: dict[str, str]) -> None:
        """One process per host, its first (:meth:`benchmarks.hosts.Host.start`), running that host's workers: they
        share its host name and ``/dev/shm``, as the processes of one machine do, and meet the others at the first
        host's address, through the host's end of the link (``RUDRA_BENCH_LINK``: where they read its counters)."""
        per_host = self.size // len(self.hosts)
        for index, host in enumerate(self.hosts):
            workers = [
                shlex.join(["env", f"LOCAL_RANK={rank - index * per_host}", f"RANK={rank}", *self._worker(rank)])
                + f" > {shlex.quote(os.path.join(str(self.dir), f'worker{rank}.log'))} 2>&1 &"
                for rank in range(index * per_host, (index + 1) * per_host)
            ]
            host_env = {
                **env,
                "MASTER_ADDR": self.hosts[0].address,
                "NODE_RANK": str(index),
                "TP_SOCKET_IFNAME": host.interface,
                "GLOO_SOCKET_IFNAME": host.interface,
                "RUDRA_BENCH_LINK": host.interface,
            }
            log = Path(str(self.dir), f"host{index}.log")
            self.procs.append(host.start(["sh", "-c", " ".join(workers) + " wait"], host_env, log))

    def wait_ready(self) -> None:
        self.start()
        deadline = time.monotonic() + self.start_timeout
        while not all(os.path.exists(os.path.join(self.dir, f"ready{r}")) for r in range(self.size)):
            self._check_alive("starting")
            if time.monotonic() > deadline:
                self._fail(f"workers not ready after {self.start_timeout:.0f} s")
            time.sleep(POLL_S)

    def close(self) -> None:
        """Ask the workers to exit; kill them if they do not."""
        if not self.procs:
            return
        open(os.path.join(self.dir, "stop"), "w").close()
        deadline = time.monotonic() + 10
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        self._kill()

    def _kill(self) -> None:
        for proc in self.procs:
            # the worker's session: the worker and any server process it started, even if it has exited (on a
            # host: its first process, and with it, by the kernel, every process of the host)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for log in self.logs:
            log.close()
        self.procs, self.logs = [], []
        if self.dir is not None and not os.environ.get("RUDRA_BENCH_KEEP_LOGS"):
            shutil.rmtree(self.dir, ignore_errors=True)

    # ---- jobs ------------------------------------------------------------------------------------------
    def run(self, fn: str, timeout: float, **kwargs: Any) -> list[Any]:
        """Run ``fn(rank, **kwargs)`` ("module:function") on every rank; returns the results in rank order."""
        self.wait_ready()
        index = self.next_job
        self.next_job += 1
        _write_json(os.path.join(self.dir, "jobs", f"{index:04d}.json"), {"fn": fn, "kwargs": kwargs})
        paths = [os.path.join(self.dir, "results", f"{index:04d}_r{r}.json") for r in range(self.size)]
        deadline = time.monotonic() + timeout
        results: dict[int, Any] = {}
        while len(results) < self.size:
            for rank, path in enumerate(paths):
                if rank not in results and os.path.exists(path):
                    with open(path) as f:
                        results[rank] = json.load(f)
                    if not results[rank]["ok"]:
                        self._fail(f"{fn} failed on rank {rank}:\n{results[rank]['error']}")
            if len(results) == self.size:
                break
            self._check_alive(fn)
            if time.monotonic() > deadline:
                self._fail(f"{fn} did not finish within {timeout:.0f} s")
            time.sleep(POLL_S)
        return [results[r]["result"] for r in range(self.size)]

    def _check_alive(self, what: str) -> None:
        for index, proc in enumerate(self.procs):
            if proc.poll() is not None:
                where = f"host {index}" if self.hosts else f"worker {index}"
                self._fail(f"{where} exited with code {proc.returncode} during {what}")

    def _fail(self, message: str) -> None:
        tails = []
        for rank in range(self.size):
            try:
                with open(os.path.join(self.dir, f"worker{rank}.log")) as f:
                    tails.append(f"--- worker {rank} log tail ---\n" + f.read()[-2000:])
            except OSError:
                pass
        self._kill()
        raise JobFailed(message + ("\n" + "\n".join(tails) if tails else ""))


# ---- the worker process ------------------------------------------------------------------------------------
def worker_main(directory: str, rank: int, preload: list[str]) -> None:
    """Run the jobs of ``directory`` in order until it says stop, or, between jobs, until the process that started
    this one is gone (this one handed to another parent): a benchmark killed without its ``close`` leaves no worker
    of this machine waiting. A worker on a namespace host (``Pool(hosts=...)``) is the child of that host's shell,
    which outlives the benchmark, and a worker in a job waits for the job (its rendezvous and RPC are bounded)."""
    parent = os.getppid()  # its pid may be reused once it is gone, but this process's parent changes at once
    import torch

    torch.set_num_threads(1)
    for module in preload:
        importlib.import_module(module)
    open(os.path.join(directory, f"ready{rank}"), "w").close()
    index = 0
    while True:
        path = os.path.join(directory, "jobs", f"{index:04d}.json")
        while not os.path.exists(path):
            if os.path.exists(os.path.join(directory, "stop")) or os.getppid() != parent:
                return
            time.sleep(POLL_S)
        with open(path) as f:
            job = json.load(f)
        module, name = job["fn"].split(":")
        try:
            result = {"ok": True, "result": getattr(importlib.import_module(module), name)(rank, **job["kwargs"])}
        except BaseException as error:  # report it, then leave: the other ranks may be stuck with this job
            result = {"ok": False, "error": f"{type(error).__name__}: {error}\n{traceback.format_exc()}"}
        _write_json(os.path.join(directory, "results", f"{index:04d}_r{rank}.json"), result)
        if not result["ok"]:
            sys.stdout.flush()
            os._exit(1)
        index += 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--dir", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--preload", default="")
    args = parser.parse_args()
    worker_main(args.dir, args.rank, [m for m in args.preload.split(",") if m])
