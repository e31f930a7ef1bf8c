"""Node-local aggregation (Rudra-adv) over two hosts as two network namespaces (``benchmarks.hosts``), 2 learners
each, hardsync: the node's learners sum their gradients in the node's shared memory and one push per node crosses the
link to the other host's server. Exactly SGD with batch μλ, with about half the bytes on the link of the same run with
``node_aggregation=False`` (the old path, exact as well: ``test_hosts.py``); a node member killed mid-run ends both hosts with
errors that name it, bounded, leaving no process."""

import pytest

from benchmarks.hosts import why_no_hosts
from tests.hosts_harness import EPOCHS, WIDTH, assert_compressed_hardsync, assert_hardsync_over, fit_on_two_hosts
from tests.scripts.hosts_fit import Wide

pytestmark = [
    pytest.mark.slow,
    pytest.mark.timeout(300),
    pytest.mark.skipif(why_no_hosts() is not None, reason=str(why_no_hosts())),
]


def test_two_hosts_two_learners_each_train_hardsync_exactly_with_aggregation_and_half_the_bytes(tmp_path):
    """The default (None) turns it on here: hardsync, 2 nodes of 2 learners, each server on the other host for half
    the learners. Without it every learner pushes its part to the other host's server and pulls it back: 4 models'
    worth per step on the link (tx + rx of host 1's end, ``test_hosts.py``); with it 2, plus the set-up (each
    learner's first and final weights: about 4.5 models in all) and headers: below 3 per step."""
    args = [str(EPOCHS), "hardsync", "0", "20", str(WIDTH), "none", "auto"]
    codes, logs, left, crossed = fit_on_two_hosts(tmp_path, 2, *args)
    assert_hardsync_over(4, codes, logs, left, WIDTH)
    model_bytes = 4 * sum(p.numel() for p in Wide(WIDTH).parameters())
    steps = EPOCHS * 256 // (8 * 4)
    assert 2 * steps * model_bytes <= crossed < 3 * steps * model_bytes, (crossed, model_bytes)


def test_aggregation_with_compression_stays_within_bf16_rounding_of_sgd(tmp_path):
    """The leader's summed push goes in bfloat16 with error feedback: hardsync within 1e-5 of SGD with batch μλ."""
    args = [str(EPOCHS), "hardsync", "0", "20", str(WIDTH), "bf16", "on"]
    codes, logs, left, _ = fit_on_two_hosts(tmp_path, 2, *args)
    assert_compressed_hardsync(32, codes, logs, left)


@pytest.mark.parametrize("victim", [1, 3])
def test_a_node_member_killed_mid_run_ends_both_hosts_with_an_error_naming_it(tmp_path, victim):
    """Learner 1 (host 0's second: its leader, learner 0, waits for it on the board) or learner 3 (host 1's second)
    kills itself at its 6th step. Every host ends by itself, well within the test's bound (rpc_timeout 20 s), with an
    error that names the learner (from its node's first learner, which waited for it), and leaves no process."""
    args = ["1000", "hardsync", "0.02", "20", str(WIDTH), "none", "on", f"{victim}:5"]
    codes, logs, left, _ = fit_on_two_hosts(tmp_path, 2, *args, timeout=120.0)
    assert None not in codes and 0 not in codes, (codes, [log[-2000:] for log in logs])
    assert f"KILLING learner {victim}" in "".join(logs)
    # named by its node's first learner, which waited for it ("learner 1 (on this node, process 6) ended while
    # learner 0 waited ...") or by the server of its host, which saw its process end first ("learner 1 (on
    # 10.x.y.1) ended before training did"); Lightning's launcher on the victim's host may end that host's
    # processes (SIGKILL) before they print, but the other host hears it through the servers
    other = logs[1 - victim // 2]
    assert f"learner {victim} (on " in other, other[-3000:]
    assert left == [[], []]
