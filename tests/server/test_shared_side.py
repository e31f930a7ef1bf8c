"""The server's files in /dev/shm (in-process): none is left once setting them up fails, whatever the error, nor
once no learner that mapped nothing yet is awaited any more (the last one that had not answered is lost)."""

import os

import pytest
import torch

from lightning_rudra.core.optimizers import OptimizerSpec
from lightning_rudra.core.protocol import ProtocolConfig
from lightning_rudra.core.registration import Registration
from lightning_rudra.server import process as server
from lightning_rudra.server.parameter_server import ParameterServer
from lightning_rudra.transport.shm import SHM_DIR
from tests.server.test_lost_learners import lose


def files_of_this_process() -> list[str]:
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(f"lightning_rudra-{os.getpid()}-"))


def shared_server(monkeypatch, learners: int, spec=None) -> ParameterServer:
    ps = ParameterServer(learners, timeout=5.0, min_learners=1)
    monkeypatch.setattr(server, "_server", ps)
    params = [torch.zeros(2)]
    spec = spec or OptimizerSpec.from_optimizer(torch.optim.SGD(params, lr=1.0), params)
    server.call("register", Registration(ProtocolConfig(learners, "async"), params, [], [spec], None, True))
    return ps


@pytest.fixture(autouse=True)
def no_files_before():
    assert files_of_this_process() == []
    yield
    for name in files_of_this_process():  # a failing test leaves none behind for the next
        os.unlink(os.path.join(SHM_DIR, name))


def test_no_file_is_left_when_the_server_cannot_be_built_in_shared_memory(monkeypatch):
    """The optimizer names a parameter the module lacks (an IndexError) after the weights' files were made."""
    made = []
    monkeypatch.setattr("lightning_rudra.transport.shm._create", record(made))
    with pytest.raises(IndexError):
        shared_server(monkeypatch, 2, OptimizerSpec(torch.optim.SGD, [([5], {"lr": 1.0})]))
    assert len(made) >= 2 and files_of_this_process() == []  # the header and the weights were made, and went


def record(made: list):
    from lightning_rudra.transport import shm

    create = shm._create

    def recorded(path, numel, dtype):
        made.append(path)
        return create(path, numel, dtype)

    return recorded


def test_the_files_go_once_the_last_learner_that_had_not_answered_is_lost(monkeypatch):
    ps = shared_server(monkeypatch, 3)
    assert len(files_of_this_process()) == 1 + 1 + 3  # header, weights, a gradient buffer per learner
    server.call("attached", 0, True)
    server.call("attached", 1, True)
    assert files_of_this_process() != []  # learner 2 may still map them
    lose(ps, 2)
    assert files_of_this_process() == []  # nobody is left to map them
    assert ps.shared.offer()[0] is None  # a process that rejoins for learner 2 uses RPC


def test_the_files_go_when_training_is_given_up_before_every_learner_answered(monkeypatch):
    ps = shared_server(monkeypatch, 2)
    ps.membership.min_learners = 2  # one loss is too many
    lose(ps, 1)
    assert ps.failure is not None and files_of_this_process() == []
