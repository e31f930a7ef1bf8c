"""Node-local aggregation (Rudra-adv) over two hosts as two network namespaces (``benchmarks.hosts``), 2 learners
each, hardsync: the node's learners sum their gradients in the node's shared memory and one push per node crosses the
link to the other host's server. Exactly SGD with batch μλ, with about half the bytes on the link of the same run with
``node_aggregation=False`` (the old path, exact as well: ``test_hosts.py``); a node member killed mid-run ends both hosts with
errors that name it, bounded, leaving no process."""

import json
import sys

import pytest
import torch

from benchmarks.hosts import host_env, two_hosts, why_no_hosts
from tests.lightning_models import single_process_sgd
from tests.scripts.hosts_fit import Wide
from tests.strategy.test_hosts import EPOCHS, SCRIPT, WIDTH, assert_hardsync_over, run_on_hosts

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(why_no_hosts() is not None, reason=str(why_no_hosts())),
]


def fit_on_two_hosts(tmp_path, *extra, timeout=150.0):
    with two_hosts() as hosts:
        envs = [host_env(MASTER_ADDR=hosts[0].address, MASTER_PORT=29500, NODE_RANK=i) for i in range(2)]
        command = [sys.executable, SCRIPT, "2", "2", *extra]
        before = hosts[1].link_bytes()
        codes, logs, left = run_on_hosts(hosts, [command, command], envs, tmp_path, timeout=timeout)
        return codes, logs, left, hosts[1].link_bytes() - before


def test_two_hosts_two_learners_each_train_hardsync_exactly_with_aggregation_and_half_the_bytes(tmp_path):
    """The default (None) turns it on here: hardsync, 2 nodes of 2 learners, each server on the other host for half
    the learners. Without it every learner pushes its part to the other host's server and pulls it back: 4 models'
    worth per step on the link (tx + rx of host 1's end, ``test_hosts.py``); with it 2, plus the set-up (each
    learner's first and final weights: about 4.5 models in all) and headers: below 3 per step."""
    args = [str(EPOCHS), "hardsync", "0", "20", str(WIDTH), "none", "auto"]
    codes, logs, left, crossed = fit_on_two_hosts(tmp_path, *args)
    assert_hardsync_over(4, codes, logs, left, WIDTH)
    model_bytes = 4 * sum(p.numel() for p in Wide(WIDTH).parameters())
    steps = EPOCHS * 256 // (8 * 4)
    assert 2 * steps * model_bytes <= crossed < 3 * steps * model_bytes, (crossed, model_bytes)


def test_aggregation_with_compression_stays_within_bf16_rounding_of_sgd(tmp_path):
    """The leader's summed push goes in bfloat16 with error feedback: hardsync within 1e-5 of SGD with batch μλ."""
    args = [str(EPOCHS), "hardsync", "0", "20", str(WIDTH), "bf16", "on"]
    codes, logs, left, _ = fit_on_two_hosts(tmp_path, *args)
    assert codes == [0, 0], "\n".join(log[-3000:] for log in logs)
    assert left == [[], []], "processes left on the hosts"
    [line] = [line for line in logs[0].splitlines() if line.startswith("RESULT ")]
    result = json.loads(line[len("RESULT ") :])
    assert result["stats"]["clock"] == EPOCHS * 256 // 32 and result["stats"]["rejected"] == 0
    expected = single_process_sgd(EPOCHS, 32, Wide(WIDTH))
    torch.testing.assert_close(torch.tensor(result["params"]), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("victim", [1, 3])
def test_a_node_member_killed_mid_run_ends_both_hosts_with_an_error_naming_it(tmp_path, victim):
    """Learner 1 (host 0's second: its leader, learner 0, waits for it on the board) or learner 3 (host 1's second)
    kills itself at its 6th step. Every host ends by itself, well within the test's bound (rpc_timeout 20 s), with an
    error that names the learner (from its node's first learner, which waited for it), and leaves no process."""
    args = ["1000", "hardsync", "0.02", "20", str(WIDTH), "none", "on", f"{victim}:5"]
    codes, logs, left, _ = fit_on_two_hosts(tmp_path, *args, timeout=120.0)
    assert None not in codes and 0 not in codes, (codes, [log[-2000:] for log in logs])
    assert f"KILLING learner {victim}" in "".join(logs)
    # named by its node's first learner, which waited for it ("learner 1 (on this node, process 6) ended while
    # learner 0 waited ...") or by the server of its host, which saw its process end first ("learner 1 (on
    # 10.x.y.1) ended before training did"); Lightning's launcher on the victim's host may end that host's
    # processes (SIGKILL) before they print, but the other host hears it through the servers
    other = logs[1 - victim // 2]
    assert f"learner {victim} (on " in other, other[-3000:]
    assert left == [[], []]
