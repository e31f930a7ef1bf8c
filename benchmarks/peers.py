"""hivemind beside DDP and Rudra (issue 33): ``hivemind.Optimizer`` driven in a plain torch loop, one process per
peer, training what the accuracy phase trains (``benchmarks.accuracy``), so that its time to DDP's accuracy can be
read from the same run dict. An optional extra, not a dependency of the package: ``pip install -e ".[peers]"``.

lightning-hivemind's Lightning plugin does not import with Lightning 2.6, hence the plain loop. Each peer:

- builds the MNIST-1D split of ``benchmarks.training._data`` and the example CNN from the same seed as
  ``benchmarks.training.train`` (the same initial weights), and goes through its own shard of the train split every
  epoch, as DDP's ``DistributedSampler`` deals it (``shuffle=True``, ``seed``, ``set_epoch``), μ samples a batch;
- trains it with ``hivemind.Optimizer(batch_size_per_step=μ, target_batch_size=μ·λ, optimizer=SGD(lr,
  momentum))``: every peer accumulates its gradients until the collaboration has μ·λ samples, then the peers
  average their accumulated gradients (an all-reduce, weighted by samples) and each takes the SGD step on the
  average: DDP's arithmetic when all peers keep up. hivemind's defaults otherwise: ``use_local_updates=False``,
  ``offload_optimizer=True`` (the optimizer on a copy of the parameters, as it is whenever ``params`` are given),
  ``delay_optimizer_step=False``, ``delay_grad_averaging=False``, ``average_state_every=1`` with
  ``delay_state_averaging=True`` (parameters and optimizer state averaged after every global step, in the
  background), no compression; a peer that falls behind the collaboration's step loads the state from the others
  (hivemind's straggler tolerance: a slow peer's samples count toward the target batch, and it catches up by
  download). Set for a local run of steps of a few ms (hivemind's defaults are for the internet):
  ``matchmaking_time=0.5`` (its default 15 s), ``averaging_timeout=10`` (60 s), a request timeout of
  ``matchmaking_time / 2`` for both averagers (3 s; hivemind warns unless it is below the matchmaking time) and ``tracker_opts=
  {"min_refresh_period": 0.05, "default_refresh_period": 0.05}`` (0.5 s and 3 s: how often a peer reads the others'
  progress; with the defaults each peer trains alone on its own gradients for its first seconds, hundreds of
  batches here);
- talks only to the other peers: every DHT listens on 127.0.0.1 only, no relays, no NAT port mapping, no AutoNAT,
  no IPFS, and peers after the first bootstrap from the first's visible addresses only. The peers meet (each
  finds every peer's record in the DHT, as DDP's rendezvous) before any trains.

Training ends when peer 0 has trained its ``max_epochs`` epochs: it then tells the others to stop. Until then the
others train on, a pass over their shard after another (a peer ahead of peer 0 would otherwise leave it to average
alone), so the collaboration may have seen more samples than ``max_epochs`` epochs by then, and a straggler fewer
of its own; the run's epochs (``epoch_ends_s``) are peer 0's. Every peer process runs in its own session; the runner
waits for all of them up to ``timeout`` and kills their process groups (each peer's DHT, averager and p2pd processes
with it) after the run, whatever happened; a peer whose runner is gone kills its own group.

Peer 0 records, as ``benchmarks.training.train``'s callback does, the time of every batch's end, its epochs' ends and
a copy of its weights every ``snapshot_every`` batches and at the end; the copies are evaluated on the test split
after its training, outside the timed path. ``train_hivemind`` returns the accuracy phase's run dict
(``benchmarks.suite.Suite._train`` adds the strategy, rep, seq and job wall time).
"""

import contextlib
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Any, Optional

from benchmarks import stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXTRA = 'pip install -e ".[peers]"'
GRACE_S = 30.0  # after peer 0's end (or a peer's failure): the others' stop and hivemind's shutdown
SOCKETS = ("hivemind-p2pd-", "hivemind-p2pclient-")


class PeersFailed(RuntimeError):
    """A peer failed, or the peers did not end within the timeout; the message has their log tails."""


def require_hivemind() -> None:
    """ImportError naming the extra to install when hivemind cannot be imported."""
    try:
        import hivemind  # noqa: F401
    except ImportError as error:
        raise ImportError(
            f"the hivemind strategy needs hivemind, an optional extra of the benchmarks: {EXTRA} ({error})"
        ) from error


def _pids_in_groups(groups: set[int]) -> list[int]:
    """Processes (not zombies) whose process group is one of ``groups``."""
    out = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] != "Z" and int(fields[2]) in groups:
            out.append(int(entry))
    return out


def _kill_groups(groups: set[int]) -> None:
    for group in groups:
        try:
            os.killpg(group, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _sockets() -> set[str]:
    """hivemind's Unix sockets (its p2p daemon's and its clients'), which it makes in /tmp and leaves there."""
    return {os.path.join("/tmp", n) for n in os.listdir("/tmp") if n.startswith(SOCKETS) and n.endswith(".sock")}


def _tail(path: str, chars: int = 2000) -> str:
    try:
        with open(path, errors="replace") as f:
            return f.read()[-chars:]
    except OSError:
        return ""


def train_hivemind(
    *,
    num_learners: int = 2,
    batch_size: int = 32,
    lr: float = 0.05,
    momentum: float = 0.9,
    max_epochs: int = 1,
    sleep_s: Optional[list[float]] = None,
    straggle: str = "sleep",
    seed: int = 42,
    num_samples: int = 4000,
    snapshot_every: int = 0,
    warmup: int = 10,
    timeout: float = 600.0,
    matchmaking_time: float = 0.5,
    averaging_timeout: float = 10.0,
    verbose: bool = False,
    **_ignored: Any,
) -> dict[str, Any]:
    """λ = ``num_learners`` hivemind peers, μ = ``batch_size`` each, ``max_epochs`` epochs of peer 0; ``sleep_s``:
    per peer, slept (``straggle="sleep"``) or busy-waited (``"busy"``) before every batch. The other keyword
    arguments of ``benchmarks.training.train`` that the accuracy phase passes (port, snapshots, ...) are ignored.
    Returns the run dict: ``stats.throughput`` over every peer, peer 0's epochs (``epoch_ends_s``: its own only;
    ``peer_epoch_ends_s``: every peer's), peer 0's snapshots (``accuracy``, ``final_accuracy``), ``rank0_start_s``,
    ``updates`` (hivemind's global steps, peer 0's count), ``batches`` (per peer), ``peer_pids`` and
    ``peers_left`` (processes of the peers' groups still there after the run: 0). ``PeersFailed`` if a peer
    failed or the run took longer than ``timeout`` s."""
    require_hivemind()
    folder = tempfile.mkdtemp(prefix="rudra-hivemind-")
    deadline = time.monotonic() + timeout
    spec = {
        "folder": folder,
        "run_id": f"rudra-bench-{uuid.uuid4().hex[:12]}",
        "num_learners": num_learners,
        "batch_size": batch_size,
        "lr": lr,
        "momentum": momentum,
        "max_epochs": max_epochs,
        "sleep_s": list(sleep_s or [0.0] * num_learners),
        "straggle": straggle,
        "seed": seed,
        "num_samples": num_samples,
        "snapshot_every": snapshot_every,
        "matchmaking_time": matchmaking_time,
        "averaging_timeout": averaging_timeout,
        "verbose": verbose,
        "deadline": deadline,  # time.monotonic: one clock for every process of the host
    }
    with open(os.path.join(folder, "spec.json"), "w") as f:
        json.dump(spec, f)
    env = {**os.environ, "HIVEMIND_LOGLEVEL": os.environ.get("HIVEMIND_LOGLEVEL", "WARNING")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)
    procs: list[subprocess.Popen] = []
    sockets = _sockets()
    logs = [os.path.join(folder, f"peer{rank}.log") for rank in range(num_learners)]
    spawned = time.monotonic()
    try:
        for rank in range(num_learners):
            with open(logs[rank], "w") as log:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-m", "benchmarks.peer", folder, str(rank)],
                        cwd=ROOT,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=log,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,  # its own process group: its DHT and averagers die with it
                    )
                )
        groups = {p.pid for p in procs}
        problem = None
        stop_by: Optional[float] = None  # once peer 0 ended or a peer failed: the others' time to end
        while any(p.poll() is None for p in procs):
            now = time.monotonic()
            failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
            if failed and problem is None:
                problem = f"peer {failed[0]} exited with {procs[failed[0]].returncode}"
                open(os.path.join(folder, "stop"), "w").close()
            if stop_by is None and (problem or procs[0].returncode is not None):
                stop_by = now + GRACE_S
            if now > deadline + GRACE_S or (stop_by is not None and now > stop_by):
                problem = problem or f"peers still running {now - deadline + timeout:.0f} s after the start: killed"
                break
            time.sleep(0.05)
        failed = [r for r, p in enumerate(procs) if p.returncode not in (None, 0)]
        if failed and problem is None:
            problem = f"peer {failed[0]} exited with {procs[failed[0]].returncode}"
        results = []
        for rank in range(num_learners):
            path = os.path.join(folder, f"peer{rank}.pkl")
            if not os.path.exists(path):
                problem = problem or f"peer {rank} left no result"
                break
            with open(path, "rb") as f:
                results.append(pickle.load(f))
        if problem:
            tails = "\n".join(f"--- peer {r} ---\n{_tail(log)}" for r, log in enumerate(logs))
            raise PeersFailed(f"hivemind run {spec['run_id']}: {problem}\n{tails}")
    finally:
        groups = {p.pid for p in procs}
        _kill_groups(groups)  # the peers' leftovers (a DHT or averager process a peer left behind)
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        left = _pids_in_groups(groups)
        if not left:  # the sockets made during the run, its processes gone (a hivemind run beside it would lose its)
            for path in _sockets() - sockets:
                with contextlib.suppress(OSError):
                    os.unlink(path)
        if not os.environ.get("RUDRA_BENCH_KEEP_LOGS"):
            shutil.rmtree(folder, ignore_errors=True)
    return run_dict(results, warmup, [p.pid for p in procs], len(left), spawned)


def run_dict(results: list[dict[str, Any]], warmup: int, pids: list[int], left: int, spawned: float) -> dict[str, Any]:
    """The accuracy phase's run dict from the peers' results (``peer`` each, rank order)."""
    first = results[0]
    start = min(r["start"] for r in results)
    # peer 0's epochs stand for the run's: the others' ends at peer 0's (a straggler is stopped in its shard)
    run: dict[str, Any] = {"parameters": first["parameters"], **stats.throughput(results, warmup)}
    run.update(stats.epoch_times([{**r, "epoch_ends": first["epoch_ends"]} for r in results], warmup))
    run.update(
        epoch_ends_s=[[e - start for e in first["epoch_ends"]]],
        peer_epoch_ends_s=[[e - start for e in r["epoch_ends"]] for r in results],
        accuracy=first.get("accuracy", []),
        final_accuracy=first.get("final_accuracy"),
        rank0_start_s=first["start"] - start,
        updates=first["global_steps"],
        batches={str(rank): len(r["times"]) for rank, r in enumerate(results)},
        out_of_sync=[r["out_of_sync"] for r in results],
        local_steps=[r["local_steps"] for r in results],
        startup_s=start - spawned,
        peer_pids=pids,
        peers_left=left,
    )
    return run
