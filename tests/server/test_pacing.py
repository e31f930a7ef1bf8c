"""batchsync's pacing (lightning_rudra.server.pacing) with times by hand: whose reply waits for the round."""

import torch

from lightning_rudra.core.config import ProtocolConfig
from lightning_rudra.core.optimizers import OptimizerSpec
from lightning_rudra.core.protocol import Server
from lightning_rudra.core.update import Push
from lightning_rudra.server.pacing import RoundPacing


def measured(pacing: RoundPacing, steps: dict[int, float]) -> None:
    """Each learner handed the weights of clock 0 at 0 and pushing after its step: its step time is measured."""
    for learner, step in steps.items():
        pacing.handed_out(learner, 0.0, 0)
        pacing.pushed(learner, step)


def test_equal_learners_wait_for_the_round_a_faster_one_by_a_whole_step_does_not():
    pacing = RoundPacing(k=3)
    measured(pacing, {0: 1.0, 1: 1.0, 2: 1.0})
    for learner in (1, 2):
        pacing.handed_out(learner, 10.0, 5)  # computing on the weights of clock 5, due at 11
    # learner 0 pushed at 11 (received 1 of 3); its next would be due at 12, the others' at 11: it waits
    assert pacing.waits(0, 11.0, 5, 1, {0, 1, 2})
    # three times faster, its next (due at 11.33) still comes after learners 1 and 2 close the round (at 11)
    pacing.step[0] = 1 / 3
    assert pacing.waits(0, 11.0, 5, 1, {0, 1, 2})
    # with learner 2 a straggler (due at 13) the round needs learner 0's next gradient, due at 11.33: answered now
    pacing.step[2] = 3.0
    assert not pacing.waits(0, 11.0, 5, 1, {0, 1, 2})


def test_an_unmeasured_learner_is_not_held_and_others_on_older_weights_do_not_count():
    pacing = RoundPacing(k=2)
    pacing.handed_out(1, 0.0, 4)  # on the weights of clock 4: its gradient will be late at clock 5
    assert not pacing.waits(0, 1.0, 5, 1, {0, 1})  # learner 0 not measured yet
    measured(pacing, {0: 1.0})
    assert not pacing.waits(0, 1.0, 5, 1, {0, 1}), "learner 1 cannot close the round of clock 5"
    assert not pacing.enough(5, 1, {1}, 1.0) and pacing.enough(4, 1, {1}, 1.0)


def test_held_replies_are_let_go_once_the_learners_computing_cannot_close_the_round():
    w = torch.zeros(2)
    opt = torch.optim.SGD([w], lr=0.1)
    core = Server(ProtocolConfig(3, "batchsync"), [w], [], [OptimizerSpec.from_optimizer(opt, [w])])
    core.push(Push(0, 0, [torch.ones(2)], torch.tensor([True]), 0, [{"lr": 0.1}], []))
    pacing = RoundPacing(k=3)
    measured(pacing, {0: 1.0, 1: 1.0, 2: 1.0})
    pacing.handed_out(1, 0.0, 0)
    pacing.handed_out(2, 0.0, 0)
    assert pacing.hold(0, 1.0, core, set()) and pacing.waiting == {0}
    assert not pacing.cannot_close(core, set(), 1.0)  # learners 1 and 2 bring the two gradients missing
    assert pacing.cannot_close(core, {2}, 1.0), "learner 2 went to a collective: the round cannot close"
    pacing.forget(1)
    assert pacing.cannot_close(core, set(), 1.0) and 1 not in pacing.step
    pacing.handed_out(0, 2.0, 0)
    assert not pacing.waiting


def test_a_held_reply_is_answered_once_the_gradient_it_waits_for_is_overdue():
    """A stalled learner (alive, silent in its own code) does not hold the others' replies for ever: once its
    gradient is twice its step time late, the server's watch answers them."""
    w = torch.zeros(2)
    opt = torch.optim.SGD([w], lr=0.1)
    core = Server(ProtocolConfig(2, "batchsync"), [w], [], [OptimizerSpec.from_optimizer(opt, [w])])
    core.push(Push(0, 0, [torch.ones(2)], torch.tensor([True]), 0, [{"lr": 0.1}], []))
    pacing = RoundPacing(k=2)
    measured(pacing, {0: 1.0, 1: 1.0})
    pacing.handed_out(1, 0.5, 0)  # learner 1's gradient due at 1.5
    assert pacing.hold(0, 1.0, core, set())
    assert not pacing.cannot_close(core, set(), 2.0)  # a little late: still waited for
    assert pacing.cannot_close(core, set(), 100.0), "overdue: the held reply is answered"
    assert not pacing.waits(0, 100.0, 0, 1, {0, 1}), "nor is a new push held for it"
