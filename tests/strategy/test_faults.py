"""Faults injected into a real run (2 learners forked, a real server process), read as a table:

| fault, mid-run                         | min_learners | protocol | expected                                     |
| -------------------------------------- | ------------ | -------- | -------------------------------------------- |
| kill -9 of the server                  | -            | async    | every learner ends with an error naming it   |
|   then fit(ckpt_path=last.ckpt)        | -            | async    | resumes from the last periodic checkpoint    |
| kill -9 of server 1 of num_servers=2   | -            | async    | every learner ends with an error naming it   |
| kill -9 of learner 1                   | -            | async    | the run ends (the launcher names learner 1)  |
| kill -9 of learner 0 (runs the server) | 1            | async    | the run ends; the orphaned server exits      |
| SIGSTOP of learner 1 past rpc_timeout  | -            | async    | the run ends with an error naming learner 1  |
| kill -9 of learner 1                   | 1            | async    | learner 0 trains on; stats.lost names 1      |
|   learner 1 kills itself mid-epoch     | 1            | async    | its batches dealt again: every sample trained |
| kill -9 of learner 1                   | 2            | async    | the run ends: fewer than min_learners left   |
| learner 1 exits in validate/test/predict | 1          | async    | learner 0 finishes the stage alone           |
| learner 1 exits in its setup hook      | 1            | async    | learner 0 trains every batch alone           |
| learner 0 exits before it registers    | 1            | async    | learner 1 ends naming it; the server ends    |
| SIGSTOP of learner 1 past rpc_timeout  | 1            | softsync | learner 0 trains on (c = 1); 1 is ended      |
| an exception in learner 1's step       | 1            | hardsync | exactly SGD on the batches left              |
| the same, 3 learners, then validation  | 2            | hardsync | a metric synced over learners 0 and 2        |
| popen: learner 1 exits, or stops       | 1            | hardsync | exactly SGD on the batches left; 1 is ended  |
| SLURM's processes: learner 1 exits     | 1            | hardsync | exactly SGD on the batches left              |

Each asserts the outcome, that survivors trained, and that no process it signalled or launched is left. (Without
min_learners, a learner that raises or exits: test_strategy.py; a host cut off: test_hosts.py; the server's side,
in-process: test_lost_learners.py.)
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

from typing import Any, Optional

import pytest
import torch
from pytorch_lightning.callbacks import ModelCheckpoint
from torch.multiprocessing.spawn import ProcessExitedException

from lightning_rudra import LearnerLostError, RudraStrategy, ServerLostError
from lightning_rudra.transport.rpc_world import free_port
from tests.lightning_models import (
    START,
    FailingLearner,
    MeteredFailing,
    Regression,
    flat,
    loader,
    quiet_trainer,
    regression_data,
    sgd_after_a_loss,
)
from tests.script_runs import printed_result, run_script
from tests.server_processes import running, server_pids, still_running

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

TIMEOUT = 5.0  # rpc_timeout of these runs


class Marked(Regression):
    """Each learner writes its pid to ``<dir>/learner<rank>`` when training starts, then steps slowly."""

    def __init__(self, directory: str) -> None:
        super().__init__(lr=0.01)
        self.directory = directory

    def on_train_start(self) -> None:
        with open(os.path.join(self.directory, f"learner{self.global_rank}"), "w") as file:
            file.write(str(os.getpid()))

    def training_step(self, batch, batch_idx):
        time.sleep(0.02)
        return super().training_step(batch, batch_idx)

    def on_train_end(self) -> None:
        with open(os.path.join(self.directory, f"finished{self.global_rank}"), "w") as file:
            file.write(str(self.trainer.current_epoch))


def pid_of(tmp_path, who: str, port: int) -> int:
    for _ in range(600):  # bounded: 120 s
        if who.startswith("server") and server_pids(port, int(who[6:] or 0)):
            return server_pids(port, int(who[6:] or 0))[0]
        marker = tmp_path / who
        if who != "server" and marker.exists() and marker.read_text():
            return int(marker.read_text())
        time.sleep(0.2)
    raise AssertionError(f"{who} never started")


def run_with_fault(
    tmp_path,
    monkeypatch,
    who: str,
    signum: int,
    protocol: str = "async",
    min_learners: Optional[int] = None,
    max_epochs: int = 1000,
    num_servers: Optional[int] = None,
    caught: Optional[list[BaseException]] = None,
    **trainer_options: Any,
) -> tuple[Optional[str], list[int], Marked, Any]:
    """Fit; once both learners train, send ``signum`` to ``who`` (``learner<r>``, ``server``, ``server<s>``: server
    process s of ``num_servers``). Returns the error's text (None: fit ended well; ``caught`` gets the error),
    the pids that were still alive a while after the fit ended (stopped ones are let go first), the model and the
    server's statistics."""
    port = free_port()
    monkeypatch.setenv("MASTER_PORT", str(port))
    signalled: list[int] = []

    failures: list[BaseException] = []

    def inject() -> None:
        learners: list[int] = []
        try:
            learners += [pid_of(tmp_path, "learner0", port), pid_of(tmp_path, "learner1", port)]
            time.sleep(1.0)  # some steps first
            target = pid_of(tmp_path, who, port)
        except BaseException as failure:  # end the run instead of letting it train on: the test fails below
            failures.append(failure)
            for pid in learners:
                _signal(pid, signal.SIGKILL)
            raise
        signalled.append(target)
        os.kill(target, signum)

    injector = threading.Thread(target=inject, daemon=True)
    injector.start()
    strategy = RudraStrategy(
        protocol=protocol, start_method=START, rpc_timeout=TIMEOUT, min_learners=min_learners, num_servers=num_servers
    )
    model = Marked(str(tmp_path))
    error = None
    try:
        quiet_trainer(strategy, 2, max_epochs=max_epochs, **trainer_options).fit(model, loader(8))
    except Exception as raised:
        error = str(raised)
        if caught is not None:
            caught.append(raised)
    injector.join(timeout=10)
    assert not failures, failures
    pids = [pid_of(tmp_path, f"learner{rank}", port) for rank in range(2)]
    for pid in signalled:  # a stopped process cannot even die until it runs again
        _signal(pid, signal.SIGCONT)
    for _ in range(40):  # the server notices within about a second that its parent or its learners are gone
        alive = [pid for pid in pids if running(pid)] + server_pids(port)
        if not alive:
            break
        time.sleep(0.25)
    return error, alive, model, strategy.stats


def trained(model: Regression) -> bool:
    x, y = regression_data().tensors
    with torch.no_grad():
        return model.loss((x, y)).item() < 0.5 * Regression().loss((x, y)).item()


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:
        pass


def test_a_killed_server_ends_every_learner_with_an_error_that_names_it(tmp_path, monkeypatch):
    caught: list[BaseException] = []
    error, alive, _, _ = run_with_fault(tmp_path, monkeypatch, "server", signal.SIGKILL, caught=caught)
    assert error is not None and "the parameter server (on 127.0.0.1) is gone: its connection closed" in error, error
    assert alive == []
    assert isinstance(caught[0], ServerLostError), repr(caught[0])  # what the user catches around fit


def test_with_min_learners_a_killed_server_still_ends_the_run_with_server_lost_error(tmp_path, monkeypatch):
    """The learners outlive one another with min_learners, not their server: learner 0's error is the run's, with
    its class (the class a learner raised crosses the launcher with min_learners too)."""
    caught: list[BaseException] = []
    with pytest.warns(UserWarning) as warned:
        error, alive, _, _ = run_with_fault(
            tmp_path, monkeypatch, "server", signal.SIGKILL, min_learners=1, caught=caught
        )
    lost = sorted(str(w.message).split("'s process ended")[0] for w in warned if "'s process ended" in str(w.message))
    assert lost == ["lightning_rudra: learner 0", "lightning_rudra: learner 1"], [str(w.message) for w in warned]
    assert error is not None and "the parameter server (on 127.0.0.1) is gone" in error, error
    assert alive == []
    assert isinstance(caught[0], ServerLostError), repr(caught[0])


def test_a_killed_second_server_ends_every_learner_with_an_error_that_names_it(tmp_path, monkeypatch):
    caught: list[BaseException] = []
    error, alive, _, _ = run_with_fault(tmp_path, monkeypatch, "server1", signal.SIGKILL, num_servers=2, caught=caught)
    assert error is not None and "parameter server 1 (on 127.0.0.1) is gone: its connection closed" in error, error
    assert alive == []
    assert isinstance(caught[0], ServerLostError), repr(caught[0])


def test_with_min_learners_a_killed_learner_0_leaves_the_others_training_to_the_end(tmp_path, monkeypatch):
    """The server outlives learner 0's process (its parent) and ends when learner 1 leaves; without a restart
    the results cannot come back to the calling process, and fit says so."""
    caught: list[BaseException] = []
    with pytest.warns(UserWarning, match=r"learner 0's process ended with signal SIGKILL \(min_learners=1"):
        error, alive, _, _ = run_with_fault(
            tmp_path, monkeypatch, "learner0", signal.SIGKILL, min_learners=1, max_epochs=8, caught=caught
        )
    assert error is not None and "learner 0's process ended with signal SIGKILL and was not restarted" in error, error
    assert isinstance(caught[0], LearnerLostError), repr(caught[0])
    assert (tmp_path / "finished1").read_text() == "8"  # learner 1 trained every epoch (the loop counts past the last)
    assert not (tmp_path / "finished0").exists()
    assert alive == []


@pytest.mark.parametrize("rank", [1, 0])
def test_a_killed_learner_ends_the_run_without_min_learners(tmp_path, monkeypatch, rank):
    """Learner 0 too: its server, orphaned, exits."""
    caught: list[BaseException] = []
    error, alive, _, _ = run_with_fault(tmp_path, monkeypatch, f"learner{rank}", signal.SIGKILL, caught=caught)
    assert error is not None and f"process {rank} terminated with signal SIGKILL" in error, error
    assert alive == []
    assert isinstance(caught[0], LearnerLostError) and isinstance(caught[0], ProcessExitedException), repr(caught[0])


def test_after_a_killed_server_training_resumes_from_the_last_periodic_checkpoint(tmp_path, monkeypatch):
    saves = tmp_path / "checkpoints"
    every = ModelCheckpoint(dirpath=saves, every_n_train_steps=10, save_last=True)
    error, alive, _, _ = run_with_fault(
        tmp_path, monkeypatch, "server", signal.SIGKILL, max_epochs=1000, enable_checkpointing=True, callbacks=[every]
    )
    assert error is not None and "the parameter server (on 127.0.0.1) is gone" in error and alive == []
    saved = torch.load(saves / "last.ckpt", weights_only=False)
    clock = saved["rudra"]["stats"]["clock"]
    assert clock > 0 and saved["optimizer_states"][0]["state"]  # the server's clock and momentum, mid-run
    trainer = quiet_trainer(
        RudraStrategy(protocol="async", start_method=START, rpc_timeout=TIMEOUT), 2, max_epochs=saved["epoch"] + 2
    )
    trainer.fit(Regression(lr=0.01), loader(8), ckpt_path=str(saves / "last.ckpt"))
    assert trainer.state.status == "finished"
    assert trainer.strategy.stats.clock > clock + 32  # went on from the saved clock, for at least an epoch


def test_a_learner_stalled_past_the_timeout_is_lost_and_the_run_ends_naming_it(tmp_path, monkeypatch):
    caught: list[BaseException] = []
    error, alive, _, _ = run_with_fault(tmp_path, monkeypatch, "learner1", signal.SIGSTOP, caught=caught)
    assert error is not None and "learner 1 (on 127.0.0.1) has not been heard from for more than 5 s" in error, error
    assert "with RudraStrategy(min_learners=k), training goes on" in error
    assert alive == []
    assert isinstance(caught[0], LearnerLostError), repr(caught[0])  # learner 0's error, with its class


def test_with_min_learners_a_killed_learner_is_lost_and_the_others_train_on(tmp_path, monkeypatch):
    epochs = 8
    with pytest.warns(
        UserWarning,
        match=r"learner 1's process ended with signal SIGKILL \(min_learners=1: training "
        "goes on while that many learners are left",
    ):
        error, alive, model, stats = run_with_fault(
            tmp_path, monkeypatch, "learner1", signal.SIGKILL, min_learners=1, max_epochs=epochs
        )
    assert error is None and alive == []
    assert list(stats.lost) == [1] and stats.lost[1].startswith("ended before training did: its process (pid ")
    assert sum(stats.batches.values()) == epochs * 32 + stats.redealt  # every batch of every epoch, and those again
    assert stats.batches[0] > stats.batches[1] and stats.clock == stats.gradients  # async: one update per gradient
    assert trained(model)


class Counted(Regression):
    """Each learner appends ``<epoch> <sample ids>`` of every batch it trains on to ``<dir>/ids<rank>``; learner 1
    kills itself (SIGKILL) at its fifth batch of epoch 1, before training on it: the batches it recorded are those
    it pushed (under async a push waits for its reply), and it holds a few more, drawn ahead."""

    def __init__(self, directory: str) -> None:
        super().__init__(lr=0.01)
        self.directory = directory

    def training_step(self, batch, batch_idx):
        x, y, ids = batch
        if self.global_rank == 1 and self.trainer.current_epoch == 1 and batch_idx == 4:
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(0.05 if self.global_rank == 0 else 0.02)  # learner 0 still has most of epoch 1 to go
        with open(os.path.join(self.directory, f"ids{self.global_rank}"), "a") as file:
            file.write(f"{self.trainer.current_epoch} {' '.join(map(str, ids.tolist()))}\n")
        return super().training_step((x, y), batch_idx)


def test_with_min_learners_a_killed_learners_batches_are_dealt_again_and_every_sample_is_trained(tmp_path, monkeypatch):
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    epochs, x, y = 3, *regression_data().tensors
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y, torch.arange(len(x))), batch_size=8)
    strategy = RudraStrategy(protocol="async", start_method=START, rpc_timeout=TIMEOUT, min_learners=1)
    with pytest.warns(UserWarning, match=r"learner 1's process ended with signal SIGKILL"):
        quiet_trainer(strategy, 2, max_epochs=epochs).fit(Counted(str(tmp_path)), data)
    trained = {epoch: [] for epoch in range(epochs)}
    for rank in (0, 1):
        for line in (tmp_path / f"ids{rank}").read_text().splitlines():
            epoch, *ids = map(int, line.split())
            trained[epoch] += ids
    stats = strategy.stats
    assert list(stats.lost) == [1] and stats.redealt >= 1
    assert sorted(trained[0]) == list(range(len(x)))  # no loss: each sample once
    # epoch 1's batches that learner 1 held are trained in epoch 1 (or, dealt again after learner 0 drained it,
    # in epoch 2): every sample at least once in each epoch, and no more than once besides those dealt again
    counts = torch.bincount(torch.tensor(trained[1] + trained[2]), minlength=len(x))
    assert counts.min().item() >= 2 and counts.sum().item() <= 2 * len(x) + 8 * stats.redealt
    assert sum(stats.batches.values()) == epochs * 32 + stats.redealt


def test_with_too_few_learners_left_the_run_ends_saying_so(tmp_path, monkeypatch):
    caught: list[BaseException] = []
    with (
        pytest.warns(UserWarning, match="learner 1's process ended with signal SIGKILL"),
        pytest.warns(UserWarning, match="learner 0's process ended with exit code 1"),  # it raised the server's error
    ):
        error, alive, _, _ = run_with_fault(
            tmp_path, monkeypatch, "learner1", signal.SIGKILL, min_learners=2, caught=caught
        )
    assert error is not None and "1 learner left, fewer than min_learners=2, so training cannot go on" in error, error
    assert alive == []
    assert isinstance(caught[0], LearnerLostError), repr(caught[0])


def test_with_min_learners_a_stalled_learner_is_lost_and_ended_once_training_is_over(tmp_path, monkeypatch):
    error, alive, model, stats = run_with_fault(
        tmp_path, monkeypatch, "learner1", signal.SIGSTOP, protocol="softsync", min_learners=1, max_epochs=16
    )
    assert error is None and alive == []
    assert list(stats.lost) == [1] and "has not been heard from for more than 5 s" in stats.lost[1]
    # c = 2 until the loss, then 1: every gradient learner 0 pushed alone made an update
    assert stats.gradients > stats.clock > stats.gradients // 2
    assert trained(model)


@pytest.mark.parametrize("protocol", ["hardsync"])
def test_with_min_learners_hardsync_goes_on_exactly_with_the_learners_left(protocol):
    epochs, mu = 2, 8
    model = FailingLearner("raise")  # learner 1 raises at its third batch, before pushing it
    trainer = quiet_trainer(
        RudraStrategy(protocol=protocol, start_method=START, rpc_timeout=30, min_learners=1), 2, max_epochs=epochs
    )
    with pytest.warns(
        UserWarning,
        match="(?s)learner 1's process ended with exit code 1 .*Its error:.*ValueError: learner 1 broke on purpose",
    ):
        trainer.fit(model, loader(mu))
    expected = sgd_after_a_loss(epochs, mu, learners=2, lost=1, lost_at=2)
    torch.testing.assert_close(flat(model.parameters()), expected, rtol=0, atol=1e-5)
    stats = trainer.strategy.stats
    assert stats.lost == {1: "stopped with an error (ValueError: learner 1 broke on purpose)"}
    assert stats.clock == epochs * 16 and stats.gradients == epochs * 16 + 2  # two rounds with both learners


# the server sees the process end, or learner 0's launcher tells it first: "... (exit code 7, as its launcher saw)"
@pytest.mark.parametrize(
    "how, why", [("exit", "ended before training did"), ("stop", "has not been heard from for more than 5 s")]
)
def test_popen_survives_a_lost_learner(tmp_path, how, why):
    """Lightning's popen launcher would end every learner; with min_learners the strategy's own lets learner 0 train
    on (hardsync: exactly SGD on the batches left) and ends a stalled learner once training is over."""
    done = run_script(tmp_path, "survive_fit.py", how, "2")
    result = printed_result(done.stdout)
    expected = sgd_after_a_loss(2, 8, learners=2, lost=1, lost_at=2)
    torch.testing.assert_close(torch.tensor(result["weights"]), expected, rtol=0, atol=1e-5)
    assert list(result["stats"]["lost"]) == ["1"] and why in result["stats"]["lost"]["1"]
    assert f"learner 1 (on 127.0.0.1) was lost: it {why}" in done.stderr  # the server says so as it happens
    if how == "exit":
        assert "learner 1's process ended with exit code 7" in done.stderr
    assert still_running(result["children"]) == []


def test_a_torchmetrics_metric_syncs_over_the_learners_left():
    """Learner 1 of 3 raises while training; at the epoch's end learners 0 and 2 validate their shards, and the
    synced metric covers exactly theirs."""
    model = MeteredFailing("raise")
    trainer = quiet_trainer(
        RudraStrategy(protocol="hardsync", start_method=START, rpc_timeout=30, min_learners=2), 3, max_epochs=1
    )
    with pytest.warns(UserWarning, match="learner 1's process ended with exit code 1"):
        trainer.fit(model, loader(8, num_samples=96), loader(16, num_samples=96, seed=3))
    x, y = regression_data(96, seed=3).tensors
    with torch.no_grad():
        left = torch.cat([torch.arange(0, 96, 3), torch.arange(2, 96, 3)])  # DistributedSampler's shards 0 and 2
        expected = torch.nn.functional.mse_loss(model.net(x[left]), y[left]).item()
        shard_0 = torch.nn.functional.mse_loss(model.net(x[0::3]), y[0::3]).item()
    assert trainer.callback_metrics["val_mse"].item() == pytest.approx(expected, rel=1e-5)
    assert shard_0 != pytest.approx(expected, rel=1e-3)
    assert list(trainer.strategy.stats.lost) == [1]


def test_under_slurm_the_learners_left_train_on(tmp_path):
    """Processes that srun started (its variables, one host): nobody ends learner 0 when learner 1 exits, and the
    server, seeing learner 1's process end, goes on without it."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
    base = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("SLURM_")
        and key not in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE", "LOCAL_RANK")
    }
    base.update(
        PYTHONPATH=root,
        MASTER_PORT=str(free_port()),
        SLURM_NTASKS="2",
        SLURM_NTASKS_PER_NODE="2",
        SLURM_NNODES="1",
        SLURM_NODEID="0",
        SLURM_JOB_ID="4242",
        SLURM_JOB_NAME="rudra-test",
        SLURM_NODELIST="127.0.0.1",
    )
    script = os.path.join(root, "tests", "scripts", "survive_fit.py")
    learners = [
        subprocess.Popen(
            [sys.executable, script, "exit", "2"],
            cwd=tmp_path,
            text=True,
            env={**base, "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for rank in range(2)
    ]
    try:
        outputs = [learner.communicate(timeout=200) for learner in learners]
    finally:
        for learner in learners:
            learner.kill()
    assert [learner.returncode for learner in learners] == [0, 7], outputs[0][1][-3000:]
    [line] = [line for line in outputs[0][0].splitlines() if line.startswith("RESULT ")]
    result = json.loads(line[len("RESULT ") :])
    expected = sgd_after_a_loss(2, 8, learners=2, lost=1, lost_at=2)
    torch.testing.assert_close(torch.tensor(result["weights"]), expected, rtol=0, atol=1e-5)
    assert list(result["stats"]["lost"]) == ["1"]


class LeavesEarly(Regression):
    """Learner ``rank`` exits (code 7) at ``where``: its ``setup`` hook, its ``configure_optimizers`` (before learner 0
    registers the model, if it is learner 0), or its first batch of ``validate``, ``test`` or ``predict``."""

    def __init__(self, where: str, rank: int = 1) -> None:
        super().__init__(lr=0.01)
        self.where, self.rank = where, rank

    def _exit_at(self, where: str) -> None:
        if self.where == where and self.global_rank == self.rank:
            os._exit(7)

    def setup(self, stage: str) -> None:
        self._exit_at("setup")

    def configure_optimizers(self):
        self._exit_at("configure_optimizers")
        return super().configure_optimizers()

    def validation_step(self, batch, batch_idx):
        self._exit_at("validate")
        return super().validation_step(batch, batch_idx)

    def test_step(self, batch, batch_idx):
        self._exit_at("test")
        self.log("test_loss", self.loss(batch), sync_dist=True)

    def predict_step(self, batch, batch_idx):
        self._exit_at("predict")
        return self.loss(batch)


@pytest.mark.parametrize("stage", ["test", "validate", "predict"])
def test_with_min_learners_a_learner_lost_outside_fit_leaves_the_others_to_finish_the_stage(monkeypatch, stage):
    """No model is registered outside fit: the learners left still meet at every collective (the dataloader's
    barrier, the epoch's synced values, the stage's last meeting) without the lost one."""
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    trainer = quiet_trainer(RudraStrategy(start_method=START, rpc_timeout=TIMEOUT, min_learners=1), 2)
    with pytest.warns(UserWarning, match=r"learner 1's process ended with exit code 7 \(min_learners=1"):
        result = getattr(trainer, stage)(LeavesEarly(stage), loader(8))
    x, y = regression_data().tensors
    with torch.no_grad():  # learner 0's shard (DistributedSampler's), alone: learner 1 logged nothing
        expected = Regression().loss((x[0::2], y[0::2])).item()
    assert trainer.state.status == "finished"  # learner 0's, brought back
    if stage != "predict":  # whose predictions a spawned learner does not bring back
        assert result[0][f"{'val' if stage == 'validate' else 'test'}_loss"] == pytest.approx(expected, rel=1e-5)


def test_with_min_learners_a_learner_lost_at_fits_setup_leaves_the_others_training(monkeypatch):
    """Lost in its ``setup`` hook, before the model is registered: learner 0 passes the setup barrier without it,
    and trains every batch of the shared epoch alone."""
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    strategy = RudraStrategy(start_method=START, rpc_timeout=TIMEOUT, min_learners=1)
    model = LeavesEarly("setup")
    with pytest.warns(UserWarning, match=r"learner 1's process ended with exit code 7 \(min_learners=1"):
        quiet_trainer(strategy, 2, max_epochs=2).fit(model, loader(8))
    assert list(strategy.stats.lost) == [1] and sum(strategy.stats.batches.values()) == 2 * 32
    assert trained(model)


def test_with_min_learners_learner_0_lost_before_it_registers_ends_the_others_saying_so(monkeypatch):
    """Only learner 0 hands over the model: lost first, the others cannot pull it, and end naming it."""
    port = free_port()
    monkeypatch.setenv("MASTER_PORT", str(port))
    strategy = RudraStrategy(start_method=START, rpc_timeout=TIMEOUT, min_learners=1)
    with (
        pytest.warns(UserWarning, match=r"learner 0's process ended with exit code 7"),
        pytest.warns(UserWarning, match=r"learner 0 \(on 127.0.0.1\) was lost before it registered the model"),
        pytest.raises(RuntimeError, match="learner 0's process ended with exit code 7") as lost,
    ):
        quiet_trainer(strategy, 2, max_epochs=2).fit(LeavesEarly("configure_optimizers", rank=0), loader(8))
    assert isinstance(lost.value, LearnerLostError)
    for _ in range(40):  # the server ends once learner 1 has left
        if not server_pids(port):
            break
        time.sleep(0.25)
    assert server_pids(port) == []
