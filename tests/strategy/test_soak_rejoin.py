"""The elastic soak test, skipped by the default suite: ``RUDRA_SOAK_MINUTES=10 python -m pytest -m soak -k rejoin``
(twice the minutes: a disturbed run, then an undisturbed one of the same length).

Async, 4 learners, ``min_learners=2``, ``max_restarts`` without limit in practice: every 20-40 s one of the learners
(learner 0 too, but not in the last minute) is killed (kill -9) and restarted by the launcher, and rejoins. Afterwards: the server received what the learners
pushed (plus at most one push in flight per kill) and applied what it received minus what it dropped; every sample of
every whole epoch was trained, in it or, dealt again after the others had drained it, in the next; the weights are
finite; and the test accuracy is within 1 point of an undisturbed run of the same length.
"""

import os
import random
import signal
import threading
import time
from collections import defaultdict

import pytest
import pytorch_lightning as pl
import torch

from lightning_rudra import RudraStrategy
from lightning_rudra.transport.rpc_world import free_port
from tests.lightning_models import START, flat, quiet_trainer
from tests.strategy.test_faults import _signal

pytestmark = [pytest.mark.slow, pytest.mark.soak, pytest.mark.timeout(3600)]

MINUTES = float(os.environ.get("RUDRA_SOAK_MINUTES", "10"))
CLASSES, FEATURES = 10, 20


def blobs(num_samples: int, seed: int) -> torch.utils.data.TensorDataset:
    """Ten overlapping Gaussian classes: about 90 % is what an MLP can reach, so a worse run shows."""
    centers = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(0)) * 1.2
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, CLASSES, (num_samples,), generator=g)
    x = centers[y] + torch.randn(num_samples, FEATURES, generator=g)
    return torch.utils.data.TensorDataset(x, y, torch.arange(num_samples))


class Soaked(pl.LightningModule):
    """Each process writes its pid to ``<dir>/learner<rank>``, and after each step ``<pushes> <accepted>`` to
    ``<dir>/counts<rank>-<pid>`` and the sample ids it trained to ``<dir>/ids<rank>-<pid>``."""

    def __init__(self, directory: str) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(torch.nn.Linear(FEATURES, 64), torch.nn.ReLU(), torch.nn.Linear(64, CLASSES))
        self.directory = directory
        self.steps = 0

    def on_train_start(self) -> None:
        self.random = random.Random(self.global_rank * 1000 + os.getpid())
        self.ids = open(os.path.join(self.directory, f"ids{self.global_rank}-{os.getpid()}"), "a")
        with open(os.path.join(self.directory, f"learner{self.global_rank}"), "w") as file:
            file.write(str(os.getpid()))

    def training_step(self, batch, batch_idx):
        time.sleep(self.random.uniform(0.0, 0.02))
        x, y, _ = batch
        return torch.nn.functional.cross_entropy(self.net(x), y)

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.steps += 1  # the push is answered: under async the step waits for its reply
        self.ids.write(f"{self.trainer.current_epoch} {' '.join(map(str, batch[2].tolist()))}\n")
        self.ids.flush()
        path = os.path.join(self.directory, f"counts{self.global_rank}-{os.getpid()}")
        with open(path + ".partial", "w") as file:
            file.write(f"{self.steps} {self.trainer.strategy._push_metrics.accepted}")
        os.replace(path + ".partial", path)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def accuracy(model: Soaked) -> float:
    x, y, _ = blobs(4000, seed=1).tensors
    with torch.no_grad():
        return (model.net(x).argmax(1) == y).float().mean().item()


def train(directory, monkeypatch, disturb: bool):
    os.makedirs(directory, exist_ok=True)
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    killed = []
    done = threading.Event()

    def inject() -> None:
        chaos = random.Random(7)
        start = time.monotonic()
        while not done.wait(chaos.uniform(20, 40)):
            # learner 0 too, while its restart can come before the others stop (only learner 0 brings the results)
            first = 0 if time.monotonic() - start < MINUTES * 60 - 60 else 1
            path = os.path.join(directory, f"learner{chaos.randint(first, 3)}")
            if os.path.exists(path):
                pid = int(open(path).read())
                _signal(pid, signal.SIGKILL)
                killed.append(pid)

    if disturb:
        threading.Thread(target=inject, daemon=True).start()
    model = Soaked(directory)
    strategy = RudraStrategy(protocol="async", start_method=START, rpc_timeout=10, min_learners=2, max_restarts=1000)
    data = torch.utils.data.DataLoader(blobs(2048, seed=0), batch_size=16, shuffle=True)
    trainer = quiet_trainer(strategy, 4, max_time={"minutes": MINUTES}, max_epochs=-1)
    try:
        trainer.fit(model, data)
    finally:
        done.set()
    return strategy.stats, model, killed


def test_four_learners_killed_and_restarted_for_minutes(tmp_path, monkeypatch):
    with pytest.warns(UserWarning, match="Restarting it in"):
        stats, model, killed = train(tmp_path / "disturbed", monkeypatch, disturb=True)
    _, quiet, _ = train(tmp_path / "quiet", monkeypatch, disturb=False)
    directory = tmp_path / "disturbed"
    # the last count of each process (a kill between the write and the rename leaves a .partial beside it)
    counts = [[int(c) for c in path.read_text().split()] for path in directory.glob("counts*-*[0-9]")]
    pushed, accepted = sum(c[0] for c in counts), sum(c[1] for c in counts)
    applied = sum(stats.staleness.values())
    rejoined = [e for e in stats.events if e["event"] == "rejoined"]
    print(
        f"killed {len(killed)}, rejoined {len(rejoined)}, pushed {pushed}, received {stats.gradients}, dropped "
        f"{stats.dropped}, applied {applied}, accuracy {accuracy(model):.4f} (undisturbed {accuracy(quiet):.4f})"
    )  # with -s
    assert len(killed) >= MINUTES * 60 / 40 - 1 and len(rejoined) >= len(killed) - 1
    assert pushed <= stats.gradients <= pushed + len(killed)  # at most one push in flight per kill
    assert applied == stats.gradients - stats.dropped - stats.rejected and stats.rejected == 0
    assert accepted <= applied <= accepted + len(killed)
    trained = defaultdict(list)
    for path in directory.glob("ids*-*"):
        for line in path.read_text().splitlines():
            epoch, *ids = map(int, line.split())
            trained[epoch] += ids
    whole = sorted(trained)[:-1]  # the last epoch was cut by max_time
    assert len(whole) >= 3
    counts = {epoch: torch.bincount(torch.tensor(ids), minlength=2048) for epoch, ids in trained.items()}
    for epoch in whole[:-1]:
        # a lost learner's batches are dealt again in their epoch, or, if the others had drained it, in the next
        missing = counts[epoch] == 0
        assert (counts[epoch + 1][missing] >= 2).all(), f"epoch {epoch}: samples never trained"
    assert torch.isfinite(flat(model.parameters())).all()
    assert abs(accuracy(model) - accuracy(quiet)) <= 0.01
