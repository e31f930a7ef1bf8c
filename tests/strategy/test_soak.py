"""A soak test, skipped by the default suite: ``python -m pytest -m soak`` (about 4 minutes on 2 cores).

Async, 4 learners with random per-step delays, ``min_learners=2``, ``max_staleness=2``; one learner killed (kill -9)
and one stalled (SIGSTOP) during the run, which goes on for ``MINUTES``. Afterwards the gradients are counted on
both sides: the server received what the learners pushed (plus at most one push in flight per lost learner), it
applied what it received minus what it dropped, and the weights are finite.
"""

import os
import random
import signal
import threading
import time

import pytest
import torch

from lightning_rudra import RudraStrategy
from lightning_rudra.transport.rpc_world import free_port
from tests.lightning_models import START, Regression, flat, loader, quiet_trainer
from tests.server_processes import running
from tests.strategy.test_faults import _signal, pid_of

pytestmark = [pytest.mark.slow, pytest.mark.soak, pytest.mark.timeout(900)]

MINUTES = 3


class Jittery(Regression):
    """Each step sleeps 0-20 ms; after each step the learner writes how many steps it completed (each one a push
    answered) and how many of its pushes the server accepted."""

    def __init__(self, directory: str) -> None:
        super().__init__(lr=0.01)
        self.directory = directory
        self.steps = 0

    def on_train_start(self) -> None:
        self.random = random.Random(self.global_rank)
        with open(os.path.join(self.directory, f"learner{self.global_rank}"), "w") as file:
            file.write(str(os.getpid()))

    def training_step(self, batch, batch_idx):
        time.sleep(self.random.uniform(0.0, 0.02))
        return super().training_step(batch, batch_idx)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.steps += 1
        path = os.path.join(self.directory, f"counts{self.global_rank}")
        with open(path + ".partial", "w") as file:
            file.write(f"{self.steps} {self.trainer.strategy._push_metrics.accepted}")
        os.replace(path + ".partial", path)  # a reader (or a kill) never sees half a line


def test_four_learners_one_killed_one_stalled_for_minutes(tmp_path, monkeypatch):
    port = free_port()
    monkeypatch.setenv("MASTER_PORT", str(port))
    signalled = []

    def inject() -> None:
        pids = [pid_of(tmp_path, f"learner{rank}", port) for rank in range(4)]
        time.sleep(MINUTES * 60 / 3)
        os.kill(pids[2], signal.SIGKILL)
        signalled.append(pids[2])
        time.sleep(MINUTES * 60 / 6)
        os.kill(pids[3], signal.SIGSTOP)
        signalled.append(pids[3])

    threading.Thread(target=inject, daemon=True).start()
    model = Jittery(str(tmp_path))
    strategy = RudraStrategy(protocol="async", max_staleness=2, start_method=START, rpc_timeout=5, min_learners=2)
    with pytest.warns(UserWarning, match="learner 2's process ended with signal SIGKILL"):
        quiet_trainer(strategy, 4, max_time={"minutes": MINUTES}, max_epochs=-1).fit(model, loader(8, 1024))
    for pid in signalled:
        _signal(pid, signal.SIGCONT)
    stats = strategy.stats
    assert sorted(stats.lost) == [2, 3] and "has not been heard from" in stats.lost[3]
    counts = [[int(c) for c in (tmp_path / f"counts{rank}").read_text().split()] for rank in range(4)]
    pushed = sum(steps for steps, _ in counts)
    accepted = sum(accepted for _, accepted in counts)
    applied = sum(stats.staleness.values())
    print(
        f"pushed {pushed}, received {stats.gradients}, dropped {stats.dropped}, applied {applied} (learners: "
        f"{accepted} accepted), clock {stats.clock}, batches {stats.batches}, lost {stats.lost}"
    )  # with -s
    assert pushed <= stats.gradients <= pushed + 2  # at most one push in flight per lost learner
    assert applied == stats.gradients - stats.dropped - stats.rejected and stats.rejected == 0
    assert accepted <= applied <= accepted + 2
    assert stats.dropped > 0 and stats.max_staleness <= 2
    assert all(counts[rank][0] > 100 for rank in range(4))  # every learner trained before it was lost
    assert torch.isfinite(flat(model.parameters())).all()
    time.sleep(1)
    assert [pid for pid in signalled if running(pid)] == []
