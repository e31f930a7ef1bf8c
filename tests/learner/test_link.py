"""How a learner's pushes travel to one server (learner/link.py)."""

import pytest

from lightning_rudra.learner.client import LearnerClient
from lightning_rudra.learner.link import ServerLink


def _client(error: Exception) -> LearnerClient:
    client = LearnerClient.__new__(LearnerClient)  # no RPC world: only what the link reads
    client.rank, client.what, client.stream = 1, "the parameter server", None

    def open_stream() -> None:
        raise RuntimeError("learner 1 could not connect ... A firewall between the hosts ...") from error

    client.open_stream = open_stream  # type: ignore[method-assign]
    return client


def test_a_push_stream_that_cannot_open_on_the_server_s_host_leaves_the_pushes_to_rpc_with_a_warning():
    link = ServerLink(0, _client(TimeoutError("its handshake slots were taken")), [], [])
    link.shm = object()  # type: ignore[assignment]  # the server's shared memory is mapped: it is on this host
    with pytest.warns(UserWarning, match="learner 1 could not open its push stream .*handshake slots were taken.*RPC"):
        link._open_stream()
    assert link.client.stream is None


def test_a_push_stream_that_cannot_open_to_another_host_ends_the_run():
    link = ServerLink(0, _client(ConnectionRefusedError("refused")), [], [])  # no shared memory: another host
    with pytest.raises(RuntimeError, match="firewall"):
        link._open_stream()
