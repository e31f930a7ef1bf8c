"""The errors a user can catch (``lightning_rudra.core.errors``): each is still the built-in it was, and keeps its
class and message where torch hands over only a name and a text. (Where each is raised: test_lost_learners.py,
test_strategy_config.py; what the user catches around fit: test_faults.py.)"""

import pytest

import lightning_rudra
from lightning_rudra import ConfigurationError, LearnerLostError, RudraError, ServerLostError
from lightning_rudra.core.errors import carried
from lightning_rudra.transport.stream import ServerError


@pytest.mark.parametrize(
    "error, builtin",
    [(LearnerLostError, RuntimeError), (ServerLostError, RuntimeError), (ConfigurationError, ValueError)],
)
def test_each_error_is_caught_as_the_builtin_it_was_and_as_a_rudra_error(error, builtin):
    with pytest.raises(builtin, match="^why$"):
        raise error("why")
    assert issubclass(error, RudraError) and error.__name__ in lightning_rudra.__all__


def test_an_error_raised_in_the_server_comes_back_with_its_class_and_the_message_torch_gave_it():
    # torch RPC's text for an exception a remote function raised, and a future's callback that raised
    for text in (
        "LearnerLostError: On WorkerInfo(id=1, name=server0):\nLearnerLostError('learner 1 ...')\nTraceback ...",
        "Got the following error when running the callback: LearnerLostError: learner 0 was lost before ...",
    ):
        error = carried(RuntimeError(text))
        assert type(error) is LearnerLostError and str(error) == text


def test_an_error_the_stream_carries_comes_back_with_its_class_and_its_own_message():
    # the message a RuntimeError had over the stream, also where the class is not brought back
    assert str(ServerError("LearnerLostError", "learner 1 was lost")) == "learner 1 was lost"
    error = carried(ServerError("LearnerLostError", "learner 1 was lost"))
    assert type(error) is LearnerLostError and str(error) == "learner 1 was lost"


@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("EOF: end of file"),
        RuntimeError("the parameter server holds no weights yet"),
        ServerError("ValueError", "push from learner 7 refused"),
        RuntimeError("On WorkerInfo(id=1): LearnerLostError: not at the start"),
    ],
)
def test_other_errors_carry_none(error):
    assert carried(error) is None
