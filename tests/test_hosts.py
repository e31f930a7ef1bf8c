"""Two hosts, each a Linux network namespace with its own address, launched each way Lightning users launch:
Lightning's own launcher (MASTER_ADDR, NODE_RANK), torchrun, and SLURM (the variables srun sets). Hardsync over
every learner of both hosts equals SGD with batch μλ, as on one host."""

import json
import subprocess
import sys
import time

import pytest
import torch

from tests.hosts import host_env, two_hosts, why_no_hosts
from tests.lightning_models import single_process_sgd

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240),
              pytest.mark.skipif(why_no_hosts() is not None, reason=str(why_no_hosts()))]

SCRIPT = "tests/scripts/hosts_fit.py"
EPOCHS = 2


def run_on_hosts(hosts, commands, envs, tmp_path, timeout=150.0):
    """Start each host's command, wait for all (bounded), return each host's exit code and output."""
    procs = [host.start(command, env, tmp_path / f"host{i}.log")
             for i, (host, command, env) in enumerate(zip(hosts, commands, envs))]
    deadline = time.monotonic() + timeout
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    return [proc.returncode for proc in procs], [(tmp_path / f"host{i}.log").read_text() for i in range(len(procs))]


def assert_hardsync_over(learners, codes, logs):
    assert codes == [0] * len(codes), "\n".join(log[-3000:] for log in logs)
    [line] = [line for line in logs[0].splitlines() if line.startswith("RESULT ")]
    result = json.loads(line[len("RESULT "):])
    assert result["learners"] == learners
    steps = EPOCHS * 256 // (8 * learners)
    assert result["stats"]["clock"] == steps and result["stats"]["gradients"] == steps * learners
    expected = single_process_sgd(EPOCHS, 8 * learners)
    torch.testing.assert_close(torch.tensor(result["params"]), expected, rtol=0, atol=1e-5)


def test_lightnings_launcher_two_hosts_two_learners_each(tmp_path):
    with two_hosts() as hosts:
        envs = [host_env(MASTER_ADDR=hosts[0].address, MASTER_PORT=29500, NODE_RANK=i) for i in range(2)]
        command = [sys.executable, SCRIPT, "2", "2", str(EPOCHS)]
        codes, logs = run_on_hosts(hosts, [command, command], envs, tmp_path)
    assert_hardsync_over(4, codes, logs)


def test_torchrun_on_two_hosts(tmp_path):
    with two_hosts() as hosts:
        commands = [[sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
                     "--node-rank", str(i), "--master-addr", hosts[0].address, "--master-port", "29500",
                     SCRIPT, "2", "1", str(EPOCHS)] for i in range(2)]
        codes, logs = run_on_hosts(hosts, commands, [host_env(), host_env()], tmp_path)
    assert_hardsync_over(2, codes, logs)


def test_slurm_on_two_hosts(tmp_path):
    """As srun starts one task per node: SLURM's variables only; Lightning takes the address from the node list
    and the port from the job id."""
    with two_hosts() as hosts:
        nodes = ",".join(host.address for host in hosts)
        envs = [host_env(SLURM_NTASKS=2, SLURM_NTASKS_PER_NODE=1, SLURM_NNODES=2, SLURM_PROCID=i, SLURM_LOCALID=0,
                         SLURM_NODEID=i, SLURM_JOB_ID=4242, SLURM_JOB_NAME="rudra-test", SLURM_NODELIST=nodes)
                for i in range(2)]
        command = [sys.executable, SCRIPT, "2", "1", str(EPOCHS)]
        codes, logs = run_on_hosts(hosts, [command, command], envs, tmp_path)
    assert_hardsync_over(2, codes, logs)
