"""Lost learners that come back (``RudraStrategy(min_learners=k, max_restarts=r)``), with real processes:

| fault, mid-run                           | protocol   | expected                                                  |
| ---------------------------------------- | ---------- | --------------------------------------------------------- |
| learner 1 killed (kill -9), restarted    | async      | it rejoins and trains again; every sample of every epoch  |
|                                          |            | trained; stats.events: lost, then rejoined                |
| the same                                 | 2-softsync | the same                                                  |
| the same                                 | hardsync   | exactly SGD on the batches each round took                |
| popen: learner 1 killed, restarted       | async      | it rejoins; stats.events: lost, then rejoined             |
| popen: learner 1 killed, no restart;     | async      | one with another module is refused, saying what differs;  |
| processes started by hand for it         |            | the right one joins; one more, for a rank alive, refused  |
| learner 0 killed, restarted (spawn)      | async      | it rejoins the server that outlived it; results come back |
| torchrun: learner 1 killed; the agent    | async      | the server awaits both; both new processes rejoin; every  |
| ends learner 0 and restarts both         |            | sample of every epoch trained; the server ends after      |
| SLURM's variables: learner 1 dies; the   | async      | it joins and trains                                       |
| same script started again for its rank   |            |                                                           |

Each learner appends ``<pid> <epoch> <clock> <sample ids>`` for every batch it trains on to ``<dir>/ids<rank>``.
"""

import json
import os
import signal
import subprocess
import sys
import time
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from lightning_rudra import RudraStrategy
from lightning_rudra.transport.rpc_world import free_port
from tests.lightning_models import START, Regression, flat, quiet_trainer, regression_data
from tests.server_processes import still_running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

EPOCHS = 8  # learner 1 is lost in epoch 1 and rejoins some epochs later (epoch 2 or 3), more on a busy machine


class Recorded(Regression):
    """Learner ``killed``'s first process kills itself at its fifth batch of epoch 1, before training on it; the
    process that takes its place does not (``<dir>/killed`` exists by then)."""

    def __init__(self, directory: str, lr: float = 0.01, momentum: float = 0.9, killed: int = 1) -> None:
        super().__init__(lr=lr, momentum=momentum)
        self.directory = directory
        self.killed = killed

    def training_step(self, batch, batch_idx):
        x, y, ids = batch
        marker = os.path.join(self.directory, "killed")
        if (
            self.global_rank == self.killed
            and self.trainer.current_epoch == 1
            and batch_idx == 4
            and not os.path.exists(marker)
        ):
            open(marker, "w").close()
            os.kill(os.getpid(), signal.SIGKILL)
        # the survivor is the slower: it seldom drains the epoch before the server sees the loss (about 1 s), so
        # what the lost learner held is mostly dealt again in its own epoch, not the next (both are checked)
        time.sleep(0.02 if self.global_rank == self.killed else 0.04)
        clock = self.trainer.strategy._training.learner.client.timestamp  # the weights this gradient comes from
        with open(os.path.join(self.directory, f"ids{self.global_rank}"), "a") as file:
            file.write(f"{os.getpid()} {self.trainer.current_epoch} {clock} {' '.join(map(str, ids.tolist()))}\n")
        return super().training_step((x, y), batch_idx)


def fit(tmp_path, monkeypatch, protocol: str, n: int = 1, momentum: float = 0.9, killed: int = 1):
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    x, y = regression_data().tensors
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y, torch.arange(len(x))), batch_size=8)
    strategy = RudraStrategy(
        protocol=protocol, n=n, start_method=START, rpc_timeout=5.0, min_learners=1, max_restarts=1
    )
    model = Recorded(str(tmp_path), momentum=momentum, killed=killed)
    # validation every epoch: its collectives (a barrier, a value logged with sync_dist) meet after the rejoin too
    validation = torch.utils.data.DataLoader(regression_data(32, seed=3), batch_size=8)
    with pytest.warns(
        UserWarning, match=rf"learner {killed}'s process ended with signal SIGKILL .*Restarting it in 1 s"
    ):
        quiet_trainer(strategy, 2, max_epochs=EPOCHS).fit(model, data, validation)
    records = []  # (rank, pid, epoch, clock, ids)
    for rank in (0, 1):
        for line in (tmp_path / f"ids{rank}").read_text().splitlines():
            pid, epoch, clock, *ids = map(int, line.split())
            records.append((rank, pid, epoch, clock, ids))
    return strategy.stats, model, records, len(x)


def check_rejoined(stats, records, num_samples, shared=True, killed=1):
    """Learner ``killed`` was lost once and rejoined once; its new process trained after; every sample was trained
    in every epoch (with static shards: in every epoch that both learners started); nobody is left lost."""
    events = [(killed, "lost"), (killed, "rejoined")]
    assert [(e["learner"], e["event"]) for e in stats.events] == events, stats.events
    assert stats.lost == {}
    assert "ended before training did" in stats.events[0]["why"]
    pids = sorted({pid for rank, pid, *_ in records if rank == killed})
    assert len(pids) == 2, pids  # the first process and the one that took its place
    first = min(pids, key=lambda pid: min(e for r, p, e, *_ in records if p == pid))
    later = [epoch for rank, pid, epoch, *_ in records if rank == killed and pid != first]
    assert later and min(later) >= 2  # admitted at the start of an epoch after the loss, and trained there
    trained = defaultdict(list)
    for _, _, epoch, _, ids in records:
        trained[epoch] += ids
    if shared:
        assert_every_sample_trained(trained, num_samples, EPOCHS)
    else:  # a static shard is not trained from the loss until the learner that takes its place starts an epoch
        for epoch in [0, *range(min(later), EPOCHS)]:
            counts = torch.bincount(torch.tensor(trained[epoch]), minlength=num_samples)
            assert counts.min().item() >= 1, f"epoch {epoch}: samples never trained"


def assert_every_sample_trained(trained: dict, num_samples: int, epochs: int) -> None:
    """Under the shared epoch every sample of every epoch is trained: in its epoch, or, held by a learner lost after
    the others had drained that epoch (docs/faults.md), dealt again in the next one, where it is trained twice."""
    assert sorted(trained) == list(range(epochs))
    counts = [torch.bincount(torch.tensor(trained[epoch]), minlength=num_samples) for epoch in range(epochs)]
    for epoch in range(epochs):
        missing = counts[epoch] == 0
        assert epoch + 1 < epochs or not missing.any(), f"epoch {epoch}: samples never trained"
        assert (counts[min(epoch + 1, epochs - 1)][missing] >= 2).all(), f"epoch {epoch}: samples never trained"


@pytest.mark.parametrize("protocol, n, killed", [("async", 1, 1), ("softsync", 2, 1), ("async", 1, 0)])
def test_a_killed_learner_is_restarted_and_rejoins(tmp_path, monkeypatch, protocol, n, killed):
    """Learner 0 too: the server outlives the process that started it, and learner 0's new process brings the
    results back."""
    stats, model, records, num_samples = fit(tmp_path, monkeypatch, protocol, n, killed=killed)
    check_rejoined(stats, records, num_samples, killed=killed)
    # without a straggler's loss every epoch's batches are dealt once: at most those dealt again come twice
    assert sum(stats.batches.values()) == EPOCHS * 32 + stats.redealt
    assert torch.isfinite(flat(model.parameters())).all()


def test_under_hardsync_a_rejoined_learner_counts_from_an_epochs_start_exactly(tmp_path, monkeypatch):
    stats, model, records, num_samples = fit(tmp_path, monkeypatch, "hardsync", momentum=0.0)
    check_rejoined(stats, records, num_samples, shared=False)
    # SGD whose step at clock c averages the gradients of the batches computed from clock c's weights
    rounds = defaultdict(list)
    for _, _, _, clock, ids in records:
        rounds[clock].append(ids)
    assert stats.clock == len(rounds) == max(rounds) + 1
    x, y = regression_data().tensors
    expected = Regression(lr=0.01, momentum=0.0)
    optimizer = torch.optim.SGD(expected.parameters(), lr=0.01)
    for clock in range(len(rounds)):
        optimizer.zero_grad()
        grads = []
        for ids in rounds[clock]:
            expected.zero_grad()
            expected.loss((x[ids], y[ids])).backward()
            grads.append([p.grad.clone() for p in expected.parameters()])
        for p, *gs in zip(expected.parameters(), *grads):
            p.grad = torch.stack(gs).mean(0)
        optimizer.step()
    assert {len(batches) for batches in rounds.values()} == {1, 2}  # rounds alone and rounds with both
    torch.testing.assert_close(flat(model.parameters()), flat(expected.parameters()), rtol=0, atol=1e-5)


ROOT = Path(__file__).resolve().parents[2]  # the repository
SCRIPT = str(ROOT / "tests" / "scripts" / "rejoin_fit.py")


def popen_run(tmp_path, max_restarts: int, epochs: int, port: int) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
    with open(tmp_path / "run.out", "w") as out, open(tmp_path / "run.err", "w") as err:
        return subprocess.Popen(
            [sys.executable, SCRIPT, str(tmp_path), str(max_restarts), str(epochs)],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=err,
        )


def result(tmp_path, run: subprocess.Popen) -> dict:
    assert run.wait(timeout=200) == 0, (tmp_path / "run.err").read_text()[-3000:]
    [line] = [line for line in (tmp_path / "run.out").read_text().splitlines() if line.startswith("RESULT ")]
    found = json.loads(line[len("RESULT ") :])
    assert still_running(found["children"]) == []
    return found


def wait_for(condition, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"waited {timeout:g} s for {what}"
        time.sleep(0.2)


def events(found: dict) -> list[tuple[int, str]]:
    return [(e["learner"], e["event"]) for e in found["stats"]["events"]]


def learner_1_pids(tmp_path) -> list[str]:
    """Learner 1's processes that trained, in order, each once."""
    path = tmp_path / "ids1"
    pids = [line.split()[0] for line in path.read_text().splitlines()] if path.exists() else []
    return list(dict.fromkeys(pids))


def test_popen_restarts_a_killed_learner_which_rejoins(tmp_path):
    run = popen_run(tmp_path, max_restarts=1, epochs=0, port=free_port())
    try:
        wait_for(lambda: len(learner_1_pids(tmp_path)) == 2, "learner 1's new process to train")
    finally:
        (tmp_path / "stop").touch()  # the run ends: learner 0 stops, and with it the shared epoch
    found = result(tmp_path, run)
    assert events(found) == [(1, "lost"), (1, "rejoined")] and found["stats"]["lost"] == {}
    assert "Restarting it in 1 s (restart 1 of 1)" in (tmp_path / "run.err").read_text()


def by_hand(tmp_path, port: int, width: int = 16) -> subprocess.CompletedProcess:
    """Learner 1's command and environment, as Lightning's launcher gives them, started from outside."""
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "NODE_RANK": "0",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "2",
    }
    command = [sys.executable, SCRIPT, str(tmp_path), "0", "0", str(width)]
    return subprocess.run(command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=200)


def test_a_process_started_by_hand_for_a_lost_learner_joins_and_a_wrong_one_is_refused(tmp_path):
    port = free_port()
    run = popen_run(tmp_path, max_restarts=0, epochs=0, port=port)
    try:
        wait_for((tmp_path / "killed").exists, "learner 1 to kill itself")
        wrong = by_hand(tmp_path, port, width=32)
        assert wrong.returncode != 0
        assert "learner 1 cannot rejoin: its module differs from the one this run trains: parameter " in wrong.stderr
        assert "'net.0.weight' has shape (32, 6), the run's (16, 6)" in wrong.stderr
        joined = subprocess.Popen  # the right process trains until the run stops: started, not waited for
        env = {**os.environ, "PYTHONPATH": str(ROOT), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        env |= {"NODE_RANK": "0", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
        with open(tmp_path / "joined.err", "w") as err:
            learner = joined([sys.executable, SCRIPT, str(tmp_path), "0", "0"], cwd=tmp_path, env=env, stderr=err)
        wait_for(lambda: str(learner.pid) in learner_1_pids(tmp_path), "the new learner 1 to train")
        second = by_hand(tmp_path, port)
        assert second.returncode != 0 and "learner 1 of the run at 127.0.0.1:" in second.stderr
        assert "is alive (process " in second.stderr
        (tmp_path / "stop").touch()
        assert learner.wait(timeout=120) == 0, (tmp_path / "joined.err").read_text()[-3000:]
        found = result(tmp_path, run)
    finally:
        (tmp_path / "stop").touch()
        run.kill()
    assert events(found) == [(1, "lost"), (1, "rejoined")] and found["stats"]["lost"] == {}


def test_torchrun_restarting_every_worker_rejoins_the_running_server(tmp_path):
    """torchrun's agent answers learner 1's death by ending learner 0 (SIGTERM) and starting both again: the
    server, in a session of its own, outlives them, awaits them back (torchrun's ``--max-restarts`` says they will
    come), and takes both new processes in where the run was. Every sample of every epoch is trained."""
    port = free_port()
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2"]
    command += ["--max-restarts", "1", "--monitor-interval", "0.5", "--master-addr", "127.0.0.1"]
    command += ["--master-port", str(port), SCRIPT, str(tmp_path), "0", "6"]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    with open(tmp_path / "run.out", "w") as out, open(tmp_path / "run.err", "w") as err:
        run = subprocess.Popen(command, cwd=tmp_path, env=env, stdout=out, stderr=err)
    wait_for(lambda: servers_in(tmp_path), "the server to start")  # so that its end below means something
    found = result(tmp_path, run)
    assert sorted(events(found)) == [(0, "lost"), (0, "rejoined"), (1, "lost"), (1, "rejoined")], events(found)
    assert found["stats"]["lost"] == {}
    assert "(SIGTERMException" in next(e["why"] for e in found["stats"]["events"] if e["learner"] == 0)
    trained = defaultdict(list)
    for rank in (0, 1):
        for line in (tmp_path / f"ids{rank}").read_text().splitlines():
            _, epoch, *ids = map(int, line.split())
            trained[epoch] += ids
    assert_every_sample_trained(trained, 256, 6)
    wait_for(lambda: not servers_in(tmp_path), "the server to end")


def servers_in(directory: Path) -> list[int]:
    """Server processes started from ``directory`` (under torchrun they meet on a port of their own)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            command = Path(f"/proc/{entry}/cmdline").read_bytes()
            if b"lightning_rudra.server.process" in command and os.readlink(f"/proc/{entry}/cwd") == str(directory):
                found.append(int(entry))
        except OSError:  # ended meanwhile
            pass
    return found


def test_under_slurm_a_task_started_again_for_a_lost_learner_joins(tmp_path):
    """docs/rejoin.md's SLURM recipe on one host: srun's variables for two tasks; learner 1 dies; the same script
    with learner 1's SLURM_PROCID and SLURM_LOCALID (as ``srun --overlap`` would start it) joins the run."""
    base = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("SLURM_") and key not in ("MASTER_ADDR", "NODE_RANK", "WORLD_SIZE", "LOCAL_RANK")
    }
    base |= {"PYTHONPATH": str(ROOT), "MASTER_PORT": str(free_port()), "SLURM_NTASKS": "2", "SLURM_NNODES": "1"}
    base |= {"SLURM_NTASKS_PER_NODE": "2", "SLURM_NODEID": "0", "SLURM_JOB_ID": "4243", "SLURM_NODELIST": "127.0.0.1"}
    base |= {"SLURM_JOB_NAME": "rudra-test"}

    def task(rank: int, name: str) -> subprocess.Popen:
        with open(tmp_path / f"{name}.out", "w") as out, open(tmp_path / f"{name}.err", "w") as err:
            env = {**base, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)}
            return subprocess.Popen(
                [sys.executable, SCRIPT, str(tmp_path), "0", "0"], cwd=tmp_path, env=env, stdout=out, stderr=err
            )

    tasks = [task(0, "run"), task(1, "first")]
    try:
        wait_for((tmp_path / "killed").exists, "learner 1 to kill itself")
        assert tasks[1].wait(timeout=60) == -signal.SIGKILL
        tasks.append(task(1, "again"))
        wait_for(lambda: str(tasks[2].pid) in learner_1_pids(tmp_path), "the new learner 1 to train")
        (tmp_path / "stop").touch()
        assert tasks[2].wait(timeout=120) == 0, (tmp_path / "again.err").read_text()[-3000:]
        found = result(tmp_path, tasks[0])
    finally:
        (tmp_path / "stop").touch()
        for process in tasks:
            process.kill()
    assert events(found) == [(1, "lost"), (1, "rejoined")] and found["stats"]["lost"] == {}
