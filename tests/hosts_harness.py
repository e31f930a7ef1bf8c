"""Helpers of the several-hosts tests (``tests/strategy/test_hosts.py``, ``tests/strategy/test_node_aggregation.py``;
the hosts themselves are ``benchmarks.hosts``): each host's command, a fit on both hosts with Lightning's launcher
that counts the bytes on the link, and what a finished run is checked against."""

import subprocess
import sys
import time
from typing import Any

import torch

from benchmarks.hosts import LEFT, host_env, two_hosts
from tests.lightning_models import single_process_sgd
from tests.script_runs import printed_result
from tests.scripts.hosts_fit import Wide

SCRIPT = "tests/scripts/hosts_fit.py"
EPOCHS = 2
WIDTH = 4096  # 32 769 weights (128 KiB): the weights, not control messages, make up the traffic on the link


def lightning_envs(hosts) -> list[dict[str, str]]:
    """Each host's environment for Lightning's own launcher: the first host's address, the node's rank."""
    return [host_env(MASTER_ADDR=hosts[0].address, MASTER_PORT=29500, NODE_RANK=i) for i in range(len(hosts))]


def run_on_hosts(hosts, commands, envs, tmp_path, timeout=150.0, during=None):
    """Start each host's command, run ``during(logs)`` if given, wait for all (bounded: a process still running
    then is killed and its code is None). Returns each host's exit code and output, and the processes left
    running on each host once its command ended."""
    logs = [tmp_path / f"host{i}.log" for i in range(len(hosts))]
    procs = [host.start(command, env, log) for host, command, env, log in zip(hosts, commands, envs, logs)]
    if during is not None:
        during(logs)
    deadline = time.monotonic() + timeout
    codes = []
    for proc in procs:
        try:
            codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            codes.append(None)
    texts = [log.read_text() for log in logs]
    return codes, texts, [[line for line in text.splitlines() if line.startswith(LEFT)] for text in texts]


def fit_on_two_hosts(tmp_path, per_host: int, *args: str, timeout: float = 150.0):
    """``SCRIPT`` with ``per_host`` learners on each of two new hosts (its other arguments: ``args``), under
    Lightning's launcher: each host's exit code, output and processes left (``run_on_hosts``), and the bytes
    host 1's end of the link sent and received meanwhile."""
    with two_hosts() as hosts:
        command = [sys.executable, SCRIPT, "2", str(per_host), *args]
        before = hosts[1].link_bytes()
        codes, logs, left = run_on_hosts(hosts, [command, command], lightning_envs(hosts), tmp_path, timeout=timeout)
        return codes, logs, left, hosts[1].link_bytes() - before


def result_of(codes, logs, left) -> dict[str, Any]:
    """What learner 0 printed (its ``RESULT`` line), once every host ended with 0 and left no process."""
    assert codes == [0] * len(codes), "\n".join(log[-3000:] for log in logs)
    assert left == [[]] * len(left), "processes left on the hosts"
    return printed_result(logs[0])


def assert_sgd(result: dict[str, Any], batch: int, width: int) -> None:
    """The run's final weights are, within 1e-5, those of single-process SGD with batch ``batch``."""
    expected = single_process_sgd(EPOCHS, batch, Wide(width))
    torch.testing.assert_close(torch.tensor(result["params"]), expected, rtol=0, atol=1e-5)


def assert_hardsync_over(learners, codes, logs, left, width=16):
    result = result_of(codes, logs, left)
    assert result["learners"] == learners
    steps = EPOCHS * 256 // (8 * learners)
    assert result["stats"]["clock"] == steps and result["stats"]["gradients"] == steps * learners
    assert_sgd(result, 8 * learners, width)


def assert_compressed_hardsync(batch: int, codes, logs, left) -> None:
    """Hardsync with compressed pushes (batch μλ = ``batch``): every round applied, none refused, and within bf16
    rounding (error feedback) of SGD with that batch."""
    result = result_of(codes, logs, left)
    assert result["stats"]["clock"] == EPOCHS * 256 // batch and result["stats"]["rejected"] == 0
    assert_sgd(result, batch, WIDTH)
