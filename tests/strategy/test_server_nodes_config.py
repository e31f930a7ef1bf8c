"""Server nodes (``RudraStrategy(server_nodes=K)``) as the Trainer builds them, in this process: the argument's and
the job's checks, each with a message that names the value and what to do, the launcher a node gets, where the
servers go per stage, a server node's stages other than fit, a second fit refused, and a server node whose learners
never come ending with an error within rpc_timeout (the one test here that starts a process: the server)."""

import time

import pytest
from pytorch_lightning.strategies.launchers import _SubprocessScriptLauncher

from lightning_rudra import RudraStrategy
from lightning_rudra.strategy.server_nodes import ServerNodeLauncher, servers_started_by
from lightning_rudra.transport.rpc_world import free_port
from tests.lightning_models import Regression, loader, quiet_trainer


def build(strategy, node_rank=0, num_nodes=1, devices=2, port="29511", monkeypatch=None, **kwargs):
    monkeypatch.setenv("NODE_RANK", str(node_rank))
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    if port is None:
        monkeypatch.delenv("MASTER_PORT", raising=False)
    else:
        monkeypatch.setenv("MASTER_PORT", port)
    return quiet_trainer(strategy, devices, num_nodes=num_nodes, **kwargs)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(server_nodes=-1), r"server_nodes=-1 is not valid: expected an integer >= 0"),
        (dict(server_nodes="1"), r"server_nodes='1' is not valid"),
        (dict(server_nodes=True), r"server_nodes=True is not valid"),
        (dict(server_nodes=1, min_learners=1), r"server_nodes=1 cannot be used with min_learners=1.*Leave min_learn"),
        (dict(server_nodes=1, simulate=4), r"server_nodes=1 has no meaning with simulate=4.*Leave server_nodes at 0"),
    ],
)
def test_bad_server_nodes_arguments_are_refused_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RudraStrategy(**kwargs)


@pytest.mark.parametrize(
    "node_rank, kwargs, port, message",
    [
        (
            2,
            {},
            "29511",
            r"NODE_RANK=2 is outside this job of num_nodes=1 learner nodes and server_nodes=1: expected 0 "
            r"to 0 for a learner node, 1 to 1 for a server node",
        ),
        (1, dict(num_servers=1), "29511", r"num_servers=1 is fewer than server_nodes=2.*Set num_servers >= 2"),
        (1, {}, None, r"server_nodes=1 needs MASTER_PORT set on every node"),
    ],
)
def test_a_node_of_a_job_with_server_nodes_is_checked_when_the_trainer_is_built(
    monkeypatch, node_rank, kwargs, port, message
):
    nodes = 2 if "num_servers" in kwargs else 1
    with pytest.raises(ValueError, match=message):
        build(
            RudraStrategy(protocol="hardsync", server_nodes=nodes, **kwargs),
            node_rank,
            port=port,
            monkeypatch=monkeypatch,
        )


def test_torchrun_is_refused_with_server_nodes(monkeypatch):
    for variable, value in dict(
        TORCHELASTIC_RUN_ID="x", RANK="0", GROUP_RANK="0", LOCAL_RANK="0", LOCAL_WORLD_SIZE="2", WORLD_SIZE="2"
    ).items():
        monkeypatch.setenv(variable, value)
    with pytest.raises(ValueError, match=r"needs Lightning's own launcher .* not TorchElasticEnvironment"):
        build(RudraStrategy(protocol="hardsync", server_nodes=1), monkeypatch=monkeypatch)


def test_learner_nodes_keep_their_launcher_server_nodes_get_their_own_and_aggregate_by_default(monkeypatch):
    learner = build(RudraStrategy(protocol="hardsync", server_nodes=1), 0, monkeypatch=monkeypatch).strategy
    assert isinstance(learner._launcher, _SubprocessScriptLauncher) and learner.num_learners == 2
    assert learner._aggregating  # 2 learners on node 0, every server elsewhere: one push per node
    server = build(RudraStrategy(protocol="hardsync", server_nodes=2), 2, monkeypatch=monkeypatch).strategy
    assert isinstance(server._launcher, ServerNodeLauncher) and server._launcher.node == 1
    assert not server.is_global_zero


def test_fit_puts_every_server_on_the_server_nodes_and_other_stages_one_on_node_0():
    assert servers_started_by(None, 2, 2) == [0, 2]  # without server nodes: one per learner node, as before
    assert servers_started_by(None, 1, 2, server_nodes=2) == [None, None]
    assert servers_started_by(3, 1, 2, server_nodes=2) == [None, None, None]
    assert servers_started_by(3, 1, 2, server_nodes=2, fitting=False) == [0]


def test_a_server_nodes_other_stages_return_at_once(monkeypatch):
    trainer = build(RudraStrategy(protocol="hardsync", server_nodes=1), 1, monkeypatch=monkeypatch)
    started = time.monotonic()
    assert trainer.validate(Regression(), loader(8)) is None
    assert trainer.test(Regression(), loader(8)) is None
    assert time.monotonic() - started < 5 and trainer.state.status.value == "finished"


@pytest.mark.slow
@pytest.mark.timeout(60)
def test_a_server_node_whose_learners_never_come_ends_with_an_error_within_rpc_timeout(monkeypatch):
    """Its server waits for learner 0's store at most rpc_timeout (2 s here), then fit raises, naming the rendezvous
    and what to check; no server process is left."""
    port = free_port()
    trainer = build(
        RudraStrategy(protocol="hardsync", server_nodes=1, rpc_timeout=2),
        1,
        port=str(port),
        monkeypatch=monkeypatch,
    )
    launcher = trainer.strategy._launcher
    started = time.monotonic()
    with pytest.raises(
        RuntimeError,
        match=rf"server node 0 \(NODE_RANK 1\): parameter server 0 ended with exit code "
        rf"2: learner 0 never opened the rendezvous at 127.0.0.1:{port} within rpc_timeout \(2 s\)",
    ):
        trainer.fit(Regression(), loader(8))
    assert time.monotonic() - started < 30
    assert launcher.processes == []
