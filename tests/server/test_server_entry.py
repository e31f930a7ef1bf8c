"""Every call that reaches the server is checked before it changes anything (in-process: the functions the RPC
calls run, without RPC)."""

import inspect
from dataclasses import replace

import pytest
import torch

from lightning_rudra.server import process as server
from lightning_rudra.server.parameter_server import ParameterServer
from lightning_rudra.core.optimizers import OptimizerSpec
from lightning_rudra.core.protocol import ProtocolConfig
from lightning_rudra.core.registration import Registration
from lightning_rudra.core.update import Push


@pytest.fixture
def parameter_server(monkeypatch):
    ps = ParameterServer(2, timeout=5.0)
    monkeypatch.setattr(server, "_server", ps)
    params = [torch.zeros(3)]
    spec = OptimizerSpec.from_optimizer(torch.optim.SGD(params, lr=0.1), params)
    server.call("register", Registration(ProtocolConfig(2, "async"), params, [], [spec], None, False))
    return ps


def push(learner):
    return server.call_async("push", good_push(learner=learner))


def good_push(**fields):
    """A push the fixture's server takes, with ``fields`` in its place."""
    return replace(Push(0, 0, [torch.ones(3)], torch.ones(1, dtype=torch.bool), 0, [{"lr": 0.1}], []), **fields)


@pytest.mark.parametrize(
    "method, args, error, message",
    [
        ("_give_up", ("any reason",), ValueError, "'_give_up' is not a call the parameter server answers: expected"),
        ("lost", (), ValueError, "'lost' is not a call"),
        ("heartbeat", (2, "10.0.0.3"), ValueError, r"heartbeat from learner 2 refused: this run's learners are 0..1"),
        ("push", ("0",), ValueError, r"push from learner '0' refused"),
        ("leave", (), ValueError, r"leave from learner None refused"),
        # Python counts True as 1: refused as a learner, not taken for learner 1
        ("heartbeat", (True, "10.0.0.3"), ValueError, r"heartbeat from learner True refused: a learner is an int"),
        ("push", (good_push(learner=True),), ValueError, r"push from learner True refused: a learner is an int"),
        ("finish", (True,), ValueError, r"finish from learner True refused"),
        ("leave", (True,), ValueError, r"leave from learner True refused"),
        ("report", (True, 1, "exit code 1"), ValueError, r"report from learner True refused"),
        ("report", (0, True, "exit code 1"), ValueError, r"0 refused: it names learner True; a learner is an int"),
        ("report", (0, "1", "exit code 1"), ValueError, r"it names learner '1'; this run's learners are 0..1"),
    ],
)
def test_unknown_calls_and_learners_are_refused(parameter_server, method, args, error, message):
    heard = dict(parameter_server.membership.last_heard)
    with pytest.raises(error, match=message):
        server.call(method, *args)
    membership = parameter_server.membership
    assert membership.last_heard == heard and parameter_server.failure is None and not membership.left
    assert not membership.lost and not parameter_server.finished and parameter_server.core.stats.gradients == 0


def test_a_learner_that_left_or_was_lost_cannot_come_back(parameter_server):
    server.call_async("finish", 1)
    server.call("leave", 1)
    with pytest.raises(RuntimeError, match="push from learner 1 refused: it has left this run"):
        push(1)
    parameter_server.membership.lost[0] = "has not been heard from for more than 5 s"  # as watch() finds
    with pytest.raises(
        RuntimeError,
        match="heartbeat from learner 0 refused: it was counted as lost .it has not been "
        "heard from for more than 5 s.; a new process for it rejoins",
    ):
        server.call("heartbeat", 0, "10.0.0.2")
    assert parameter_server.core.clock == 0 and parameter_server.core.stats.gradients == 0


def test_a_push_after_finish_is_refused(parameter_server):
    push(0).wait()
    server.call_async("finish", 0)
    with pytest.raises(RuntimeError, match="push from learner 0 refused: it has finished training"):
        push(0)
    assert parameter_server.core.stats.gradients == 1


@pytest.mark.parametrize(
    "method, args, message",
    [
        ("heartbeat", (0, "10.0.0.2", None, "extra"), r"heartbeat refused: 4 arguments do not fit heartbeat\(learner"),
        # a learner of the version that pushed positional arguments
        ("push", (0, 0, [torch.ones(3)], torch.ones(1, dtype=torch.bool), 0, [{"lr": 0.1}], []), "push refused: 7"),
    ],
)
def test_a_call_with_more_arguments_than_its_method_takes_is_refused_naming_the_signature(
    parameter_server, method, args, message
):
    with pytest.raises(TypeError, match=message):
        server.call(method, *args)
    assert parameter_server.core.clock == 0 and parameter_server.core.stats.gradients == 0


def test_a_push_that_lacks_fields_is_refused_before_anything_reads_them(parameter_server):
    whole = Push(0, 0, [torch.ones(3)], torch.ones(1, dtype=torch.bool), 0, [{"lr": 0.1}], [])
    partial = object.__new__(Push)  # as unpickling a frame whose state leaves fields out makes it
    object.__setattr__(partial, "learner", 0)
    with pytest.raises(TypeError, match="push refused: its Push lacks fields"):
        server.call_async("push", partial)
    server.call_async("push", whole).wait()
    assert parameter_server.core.stats.gradients == 1


def test_every_entry_point_names_a_parameter_of_its_method(parameter_server):
    for method, name in server.ENTRY_POINTS.items():
        answer = server._HERE.get(method) or getattr(parameter_server, method)
        assert name is None or name in inspect.signature(answer).parameters, (method, name)


@pytest.mark.parametrize(
    "compression, count, push, error, message",
    [
        ("bf16", 0, good_push(timestamp=7), ValueError, "timestamp 7 from learner 0 is not valid"),
        ("bf16", 0, good_push(hparams=None), ValueError, "hparams=None from learner 0 is not valid"),
        ("zstd", 0, good_push(), ValueError, "push_deltas from learner 0 refused: compression='zstd' is not one"),
        ("bf16", -1, good_push(), ValueError, "push_deltas from learner 0 refused: count=-1 is not valid"),
        ("bf16", True, good_push(), ValueError, "push_deltas from learner 0 refused: count=True is not valid"),
    ],
)
def test_a_refused_push_with_weight_deltas_keeps_no_copy_of_the_learners_weights(
    parameter_server, compression, count, push, error, message
):
    """The server's copy of what each learner holds (for replies as differences) is made once a push is taken."""
    with pytest.raises(error, match=message):
        server.call_async("push_deltas", compression, count, push)
    assert parameter_server.weight_deltas == {} and parameter_server.core.stats.gradients == 0
    reply = server.call_async("push_deltas", "bf16", 0, good_push()).wait()
    assert reply.params.whole and list(parameter_server.weight_deltas["bf16"].held) == [0]


@pytest.mark.parametrize("protocol", ["hardsync", "batchsync", "softsync"])
def test_a_snapshot_counts_only_the_gradients_its_weights_hold(monkeypatch, protocol):
    """A resumed shared epoch goes on after as many batches as the checkpoint's gradients: one waiting in an open
    round is not in the weights, so its batch must be dealt again, not skipped."""
    ps = ParameterServer(2, timeout=5.0)
    monkeypatch.setattr(server, "_server", ps)
    params = [torch.zeros(3)]
    spec = OptimizerSpec.from_optimizer(torch.optim.SGD(params, lr=0.1), params)
    server.call("register", Registration(ProtocolConfig(2, protocol), params, [], [spec], None, False))
    assert all(reply.done() for reply in [push(0), push(1)])  # the first round: applied
    server.call_async("push", good_push(learner=0, timestamp=1))  # the next round, open
    snapshot = server.call("snapshot")
    assert (snapshot.clock, snapshot.stats.gradients, ps.core.stats.gradients) == (1, 2, 3)
    assert snapshot.stats.staleness == {0: 2} and snapshot.stats.optimizer_staleness == {0: {0: 2}}
    assert server.call_async("push", good_push(learner=1, timestamp=1)).done()
    assert server.call("snapshot").stats.gradients == 4
