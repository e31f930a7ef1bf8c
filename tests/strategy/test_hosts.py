"""Two hosts, each a Linux network namespace with its own address, launched each way Lightning users launch:
Lightning's own launcher (MASTER_ADDR, NODE_RANK), torchrun, and SLURM (the variables srun sets). Hardsync over
every learner of both hosts equals SGD with batch μλ, as on one host; with compressed pushes, it trains with fewer
bytes on the link."""

import json
import re
import sys
import time

import pytest

from benchmarks.hosts import LEFT, host_env, two_hosts, why_no_hosts
from tests.hosts_harness import (
    EPOCHS,
    SCRIPT,
    WIDTH,
    assert_compressed_hardsync,
    assert_hardsync_over,
    fit_on_two_hosts,
    result_of,
    lightning_envs,
    run_on_hosts,
)
from tests.scripts.hosts_fit import Wide

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(240),
    pytest.mark.skipif(why_no_hosts() is not None, reason=str(why_no_hosts())),
]


def test_lightnings_launcher_two_hosts_two_learners_each(tmp_path):
    """The weights cross the link, as between machines (no shared memory, no cross-memory attach): every step,
    each learner pushes its gradient's part of the other host's server (one per node) and pulls that part's
    weights, so that the 4 learners together move 4 models' worth over the link per step. With
    ``node_aggregation=False``: the path without node-local aggregation (with it: test_node_aggregation.py)."""
    args = [str(EPOCHS), "hardsync", "0", "20", str(WIDTH), "none", "off"]
    codes, logs, left, crossed = fit_on_two_hosts(tmp_path, 2, *args)
    assert_hardsync_over(4, codes, logs, left, WIDTH)
    model_bytes = 4 * sum(p.numel() for p in Wide(WIDTH).parameters())
    steps = EPOCHS * 256 // (8 * 4)
    assert crossed >= 4 * steps * model_bytes, f"{crossed} bytes on the link, {model_bytes} per model"


def test_compressed_pushes_cross_the_link_in_fewer_bytes_and_hardsync_without_them_stays_exact(tmp_path):
    """One learner per host, each host's server owning half of the weights: per step each host sends and receives
    half of a gradient and half of the weights, with ``compression="bf16"`` the gradient in bfloat16 and the weights
    as bfloat16 differences: about half the bytes. Hardsync then trains close to SGD with batch μλ (error feedback: nothing lost but the last rounding's
    error); without compression, exactly."""
    crossed = {}
    for compression in ("none", "bf16"):
        args = [str(EPOCHS), "hardsync", "0", "20", str(WIDTH), compression]
        codes, logs, left, crossed[compression] = fit_on_two_hosts(tmp_path, 1, *args)
        if compression == "none":
            assert_hardsync_over(2, codes, logs, left, WIDTH)
        else:
            assert_compressed_hardsync(16, codes, logs, left)
    assert crossed["bf16"] < 0.6 * crossed["none"], crossed


def test_torchrun_on_two_hosts(tmp_path):
    """With pushes during the backward pass (``bucket_cap_mb``: every parameter's part its own bucket) and 2 servers
    per host (``num_servers=4``, server s on host s mod 2): each learner's parts for the other host's 2 servers go in
    pieces, each server its own round; hardsync is still exactly SGD with batch μλ."""
    with two_hosts() as hosts:
        commands = [
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes",
                "2",
                "--nproc-per-node",
                "1",
                "--node-rank",
                str(i),
                "--master-addr",
                hosts[0].address,
                "--master-port",
                "29500",
                SCRIPT,
                "2",
                "1",
                str(EPOCHS),
                *["hardsync", "0", "20", "16", "none", "auto", "none", "0", "no", "1e-5", "4"],
            ]
            for i in range(2)
        ]
        codes, logs, left = run_on_hosts(hosts, commands, [host_env(), host_env()], tmp_path)
    assert_hardsync_over(2, codes, logs, left)
    steps = EPOCHS * 256 // (8 * 2)
    buckets = result_of(codes, logs, left)["buckets"]  # learner 0's, to servers 1 and 3: 3 parameters' parts in all
    assert buckets == {"pieces": 3 * steps, "in pieces": 2 * steps, "whole": 0}


def test_slurm_on_two_hosts(tmp_path):
    """As srun starts one task per node: SLURM's variables only; Lightning takes the address from the node list
    and the port from the job id."""
    with two_hosts() as hosts:
        nodes = ",".join(host.address for host in hosts)
        envs = [
            host_env(
                SLURM_NTASKS=2,
                SLURM_NTASKS_PER_NODE=1,
                SLURM_NNODES=2,
                SLURM_PROCID=i,
                SLURM_LOCALID=0,
                SLURM_NODEID=i,
                SLURM_JOB_ID=4242,
                SLURM_JOB_NAME="rudra-test",
                SLURM_NODELIST=nodes,
            )
            for i in range(2)
        ]
        command = [sys.executable, SCRIPT, "2", "1", str(EPOCHS)]
        codes, logs, left = run_on_hosts(hosts, [command, command], envs, tmp_path)
    assert_hardsync_over(2, codes, logs, left)


def test_a_cut_link_ends_both_hosts_with_an_error_that_names_the_unreachable_host(tmp_path):
    """Async, one learner per host; the link goes down mid-run. Each side gives up after rpc_timeout (5 s) of
    silence, with an error, by itself (not killed by the test's bound), and no process is left on either host."""

    def cut_once_training(logs):
        for _ in range(600):  # bounded: 120 s
            if "TRAINING" in logs[0].read_text():
                break
            time.sleep(0.2)
        time.sleep(2.0)  # some steps over the link first
        hosts[1].cut_link()

    with two_hosts() as hosts:
        envs = lightning_envs(hosts)
        command = [sys.executable, SCRIPT, "2", "1", "1000", "async", "0.02", "5"]
        codes, logs, left = run_on_hosts(hosts, [command, command], envs, tmp_path, during=cut_once_training)
    assert None not in codes and 0 not in codes, (codes, [log[-2000:] for log in logs])
    assert "TRAINING" in logs[0]
    # host 0 hears of host 1's silence from its server (learner 1 lost), or from its own learner (server 1, which
    # runs on host 1, one per node, does not answer), whichever comes first
    assert (
        f"learner 1 (on {hosts[1].address}) has not been heard from" in logs[0]
        or f"parameter server 1 (on {hosts[1].address}) did not answer" in logs[0]
    ), logs[0][-3000:]
    assert f"(on {hosts[0].address})" in logs[1], logs[1][-3000:]
    assert left == [[], []]


@pytest.mark.timeout(400)  # two starts of host 1's learner, and rpc_timeout of silence between them
def test_a_learner_started_again_on_its_host_joins_across_the_link(tmp_path):
    """Two hosts, a learner on each, the server on host 0: learner 1 dies (kill -9; its host's processes end with
    it), the server counts it lost after rpc_timeout of silence, and the same command, started again on host 1
    then, joins the run across the link and trains."""
    rejoin = "tests/scripts/rejoin_fit.py"
    with two_hosts() as hosts:
        envs = lightning_envs(hosts)
        command = [sys.executable, rejoin, str(tmp_path), "0", "0", "16", "2"]
        again: list = []  # the new process, and the batches learner 1 had trained before it

        def trained() -> int:
            return len((tmp_path / "ids1").read_text().splitlines())

        def replace_learner_1(logs):
            deadline = time.monotonic() + 120
            # started once the server has counted it lost (rpc_timeout of silence), as docs/rejoin.md says to
            while not re.search(r"learner 1 \(on \S+\) was lost", logs[0].read_text()) and time.monotonic() < deadline:
                time.sleep(0.2)
            # each host has a pid namespace of its own: both processes may have the same pid, so count batches
            again.extend([hosts[1].start(command, envs[1], tmp_path / "again.log"), trained()])
            while trained() == again[1] and time.monotonic() < deadline:  # until the new process trains
                time.sleep(0.2)
            (tmp_path / "stop").touch()

        codes, logs, left = run_on_hosts(
            hosts, [command, command], envs, tmp_path, timeout=300, during=replace_learner_1
        )
        code = again[0].wait(timeout=60) if again else None
    assert codes[0] == 0 and left[0] == [], logs[0][-3000:]
    assert code == 0, (tmp_path / "again.log").read_text()[-3000:] + "\n--- host 0:\n" + logs[0][-3000:]
    assert trained() > again[1], "the new learner 1 never trained"
    assert LEFT not in (tmp_path / "again.log").read_text(), "processes left on host 1"
    [line] = [line for line in logs[0].splitlines() if line.startswith("RESULT ")]
    found = json.loads(line[len("RESULT ") :])
    assert [(e["learner"], e["event"]) for e in found["stats"]["events"]] == [(1, "lost"), (1, "rejoined")]
    assert "has not been heard from for more than 5 s" in found["stats"]["events"][0]["why"]
