"""The benchmarks are code too: the transport job (a push+pull through the real server, with every measure and
the breakdown of one push into its pieces, then through two servers) runs end to end at a small size, so that a
renamed internal breaks a test, not the next benchmark run."""

import multiprocessing

import pytest

from lightning_rudra.transport.rpc_world import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _transport(rank: int, ports: list[tuple[int, int]], results) -> None:
    """The job with one server, then in the same processes (as the benchmark's long-lived workers run it) with
    two: torch fixes a process's RPC rank at its first init, so the learners' ranks must not depend on it."""
    import torch

    from benchmarks.transport import rudra_transport

    torch.set_num_threads(1)
    for num_servers, (port, gloo_port) in zip((1, 2), ports):
        measures = ("both", "solo", "echo", "gloo", "memcpy", "breakdown") if num_servers == 1 else ("both", "solo")
        results.put((num_servers, rank, rudra_transport(rank, numel=1000, port=port, gloo_port=gloo_port, rounds=1,
                                                        iters=2, measures=measures, num_servers=num_servers)))


def test_the_transport_benchmark_runs_every_measure():
    # not "forkserver": Python's one fork server would start here without the preload that the learners' launcher
    # asks for (Lightning), and every later test's learners would import Lightning themselves (seconds each)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ports = [(free_port(), free_port()) for _ in range(2)]
    workers = [context.Process(target=_transport, args=(rank, ports, results)) for rank in range(2)]
    for worker in workers:
        worker.start()
    try:
        measured = {(servers, rank): out for servers, rank, out in (results.get(timeout=180) for _ in range(4))}
    finally:
        for worker in workers:
            worker.join(timeout=30)
            worker.kill()
    assert [worker.exitcode for worker in workers] == [0, 0]
    expected = {"both", "solo", "echo", "gloo", "memcpy", "clone", "pack", "pack_reuse", "server_update", "load"}
    assert set(measured[1, 0]) == expected and set(measured[2, 0]) == {"both", "solo"}
    assert all(len(times) == 1 and times[0] > 0 for servers in (1, 2) for times in measured[servers, 0].values())
