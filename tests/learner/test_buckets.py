"""Pushes during the backward pass (``bucket_cap_mb``, issue 34): to a server reached over the push stream without
shared memory (as one on another host), the gradient goes in buckets while the backward pass runs; the arithmetic is
unchanged: async with one learner is plain SGD, hardsync is SGD with batch μλ, with ``overlap`` too, and a gradient
changed after its buckets went (a callback's change before the optimizer step) is pushed whole and applied as
changed."""

import pytest
import torch

from lightning_rudra.core.protocol import ProtocolConfig
from tests import rpc_harness as harness
from tests.learner.test_rpc import check_ok, sgd_reference

pytestmark = pytest.mark.timeout(120)

CAP_MB = 1e-5  # 10 bytes: the test model's part on server 1 (33 weights in 4 parameters) goes in 3 buckets


def _server_1_unmapped(rank, clients, **kwargs):
    """harness.train with server 1 reached as if on another host (its shared memory refused: the push stream carries
    the tensors), counting the pieces sent and the pushes that carried their gradient whole."""
    from lightning_rudra.learner import link
    from lightning_rudra.transport import stream_pieces

    mapped, add, finish = link.MappedWeights, stream_pieces.PiecedCall.add, stream_pieces.PiecedCall.finish
    counts = {"pieces": 0, "whole": 0, "in pieces": 0}

    def refused(names, rank, what, *args):
        if "parameter server 1" in what:
            raise OSError("refused by the test, as another host's /dev/shm")
        return mapped(names, rank, what, *args)

    def counted_add(self, piece):
        counts["pieces"] += 1
        return add(self, piece)

    def counted_finish(self, method, *args):
        counts["whole" if args[-1].grads is not None else "in pieces"] += 1
        return finish(self, method, *args)

    link.MappedWeights = refused
    stream_pieces.PiecedCall.add, stream_pieces.PiecedCall.finish = counted_add, counted_finish
    return {**harness.train(rank, clients, **kwargs), **counts}


def _run(learners, protocol, steps, mu, **options):
    results = harness.run_learners(
        learners,
        _server_1_unmapped,
        num_servers=2,
        config=ProtocolConfig(learners, protocol),
        steps=steps,
        mu=mu,
        bucket_cap_mb=CAP_MB,
        **options,
    )
    check_ok(results)
    for result in results:
        assert result["mapped"] == [True, False]
    return results


def test_async_with_one_learner_and_buckets_is_plain_sgd():
    steps, mu = 6, 5
    [result] = _run(1, "async", steps, mu)
    assert result["in pieces"] == steps and result["whole"] == 0
    assert result["pieces"] == 3 * steps
    for mine, expected in zip(result["params"], sgd_reference(steps, mu)):
        torch.testing.assert_close(mine, expected, rtol=0, atol=0)


def test_hardsync_with_buckets_equals_sgd_with_batch_mu_lambda():
    learners, steps, mu = 2, 5, 4
    results = _run(learners, "hardsync", steps, mu)
    reference = sgd_reference(steps, mu * learners)
    for result in results:
        assert result["in pieces"] == steps and result["whole"] == 0
        for mine, expected in zip(result["params"], reference):
            torch.testing.assert_close(mine, expected, rtol=0, atol=1e-5)
    stats = results[0]["stats"]
    assert stats.clock == steps and stats.staleness == {0: steps * learners}


def test_overlap_with_buckets_computes_on_the_newest_weights_received():
    """Rudra-adv*: the buckets of step k go out while the reply to step k - 1 still comes back; σ = 1 as without."""
    steps, mu = 6, 4
    [result] = _run(1, "async", steps, mu, overlap=True)
    assert result["in pieces"] == steps
    assert result["stats"].staleness == {0: 1, 1: steps - 1}
    master, probe = harness.model(), harness.model()
    opt = torch.optim.SGD(master.parameters(), lr=0.1, momentum=0.9)
    x, y = harness.data()
    history = [[p.detach().clone() for p in master.parameters()]]
    for step in range(steps):
        for p, w in zip(probe.parameters(), history[max(step - 1, 0)]):
            p.data.copy_(w)
        probe.zero_grad()
        rows = torch.arange(step * mu, (step + 1) * mu)
        torch.nn.functional.mse_loss(probe(x[rows]), y[rows]).backward()
        for p, q in zip(master.parameters(), probe.parameters()):
            p.grad = q.grad.clone()
        opt.step()
        history.append([p.detach().clone() for p in master.parameters()])
    for mine, expected in zip(result["params"], history[-1]):
        torch.testing.assert_close(mine, expected, rtol=0, atol=1e-6)


def _halve(net):
    """A change to the gradient after the backward pass (as a callback's in on_before_optimizer_step)."""
    for p in net.parameters():
        p.grad.mul_(0.5)


def test_a_gradient_changed_after_its_buckets_went_is_pushed_whole_as_changed():
    steps, mu = 5, 5
    [result] = _run(1, "async", steps, mu, after_backward=_halve)
    assert result["whole"] == steps and result["in pieces"] == 0
    # halving every gradient of momentum SGD is halving its rate
    for mine, expected in zip(result["params"], sgd_reference(steps, mu, lr=0.05)):
        torch.testing.assert_close(mine, expected, rtol=0, atol=1e-6)
