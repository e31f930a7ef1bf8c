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
import functools
import itertools
import json
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any, Optional

from benchmarks import stats

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXTRA = 'pip install -e ".[peers]"'
LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
REFRESH_S = 0.05  # hivemind's progress tracker: how often a peer reads the others' progress from the DHT
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
                        [sys.executable, "-m", "benchmarks.peers", folder, str(rank)],
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


# ---- one peer (python -m benchmarks.peers FOLDER RANK) -----------------------------------------------------------
def _wait_for(path: str, deadline: float) -> None:
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear before the deadline")
        time.sleep(0.01)


def _write(path: str, data: bytes) -> None:
    with open(path + ".tmp", "wb") as f:
        f.write(data)
    os.replace(path + ".tmp", path)


def _watchdog(parent: int, deadline: float) -> None:
    """Kill this peer's process group (it, its DHT, its averagers) once the runner is gone or past ``deadline``: a
    runner killed before its cleanup must leave nothing behind."""
    while os.getppid() == parent and time.monotonic() < deadline:
        time.sleep(0.5)
    os.killpg(0, signal.SIGKILL)


def peer(folder: str, rank: int) -> None:
    """Peer ``rank`` of the run whose spec is in ``folder``; writes its result to ``folder/peer{rank}.pkl``."""
    import logging

    import hivemind
    import pytorch_lightning as pl
    from hivemind.optim.grad_averager import GradientAverager
    import torch
    from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

    from benchmarks.training import _accuracy, _busy_wait, _data, _model

    logging.getLogger("hivemind").setLevel(os.environ.get("HIVEMIND_LOGLEVEL", "WARNING"))
    torch.set_num_threads(1)  # as the benchmark pool's workers (DDP's and Rudra's learners)
    with open(os.path.join(folder, "spec.json")) as f:
        spec = json.load(f)
    threading.Thread(target=_watchdog, args=(os.getppid(), spec["deadline"] + GRACE_S), daemon=True).start()
    deadline, learners, mu = spec["deadline"], spec["num_learners"], spec["batch_size"]
    stop = os.path.join(folder, "stop")
    data = _data(None, spec["num_samples"], spec["seed"])
    pl.seed_everything(spec["seed"], verbose=False)  # benchmarks.training.train's initial weights
    model = _model(None, lr=spec["lr"], momentum=spec["momentum"])
    net = {"host_maddrs": LOOPBACK, "use_relay": False, "use_auto_relay": False, "nat_port_map": False}
    net["auto_nat"] = False
    if rank == 0:
        dht = hivemind.DHT(start=True, **net)
        _write(os.path.join(folder, "maddrs.json"), json.dumps([str(a) for a in dht.get_visible_maddrs()]).encode())
    else:
        _wait_for(os.path.join(folder, "maddrs.json"), deadline)
        with open(os.path.join(folder, "maddrs.json")) as f:
            dht = hivemind.DHT(start=True, initial_peers=json.load(f), **net)
    lr, momentum = spec["lr"], spec["momentum"]
    opt = hivemind.Optimizer(
        dht=dht,
        run_id=spec["run_id"],
        params=model.parameters(),
        batch_size_per_step=mu,
        target_batch_size=mu * learners,
        optimizer=lambda params: torch.optim.SGD(params, lr=lr, momentum=momentum),
        matchmaking_time=spec["matchmaking_time"],
        averaging_timeout=spec["averaging_timeout"],
        # hivemind's advice (a warning otherwise): a request timeout below the matchmaking time, for both averagers
        # (averager_opts reaches only the state averager in 1.1.12)
        averager_opts={"request_timeout": spec["matchmaking_time"] / 2},
        grad_averager_factory=functools.partial(GradientAverager, request_timeout=spec["matchmaking_time"] / 2),
        # the collaboration's progress fetched every 50 ms, not every 0.5 s (3 s while alone): with steps of a few
        # ms, a peer that thinks itself alone steps on its own gradients for hundreds of batches
        tracker_opts={"min_refresh_period": REFRESH_S, "default_refresh_period": REFRESH_S},
        verbose=spec["verbose"],
    )
    # counted: hivemind's catch-up of a peer behind the collaboration (a download of the others' state), and the
    # global steps taken on this peer's gradients alone (no other peer, or the averaging round failed)
    counts = {"out_of_sync": 0, "local_steps": 0}

    def counted(name: str, method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            counts[name] += 1
            return method(*args, **kwargs)

        return call

    opt.load_state_from_peers = counted("out_of_sync", opt.load_state_from_peers)  # type: ignore[method-assign]
    opt._load_local_gradients_into_optimizer = counted(  # type: ignore[method-assign]
        "local_steps", opt._load_local_gradients_into_optimizer
    )
    # the rendezvous (as DDP's process group before its first step): every peer's record found in the DHT before any
    # trains, and every optimizer made
    key = f"{spec['run_id']}_rendezvous"
    dht.store(key, subkey=rank, value=True, expiration_time=hivemind.utils.get_dht_time() + 3600)
    while True:
        found = dht.get(key, latest=True)
        if found is not None and len(found.value) >= learners:
            break
        if time.monotonic() > deadline:
            raise TimeoutError(f"peer {rank}: found {0 if found is None else len(found.value)} of {learners} peers")
        time.sleep(0.05)
    open(os.path.join(folder, f"ready{rank}"), "w").close()
    for other in range(learners):
        _wait_for(os.path.join(folder, f"ready{other}"), deadline)

    dataset = TensorDataset(data["x"], data["y"])
    sampler: DistributedSampler = DistributedSampler(
        dataset, num_replicas=learners, rank=rank, shuffle=True, seed=spec["seed"]
    )
    loader = DataLoader(dataset, batch_size=mu, sampler=sampler)
    sleep_s, straggle, every = spec["sleep_s"][rank], spec["straggle"], spec["snapshot_every"] if rank == 0 else 0
    times: list[float] = []
    epoch_ends: list[float] = []
    snapshots: list[tuple[float, list[torch.Tensor]]] = []
    start = time.monotonic()
    stopped = False
    # peer 0 trains max_epochs epochs; the others train on (their next pass over their shard) until it ends, so that
    # a peer a little ahead of it does not leave it to average alone
    for epoch in range(spec["max_epochs"]) if rank == 0 else itertools.count():
        sampler.set_epoch(epoch)
        for x, y in loader:
            if rank and os.path.exists(stop):
                stopped = True
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"peer {rank}: still training at the deadline (epoch {epoch})")
            if sleep_s > 0:  # the straggler: slower by this much per batch
                (_busy_wait if straggle == "busy" else time.sleep)(sleep_s)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step(batch_size=len(y))
            now = time.monotonic()
            times.append(now)
            if every and len(times) % every == 0:
                snapshots.append((now - start, [p.detach().clone() for p in model.parameters()]))
        if stopped:
            break
        epoch_ends.append(time.monotonic())
    end = time.monotonic()
    final = (end - start, [p.detach().clone() for p in model.parameters()])
    if rank == 0:
        open(stop, "w").close()
    global_steps = opt.local_epoch
    opt.shutdown()
    dht.shutdown()
    result: dict[str, Any] = {
        "times": times,
        "epoch_ends": epoch_ends,
        "start": start,
        "end": end,
        "batch_size": mu,
        "parameters": sum(p.numel() for p in model.parameters()),
        "global_steps": global_steps,
        **counts,
    }
    if rank == 0 and spec["snapshot_every"]:  # evaluated after training: measuring costs the run nothing
        probe = _model(None)
        result["accuracy"] = [(t, _accuracy(probe, w, data["x_test"], data["y_test"])) for t, w in snapshots]
        result["final_accuracy"] = (final[0], _accuracy(probe, final[1], data["x_test"], data["y_test"]))
    _write(os.path.join(folder, f"peer{rank}.pkl"), pickle.dumps(result))


if __name__ == "__main__":
    code = 0
    try:
        peer(sys.argv[1], int(sys.argv[2]))
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # hivemind's background threads must not hold the process; the runner kills what it leaves
