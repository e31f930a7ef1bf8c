"""A server node (``RudraStrategy(server_nodes=1)``) over two hosts as two network namespaces (``benchmarks.hosts``):
host 0 runs the job's 2 learners, host 1 the server and no learner, each host the same script with its NODE_RANK.
Hardsync is exactly SGD with batch μλ, the server node's ``fit`` returns once the learners are done, and no process is
left on either host. The checks that need no process: ``test_server_nodes_config.py``."""

import json
import sys

import pytest

from benchmarks.hosts import two_hosts, why_no_hosts
from tests.scripts.hosts_fit import Wide
from tests.hosts_harness import EPOCHS, SCRIPT, WIDTH, assert_hardsync_over, lightning_envs, result_of, run_on_hosts

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(180),
    pytest.mark.skipif(why_no_hosts() is not None, reason=str(why_no_hosts())),
]


def test_two_learners_on_host_0_train_hardsync_exactly_with_their_server_on_a_server_node(tmp_path):
    """Then every node's script validates (the learners alone, with a server on node 0) and fits one more epoch with
    a second Trainer (the server node serves it too). Every step crosses the link: host 0's two learners sum their
    gradients on their node (node-local aggregation is on by default: the server is on another host) and one push
    and one reply of the whole model cross per step, plus each fit's set-up (each learner's first and final weights)
    and headers: from 2 to 3 models' worth per step."""
    with two_hosts() as hosts:
        command = [sys.executable, SCRIPT, "1", "2", str(EPOCHS), "hardsync", "0", "20", str(WIDTH), "none", "auto"]
        command += ["none", "1", "again"]  # no learner kills itself; one server node; validate and fit again
        before = hosts[1].link_bytes()
        codes, logs, left = run_on_hosts(hosts, [command, command], lightning_envs(hosts), tmp_path, timeout=150.0)
        crossed = hosts[1].link_bytes() - before
    assert_hardsync_over(2, codes, logs, left, WIDTH)
    assert logs[1].count("SERVER NODE DONE finished") == 2, logs[1]
    assert "RESULT" not in logs[1] and "Traceback" not in logs[1], logs[1]
    [again] = [json.loads(line[len("AGAIN ") :]) for line in logs[0].splitlines() if line.startswith("AGAIN ")]
    assert again["clock"] == 256 // (8 * 2) and len(again["validated"]) == 1, again
    model_bytes = 4 * sum(p.numel() for p in Wide(WIDTH).parameters())
    steps = (EPOCHS + 1) * 256 // (8 * 2)  # both fits
    assert 2 * steps * model_bytes <= crossed < 3 * steps * model_bytes, (crossed, model_bytes)


def test_one_async_learner_pushing_in_buckets_to_a_server_node_is_plain_sgd(tmp_path):
    """Its gradient crosses the link in pieces during the backward pass (``bucket_cap_mb``: every parameter its own
    bucket), one push per step; with one learner async is plain SGD all the same."""
    with two_hosts() as hosts:
        command = [sys.executable, SCRIPT, "1", "1", str(EPOCHS), "async", "0", "20", "16", "none", "auto"]
        command += ["none", "1", "no", "1e-5"]  # no learner kills itself; one server node; buckets
        codes, logs, left = run_on_hosts(hosts, [command, command], lightning_envs(hosts), tmp_path, timeout=150.0)
    assert_hardsync_over(1, codes, logs, left)
    steps = EPOCHS * 256 // 8
    buckets = result_of(codes, logs, left)["buckets"]  # the model's 3 parameters, each its own bucket, every step
    assert buckets == {"pieces": 3 * steps, "in pieces": steps, "whole": 0}
