"""One hivemind peer of ``benchmarks.peers`` (``python -m benchmarks.peer FOLDER RANK``): its settings, what it
trains and records are in that module's docstring. It reads its spec from ``FOLDER``, meets the other peers, trains,
and writes its results there; it kills its own process group once its runner is gone."""

import functools
import itertools
import json
import os
import pickle
import signal
import sys
import threading
import time
from typing import Any

from benchmarks.peers import GRACE_S

LOOPBACK = ["/ip4/127.0.0.1/tcp/0"]
REFRESH_S = 0.05  # hivemind's progress tracker: how often a peer reads the others' progress from the DHT


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
