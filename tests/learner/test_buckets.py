"""Pushes during the backward pass (``bucket_cap_mb``, issue 34): to a server reached over the push stream without
shared memory (as one on another host), the gradient goes in buckets while the backward pass runs; the arithmetic is
unchanged: async with one learner is plain SGD, hardsync is SGD with batch μλ, with ``overlap`` too, and a gradient
changed after its buckets went (a callback's change before the optimizer step) is pushed whole and applied as
changed."""

import socket
import threading

import pytest
import torch

from lightning_rudra.core.compression import ErrorFeedback
from lightning_rudra.core.protocol import ProtocolConfig
from lightning_rudra.core.shards import ShardPlan
from lightning_rudra.core.update import Push
from lightning_rudra.learner.buckets import Bucketing, lay_out_buckets
from lightning_rudra.learner.client import LearnerClient
from lightning_rudra.learner.link import ServerLink
from lightning_rudra.transport.frames import FrameLimits, recv_frame
from lightning_rudra.transport.stream_pieces import ABANDONED, Assembly, PiecedCall
from tests import rpc_harness as harness
from tests.learner.test_rpc import check_ok, overlap_reference, sgd_reference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

CAP_MB = 1e-5  # 10 bytes: the test model's part on server 1 (33 weights in 4 parameters) goes in 3 buckets


def _server_1_unmapped(rank, clients, **kwargs):
    """harness.train with server 1 reached as if on another host (its shared memory refused: the push stream carries
    the tensors), counting the pieces sent and the pushes that carried their gradient whole."""
    from lightning_rudra.transport import stream_pieces

    add, finish = stream_pieces.PiecedCall.add, stream_pieces.PiecedCall.finish
    counts = {"pieces": 0, "whole": 0, "in pieces": 0}

    def counted_add(self, piece):
        counts["pieces"] += 1
        return add(self, piece)

    def counted_finish(self, method, *args):
        counts["whole" if args[-1].grads is not None else "in pieces"] += 1
        return finish(self, method, *args)

    harness.refuse_shared_memory_of_server_1()
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
    for mine, expected in zip(result["params"], overlap_reference(steps, mu)):
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


def _fails_one_push_in_pieces(rank, clients, steps, mu, config, bucket_cap_mb):
    """Async steps in which the push that would end the third step's call in pieces raises: the call is abandoned
    (else it would hold the stream, every later push waiting behind it), and training goes on."""
    from lightning_rudra.learner import client as client_module

    harness.refuse_shared_memory_of_server_1()
    net, learner, wrapped = harness.start(rank, clients, config, bucket_cap_mb=bucket_cap_mb)
    push, failed = client_module.LearnerClient.push, []

    def failing(self, push_, pieces=None):
        if pieces is not None and len(failed) < 1 and learner.bucketing.pieces >= 3 * 3:
            failed.append(pieces)
            raise RuntimeError("the test's failure")
        return push(self, push_, pieces)

    client_module.LearnerClient.push = failing
    errors = []
    for i in range(steps):
        try:
            wrapped.step(lambda: harness.closure(net, wrapped, torch.arange(i * mu, (i + 1) * mu)))
        except RuntimeError as error:
            # abandoned at once, not by the next step: until then it would hold the stream
            errors.append((str(error), failed[0].error is not None and failed[0].final is not None))
    learner.finish()
    return {"errors": errors, "clocks": [client.stats().clock for client in clients]}


def test_a_push_that_fails_after_its_buckets_went_abandons_them_and_the_stream_goes_on():
    steps = 6
    [result] = harness.run_learners(
        1,
        _fails_one_push_in_pieces,
        num_servers=2,
        config=ProtocolConfig(1, "async"),
        steps=steps,
        mu=4,
        bucket_cap_mb=CAP_MB,
    )
    check_ok([result])
    assert result["errors"] == [("the test's failure", True)]
    # server 0 (shared memory, pushed first) took every step; server 1 all but the failed one, whose pieces it dropped
    assert result["clocks"] == [steps, steps - 1]


class _Stream:
    """A push stream that keeps its calls in pieces (Bucketing driven by hand, in this process)."""

    def __init__(self):
        self.calls = []

    def call_in_pieces(self):
        call = PiecedCall(threading.Condition(), "the test's server")
        self.calls.append(call)
        return call


def _link(params):
    """A link to one server over a push stream, owning all of ``params`` (one optimizer)."""
    client = object.__new__(LearnerClient)
    client.stream, client.rank, client.deltas = _Stream(), 0, None
    plan = ShardPlan([p.shape for p in params], 1, True)
    link = ServerLink(0, client, plan.views(0, [p.detach() for p in params]), [])
    link.lay_out([plan.owned(0, list(range(len(params))))], [params])
    return link


def _served(call, push):
    """What the server's Assembly makes of ``call``'s pieces and its push."""
    assembly = Assembly(FrameLimits.for_model(1 << 20))
    for frame in call.pieces:
        assembly.add(_received(frame))
    return assembly.fill(("push", push))[-1].grads


def _received(frame):
    left, right = socket.socketpair()
    with left, right:
        frame.send(left)
        return recv_frame(right, FrameLimits.for_model(1 << 20))


def _backward(bucketing, link, params, scale=1.0):
    bucketing.begin(0, params, [link])
    for p in params:
        p.grad = None
    sum((p * torch.linspace(-1, 1, p.numel()).view_as(p)).sum() * scale for p in params).backward()
    for position in reversed(range(len(params))):  # the hooks, in the backward pass's order
        bucketing.ready(0, position)


def test_a_parameter_of_no_elements_sends_no_piece_and_the_gradient_arrives_whole():
    params = [torch.nn.Parameter(torch.empty(0)), torch.nn.Parameter(torch.randn(64))]
    link = _link(params)
    bucketing = Bucketing(64 * 4 / 2**20, None)
    _backward(bucketing, link, params)
    call, in_pieces = bucketing.end(link, 0)
    assert in_pieces and len(call.pieces) == 1
    push = Push(0, 0, None, torch.tensor([True, True]), 0, [{"lr": 0.1}], [], True)
    [got] = _served(call, push)
    assert torch.equal(got, torch.linspace(-1, 1, 64))


def test_bf16_pieces_dropped_leave_no_rounding_error_behind():
    """Error feedback keeps what rounding lost, to send later: for pieces the server dropped (the push carried the
    gradient whole), what they lost is not owed, and the next step's buckets start from the errors before them."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(50)), torch.nn.Parameter(torch.randn(50))]
    link = _link(params)
    feedback = ErrorFeedback("bf16")
    bucketing = Bucketing(50 * 4 / 2**20, feedback)  # a bucket per parameter
    _backward(bucketing, link, params)
    bucketing.end(link, 0)
    bucketing.pushed(link)
    kept = {key: [t.clone() for t in errors] for key, errors in feedback.residuals.items()}
    assert len(kept) == 2  # the first step's buckets were applied: their errors are owed
    _backward(bucketing, link, params, scale=0.3)
    for p in params:  # as a callback in on_before_optimizer_step
        p.grad.mul_(2.0)
    call, in_pieces = bucketing.end(link, 0)
    assert not in_pieces  # the push carries the gradient whole: the pieces are dropped
    assert feedback.residuals.keys() == kept.keys()
    assert all(torch.equal(feedback.residuals[key][0], errors[0]) for key, errors in kept.items())
    _backward(bucketing, link, params, scale=0.7)
    bucketing.abandon(RuntimeError("the step failed"))  # nor do the pieces of a step that failed
    assert all(torch.equal(feedback.residuals[key][0], errors[0]) for key, errors in kept.items())


def test_a_call_in_pieces_a_failed_step_leaves_is_abandoned_and_runs_nothing():
    params = [torch.nn.Parameter(torch.randn(8))]
    link = _link(params)
    bucketing = Bucketing(4 / 2**20, None)
    _backward(bucketing, link, params)
    call, _ = bucketing.end(link, 0)  # the push to this server then failed: it never ended the call
    bucketing.abandon(RuntimeError("the step's push failed"))
    assert call.error is not None and call.final is not None
    assert _received(call.final) == ABANDONED


def _on_one_host(rank, clients, **kwargs):
    """harness.train, recording the warnings of the first step (every server shares memory with the learner)."""
    import warnings

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = harness.train(rank, clients, **kwargs)
    return {**result, "warnings": [str(w.message) for w in caught if "bucket_cap_mb" in str(w.message)]}


def test_buckets_where_no_server_takes_them_say_so_once_on_learner_0_and_train_as_without():
    steps, mu = 3, 4
    results = harness.run_learners(
        2,
        _on_one_host,
        config=ProtocolConfig(2, "hardsync"),
        steps=steps,
        mu=mu,
        bucket_cap_mb=CAP_MB,
    )
    check_ok(results)
    [told] = results[0]["warnings"]
    assert "bucket_cap_mb=1e-05 changes nothing for learner 0's pushes" in told and results[1]["warnings"] == []
    for result in results:
        for mine, expected in zip(result["params"], sgd_reference(steps, mu * 2)):
            torch.testing.assert_close(mine, expected, rtol=0, atol=1e-5)


def test_a_dtype_whose_parameters_hold_no_element_is_pushed_whole():
    """The server's gradient is one flat tensor per dtype, and pieces cannot make an empty one."""
    params = [torch.nn.Parameter(torch.empty(0, dtype=torch.float16)), torch.nn.Parameter(torch.randn(8))]
    link = _link(params)
    assert lay_out_buckets(link, 0, 4) is None
    bucketing = Bucketing(4 / 2**20, None)
    _backward(bucketing, link, params)
    assert bucketing.end(link, 0) is None and bucketing.pieces == 0


def test_buckets_stay_fewer_than_the_pieces_a_call_may_hold(monkeypatch):
    from lightning_rudra.learner import buckets

    monkeypatch.setattr(buckets, "PIECES_LIMIT", 16)
    params = [torch.nn.Parameter(torch.randn(3)) for _ in range(100)]
    laid = lay_out_buckets(_link(params), 0, 1)  # a byte: a bucket per parameter, but for the limit
    assert len(laid.buckets) <= 16
    assert sorted(i for bucket in laid.buckets for i in bucket.parts) == list(range(100))


def test_a_call_in_pieces_finished_is_not_abandoned_and_is_not_finished_twice():
    call = PiecedCall(threading.Condition(), "the test's server")
    push = Push(0, 0, None, torch.tensor([True]), 0, [{"lr": 0.1}], [], True)
    call.finish("push", push)
    final = call.final
    call.abandon(RuntimeError("too late"))
    assert call.final is final and call.error is None
    with pytest.raises(RuntimeError, match="finished twice"):
        call.finish("push", push)
