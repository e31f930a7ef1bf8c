"""The benchmarks are code too: the transport job (a push+pull through the real server, with every measure and
the breakdown of one push into its pieces) runs end to end at a small size, so that a renamed internal breaks a
test, not the next benchmark run."""

import multiprocessing

import pytest

from lightning_rudra.rpc_world import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def _transport(rank: int, port: int, gloo_port: int, results) -> None:
    import torch

    from benchmarks.transport import rudra_transport

    torch.set_num_threads(1)
    results.put((rank, rudra_transport(rank, numel=1000, port=port, gloo_port=gloo_port, rounds=1, iters=2)))


def test_the_transport_benchmark_runs_every_measure():
    # not "forkserver": Python's one fork server would start here without the preload that the learners' launcher
    # asks for (Lightning), and every later test's learners would import Lightning themselves (seconds each)
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    port, gloo_port = free_port(), free_port()
    workers = [context.Process(target=_transport, args=(rank, port, gloo_port, results)) for rank in range(2)]
    for worker in workers:
        worker.start()
    try:
        measured = dict(results.get(timeout=180) for _ in workers)
    finally:
        for worker in workers:
            worker.join(timeout=30)
            worker.kill()
    assert [worker.exitcode for worker in workers] == [0, 0]
    expected = {"both", "solo", "echo", "gloo", "memcpy", "clone", "pack", "pack_reuse", "server_update", "load"}
    assert set(measured[0]) == expected
    assert all(len(times) == 1 and times[0] > 0 for times in measured[0].values())
