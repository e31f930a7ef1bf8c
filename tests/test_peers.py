"""benchmarks.peers: hivemind's peers beside DDP and Rudra (an optional extra: pip install -e ".[peers]")."""

import argparse
import os
import sys

import pytest

from benchmarks import accuracy, peers, stats


def test_the_network_phase_refuses_hivemind():
    from benchmarks import network

    with pytest.raises(ValueError, match="accuracy phase only"):
        network.parse_spec("1gbit:1:1:ddp/hivemind")


def test_without_hivemind_the_error_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "hivemind", None)  # import hivemind raises ImportError
    with pytest.raises(ImportError, match=r'pip install -e "\.\[peers\]"'):
        peers.train_hivemind(num_learners=2, max_epochs=1)
    from benchmarks import run

    args = argparse.Namespace(
        accuracy_strategies="async,hivemind", accuracy_learners=None, accuracy_stragglers=None, accuracy_reps=None
    )
    with pytest.raises(ValueError, match=r'pip install -e "\.\[peers\]"'):
        run.accuracy_options(args, {"accuracy_learners": [2, 4]})


@pytest.mark.slow
@pytest.mark.peers
@pytest.mark.timeout(420)
def test_two_peers_train_an_epoch_together_and_leave_no_process():
    pytest.importorskip("hivemind")
    before = peers._sockets()
    # μ = 16: 90 batches per peer in the epoch, enough for hivemind's averaged steps to pass chance (0.1) by far
    run = peers.train_hivemind(
        num_learners=2,
        batch_size=16,
        lr=0.1,
        momentum=0.9,
        max_epochs=1,
        num_samples=4000,
        snapshot_every=10,
        timeout=300,
    )
    points = stats.series(run)
    assert len(points) >= 5 and all(0.0 <= a <= 1.0 for _, a in points)
    assert [t for t, _ in points] == sorted(t for t, _ in points)
    assert accuracy.final_accuracy(run) > 0.2
    assert len(run["epoch_ends_s"]) == 1 and len(run["epoch_ends_s"][0]) == 1  # peer 0's one epoch
    assert run["updates"] > 0 and run["batches"]["0"] == 90
    # together: each peer trained a fair share of the batches, and peer 0's steps were mostly averaged ones
    assert min(run["batches"].values()) >= 30 and run["local_steps"][0] < run["updates"] / 2
    assert accuracy.epoch_accuracy(run, 1) is not None  # what the accuracy phase's summary reads
    assert run["peers_left"] == 0 and peers._pids_in_groups(set(run["peer_pids"])) == []
    for pid in run["peer_pids"]:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
    assert peers._sockets() <= before  # hivemind's sockets in /tmp: this run's removed
