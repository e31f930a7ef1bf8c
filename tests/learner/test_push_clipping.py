"""What a learner's push asks of the servers' clipping (:mod:`lightning_rudra.core.clipping`), in-process with
clients that keep what they are given: the norm of its gradient only where an update applies that gradient alone,
and only for a gradient the servers take (finite); a step's clippings travel with that step only."""

import pytest
import torch

from lightning_rudra.core.clipping import Clipping
from lightning_rudra.learner.learner import Learner


class Client:
    """A server's client that keeps the pushes' clippings and their ``finite``, and answers nothing."""

    def __init__(self) -> None:
        self.rank, self.timestamp = 0, 0
        self.pushed: list[tuple] = []

    def push(self, push):
        self.pushed.append((push.finite, push.clipping))


def two_servers(sends_norm: bool = True):
    module = torch.nn.Linear(2, 2)  # the weight on one server, the bias on the other
    learner = Learner(module, [Client(), Client()], overlap=True)  # overlap: the pushes stay in flight
    learner.sends_norm = sends_norm
    [optimizer] = learner.wrap([torch.optim.SGD(module.parameters(), lr=0.1)])
    return module, learner, optimizer


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_gradient_that_is_not_finite_is_pushed_without_a_norm_for_the_servers_to_refuse(bad):
    module, learner, optimizer = two_servers()
    module.weight.grad = torch.tensor([[bad, 1.0], [0.0, 0.0]])
    module.bias.grad = torch.zeros(2)
    learner.push(0, optimizer.local, (Clipping(0.5),))
    assert [c.pushed for c in learner.clients] == [[(False, (Clipping(0.5, "norm", (0, 1)),))]] * 2


def test_a_learner_sends_its_gradients_norm_only_where_an_update_applies_that_gradient_alone():
    for sends_norm, norm in [(True, 5.0), (False, None)]:  # async or softsync with c = 1; hardsync
        module, learner, optimizer = two_servers(sends_norm)
        module.weight.grad = torch.tensor([[3.0, 0.0], [0.0, 0.0]])
        module.bias.grad = torch.tensor([0.0, 4.0])
        learner.push(0, optimizer.local, (Clipping(0.5),))
        assert [c.pushed for c in learner.clients] == [[(True, (Clipping(0.5, "norm", (0, 1), norm),))]] * 2


def test_a_steps_clippings_end_with_its_gradient_when_the_step_is_skipped():
    # manual optimization: clip_gradients, then zero_grad instead of step (a NaN loss): the next step asks anew
    module, learner, optimizer = two_servers()
    optimizer.clipping += (Clipping(1.0),)
    optimizer.zero_grad()
    assert optimizer.clipping == ()
