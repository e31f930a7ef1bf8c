"""Where the time goes: py-spy on a learner and on the parameter-server process during a benchmark job.

    python -m benchmarks.profile push    [--numel 10000000] [--seconds 6] [--both]
    python -m benchmarks.profile train   [--strategy async|hardsync|softsync|ddp] [--seconds 6]
    python -m benchmarks.profile network [--strategy async|hardsync|...] [--link 1gbit] [--params 10000000]
                                         [--epochs 8] [--delay 20] [--seconds 10]
    python -m benchmarks.profile update   [--numel 10000000]
    python -m benchmarks.profile timeline [--strategy ...] [--link 1gbit|none] [--params ...] [--epochs 8]
                                         [--per-host 1]

``push``: learner 0 pushes (``Learner.push``: pack, RPC, async update on the server, weights back, load) in a
loop, learner 1 too with ``--both``. ``train``: the end-to-end job of ``benchmarks.run``. ``network`` (root, ``ip``
and ``tc``): the network phase's training job (``benchmarks.network``: two hosts as network namespaces, the link
shaped to ``--link``, the MLP of ``--params``, one learner per host, whole epochs), any strategy of
``benchmarks.config.STRATEGIES``; the processes profiled are host 1's learner and its server (one per host), found
among the host's processes (``ip netns pids``, as ``benchmarks.hosts.Host.pids``), after ``--delay`` s (start,
rendezvous, warm-up). py-spy samples each process (``--nonblocking``: the processes are not paused) and the script
prints, per process, the share of samples in which each function is on the stack (inclusive), most frequent first.
In ``network`` mode py-spy cannot tell which threads are idle (they are in another pid namespace), so it samples
every thread all the time (``--threads --idle``): the shares are of wall time, over the threads not parked (one stack
95 % of the time or more: the heartbeat, the server's watchers), which the last line names with the number of
samples. A server runs Python only for part of each push (the rest is TensorPipe's C++), so its samples are few.
Needs ``py-spy`` on PATH (``pip install py-spy``).

``update``: the server's update of one push alone, hardsync's and async's under each compensation rule (no py-spy,
no processes).

``timeline``: the ``network`` job (``--per-host`` learners on each host; 2: hardsync aggregates on the node; with
``--link none`` its learners on this host, no link) run whole with ``RUDRA_TIMELINE`` set, then each learner's step,
part by part (``benchmarks.timeline``): where a push's time goes, on the wire and off it. No py-spy.
"""

import argparse
import collections
import contextlib
import os
import re
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from benchmarks import timeline
from benchmarks.pool import Pool
from lightning_rudra.transport.timeline import TIMELINE
from lightning_rudra.transport.rpc_world import free_port


def summarize(path: str, top: int, parked: float = 1.01) -> list[tuple[float, str]]:
    """Inclusive share of samples per function (``name (file)``) in a py-spy ``raw`` (collapsed) profile. A profile
    taken with ``--threads`` names each sample's thread first: a thread then counts as parked, and its samples are
    left out, when one stack has ``parked`` of them or more (a heartbeat, a watcher or a pipe's reader waiting; so
    would a thread in one C call all along): py-spy cannot tell idle threads in another pid namespace, so with
    ``--idle`` it samples every thread all the time. The last line names the threads left out."""
    samples: list[tuple[str, list[str], int]] = []
    with open(path) as f:
        for line in f:
            line = line.rstrip()
            if not line:
                continue
            stack, count = line.rsplit(" ", 1)
            frames = stack.split(";")
            thread = frames.pop(0).split(": ", 1)[-1] if frames[0].startswith("thread (") else ""
            samples.append((thread, frames, int(count)))
    per_thread: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
    for thread, frames, count in samples:
        per_thread[thread][";".join(frames)] += count
    left_out = {t for t, stacks in per_thread.items() if max(stacks.values()) >= parked * sum(stacks.values())}
    total, inclusive = 0, collections.Counter()
    for thread, frames, count in samples:
        if thread in left_out:
            continue
        total += count
        seen = set()
        for frame in frames:
            name = re.sub(r":\d+\)$", ")", frame)
            name = re.sub(r"\(.*/", "(", name)
            if name not in seen:
                seen.add(name)
                inclusive[name] += count
    shares = [(100.0 * c / total, name) for name, c in inclusive.most_common(top)] if total else []
    if left_out:
        shares.append((0.0, f"({total} samples; left out, parked: {', '.join(sorted(left_out))})"))
    return shares


def spy(targets: dict[str, int], seconds: float, rate: int, top: int, out_dir: str, threads: bool = False) -> None:
    """py-spy on every process of ``targets`` (name -> pid) at once for ``seconds``; then each one's summary.
    ``threads``: every thread sampled all the time (``--threads --idle``), parked threads left out of the shares."""
    spies = {}
    for name, pid in targets.items():
        path = os.path.join(out_dir, f"{pid}.txt")
        command = ["py-spy", "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", str(rate)]
        command += ["--format", "raw", "--output", path, "--nonblocking"] + (["--threads", "--idle"] if threads else [])
        spies[name] = (path, subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    for name, (path, process) in spies.items():
        process.wait()
        what = "of the threads not parked, wall time" if threads else "process busy time only"
        print(f"\n== {name}: share of samples with the function on the stack ({what})")
        for share, frame in summarize(path, top, 0.95 if threads else 1.01) if os.path.exists(path) else []:
            print(f"{share:5.1f}%  {frame}")


def _host_processes(host: Any) -> dict[str, int]:
    """A host's learner (the pool's worker) and the server processes it started (its children), by pid as this
    process sees them, from the processes in the host's namespace."""
    parents = {}
    for pid in host.pids():
        try:
            parents[pid] = (
                int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[1]),
                Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0"),
            )
        except (OSError, ValueError):
            continue  # ended meanwhile
    # a worker is "python -m benchmarks.pool ..." (the host's first process names it in a shell command)
    learners = [pid for pid, (_, argv) in parents.items() if argv[1:3] == ["-m", "benchmarks.pool"]]
    found = {}
    for learner in learners:
        found[f"learner (pid {learner})"] = learner
        found.update({f"server (pid {pid})": pid for pid, (ppid, _) in parents.items() if ppid == learner})
    return found


def _update(numel: int, pushes: int = 30, warmup: int = 6) -> None:
    """The server's update alone, in this process (one thread, as a server's): 2 learners taking turns, momentum SGD
    on one parameter of ``numel`` elements, hardsync, and async under each compensation rule; the median time of a
    push (hardsync's: half of them close a round)."""
    import torch

    from lightning_rudra.core.compensation import DEFAULT_COMPENSATION
    from lightning_rudra.core.optimizers import OptimizerSpec, hyperparameters
    from lightning_rudra.core.protocol import ProtocolConfig, Server
    from lightning_rudra.core.update import Push

    torch.set_num_threads(1)
    print(f"a push's update on the server, {numel} elements, 2 learners (median of {pushes - warmup} pushes)")
    for protocol, rule in [("hardsync", DEFAULT_COMPENSATION)] + [
        ("async", rule) for rule in ("none", "momentum", "momentum+clip", "momentum+dana", DEFAULT_COMPENSATION)
    ]:
        params = [torch.randn(numel)]
        opt = torch.optim.SGD(params, lr=0.1, momentum=0.5)
        config = ProtocolConfig(2, protocol, compensation=rule)
        server = Server(config, params, [], [OptimizerSpec.from_optimizer(opt, params)])
        hparams = [hyperparameters(group) for group in opt.param_groups]
        grads = server.grad_layouts[0].pack([torch.randn(numel)])
        timestamps, times = [0, 0], []
        for i in range(pushes):
            learner, packed = i % 2, [g.clone() for g in grads]
            start = time.perf_counter()
            server.push(Push(learner, 0, packed, torch.ones(1, dtype=torch.bool), timestamps[learner], hparams, []))
            times.append(time.perf_counter() - start)
            timestamps[learner] = server.clock
        print(f"{protocol:9} {rule:30} {1000 * statistics.median(times[warmup:]):6.1f} ms")


def _network(args: argparse.Namespace) -> None:
    from benchmarks.config import MODEL_TRAINING, STRATEGIES, TRAINING, TRAINING_PRELOAD
    from benchmarks.hosts import two_hosts, why_no_hosts

    one_host = args.link == "none"  # timeline: the same job on this host, no link
    if one_host and args.what == "network":
        raise SystemExit("network: --link none is the timeline's (one host); py-spy's network mode needs a link")
    why = None if one_host else why_no_hosts(shaped=True)
    if why is not None:
        raise SystemExit(f"network: {why}")
    strategy, n, protos, options = STRATEGIES[args.strategy]
    steps = 6  # per learner and epoch, as the network phase
    per_host = args.per_host
    kwargs = {
        **MODEL_TRAINING,
        "strategy": strategy,
        "n": n,
        "protos": protos,
        "options": options,
        "port": free_port(),
        "lr": TRAINING["lr"],
        "momentum": TRAINING["momentum"],
        "mlp_params": args.params,
        "num_learners": 2 * per_host,
        "num_nodes": 1 if one_host else 2,
        "num_samples": steps * MODEL_TRAINING["batch_size"] * 2 * per_host,
        "max_epochs": args.epochs,
        "sleep_s": [0.0] * 2 * per_host,
    }
    out_dir = tempfile.mkdtemp(prefix="rudra-profile-")
    timeline_dir = os.path.join(out_dir, "timeline")
    if args.what == "timeline":  # the workers, and the servers they start, inherit it
        os.environ[TIMELINE] = timeline_dir
    with contextlib.nullcontext([]) if one_host else two_hosts(args.link) as hosts:
        pool = Pool("profile-network", size=2 * per_host, preload=TRAINING_PRELOAD, hosts=hosts)
        try:
            pool.wait_ready()
            if args.what == "timeline":
                pool.run("benchmarks.training:train", 900, **kwargs)
                where = "one host" if one_host else f"{per_host} learner(s) per host, link {args.link}"
                print(f"{args.strategy}, {2 * per_host} learners, {where}, {args.params} parameters")
                print("times in ms, medians over the steps (benchmarks.timeline)\n")
                print(timeline.table(timeline.breakdown(timeline.read(timeline_dir))))
                print(f"\nthe timeline: {timeline_dir}")
                return
            outcome: dict[str, Any] = {}
            job = threading.Thread(
                target=lambda: outcome.setdefault("result", pool.run("benchmarks.training:train", 900, **kwargs))
            )
            job.start()
            time.sleep(args.delay)  # past start-up and warm-up
            targets = _host_processes(hosts[1])
            print(f"host 1's processes: {targets}")
            spy(targets, args.seconds, args.rate, args.top, out_dir, threads=True)
            job.join()
            if "result" in outcome:
                result = outcome["result"][0]
                print(
                    f"\nthe job: {result.get('parameters')} parameters, rank 0 trained {len(result['times'])} batches"
                )
        finally:
            pool.close()
    print(f"\nraw py-spy profiles (collapsed stacks): {out_dir}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("what", choices=("push", "train", "network", "timeline", "update"))
    parser.add_argument("--numel", type=int, default=10_000_000)
    parser.add_argument("--both", action="store_true", help="push: both learners push at once")
    parser.add_argument("--strategy", default="async")
    parser.add_argument("--seconds", type=float, default=None, help="how long py-spy samples (6 s; network: 10 s)")
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--rate", type=int, default=200, help="py-spy's samples per second")
    parser.add_argument(
        "--link", default="1gbit", help="network, timeline: the link's rate, in tc's units (timeline: none, one host)"
    )
    parser.add_argument("--params", type=int, default=10_000_000, help="network, timeline: the MLP's parameters")
    parser.add_argument("--epochs", type=int, default=8, help="network, timeline: epochs of 6 steps per learner")
    parser.add_argument("--delay", type=float, default=20.0, help="network: seconds before sampling starts")
    parser.add_argument("--per-host", type=int, default=1, choices=(1, 2), help="network, timeline: learners per host")
    args = parser.parse_args()
    if args.what in ("network", "timeline"):
        args.seconds = args.seconds or 10.0
        _network(args)
        return
    if args.what == "update":
        _update(args.numel)
        return
    args.seconds = args.seconds or 6.0

    pool = Pool(
        "profile", preload=("pytorch_lightning", "lightning_rudra", "benchmarks.training", "benchmarks.transport")
    )
    pool.wait_ready()
    if args.what == "push":
        fn, kwargs, delay = (
            "benchmarks.transport:push_loop",
            {"numel": args.numel, "port": free_port(), "seconds": args.seconds + 8, "both": args.both},
            6.0,
        )
    else:
        fn = "benchmarks.training:train"
        kwargs = {
            "strategy": args.strategy,
            "port": free_port(),
            "max_steps": [1_000_000] * 2,
            "sleep_s": [0.0, 0.0],
            "stop_after_s": [args.seconds + 8] * 2,
            "lr": 0.1,
            "momentum": 0.5,
        }
        delay = 10.0
    outcome: dict[str, Any] = {}
    job = threading.Thread(target=lambda: outcome.setdefault("result", pool.run(fn, 300, **kwargs)))
    job.start()
    out_dir = tempfile.mkdtemp(prefix="rudra-profile-")
    try:
        time.sleep(delay)  # past start-up and warm-up
        learner = pool.procs[0].pid
        children = subprocess.run(["pgrep", "-P", str(learner)], capture_output=True, text=True).stdout.split()
        spy(
            {"learner 0": learner, **{f"server (pid {c})": int(c) for c in children}},
            args.seconds,
            args.rate,
            args.top,
            out_dir,
        )
    finally:
        job.join()
        pool.close()
        print(f"\nraw py-spy profiles (collapsed stacks): {out_dir}")


if __name__ == "__main__":
    main()
