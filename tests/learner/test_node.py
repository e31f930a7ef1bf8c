"""A node member's check of the pushes in flight (:func:`lightning_rudra.learner.node.check_in_flight`), in-process."""

from types import SimpleNamespace

import pytest
from torch.futures import Future

from lightning_rudra import LearnerLostError
from lightning_rudra.learner.pushing import InFlight
from lightning_rudra.learner.node import check_in_flight
from lightning_rudra.transport.stream import ServerError


def failed(error: BaseException) -> InFlight:
    future: Future = Future()
    future.set_exception(error)
    return InFlight(SimpleNamespace(client=SimpleNamespace()), future, [])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("LearnerLostError: On WorkerInfo(id=0, name=server):\nlearner 1 has not been heard from"),
        ServerError("LearnerLostError", "learner 1 has not been heard from"),
    ],
    ids=["rpc", "stream"],
)
def test_a_learner_lost_on_the_server_reaches_a_node_member_as_learner_lost_error(error):
    with pytest.raises(LearnerLostError, match="learner 1 has not been heard from") as caught:
        check_in_flight([failed(error)])
    assert caught.value.__cause__ is error


def test_another_failure_of_a_push_in_flight_is_raised_as_it_came():
    error = RuntimeError("the stream to server 0 broke")
    with pytest.raises(RuntimeError) as caught:
        check_in_flight([failed(error)])
    assert caught.value is error
