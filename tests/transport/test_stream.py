"""The tensor stream (pushes to a server on another host): frames carry any picklable call with its tensors' bytes
beside it, bit for bit; a server answers a connection's calls in order, a future's value once it resolves, an error
as the error; a closed server fails the calls in progress with a message that names it."""

import socket
import threading
import time

import pytest
import torch
from torch.futures import Future

from lightning_rudra.core.compression import WeightMessage
from lightning_rudra.core.update import PushReply
from lightning_rudra.transport.elastic import LearnerId
from lightning_rudra.transport.stream import StreamClient, StreamServer, recv_frame, send_frame


def test_a_frame_carries_tensors_of_every_dtype_and_shape_bit_for_bit_inside_any_object():
    tensors = [
        torch.randn(1000),
        torch.randn(7, 3).to(torch.bfloat16),
        torch.tensor([True, False, True]),
        torch.arange(5, dtype=torch.int64),
        torch.tensor(2.5),  # 0-dim
        torch.empty(0),
        torch.randn(4, 6).t(),  # not contiguous
    ]
    sent = ("push", LearnerId(3, 2), [{"lr": 0.1}], PushReply("accepted", 1, 0.5, WeightMessage(False, tensors), [], 9))
    left, right = socket.socketpair()
    with left, right:
        sender = threading.Thread(target=send_frame, args=(left, sent))
        sender.start()
        got = recv_frame(right)
        sender.join()
    method, learner, hparams, reply = got
    assert (method, learner, learner.incarnation, hparams) == ("push", 3, 2, [{"lr": 0.1}])
    assert reply.status == "accepted" and reply.clock == 9 and reply.params.whole is False
    for a, b in zip(reply.params.flats, tensors):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def _answer(method, args):
    if method == "echo":
        return args
    if method == "later":  # a future that resolves on another thread, after a while, as a hardsync round does
        future = Future()
        threading.Timer(0.2, lambda: future.set_result(args[0] * 2)).start()
        return future.then(lambda done: done.value() + 1)
    if method == "fail":
        raise ValueError(f"refused {args[0]}")
    if method == "unpicklable":
        return threading.Lock()
    raise AssertionError(method)


@pytest.fixture
def server():
    server = StreamServer("127.0.0.1", _answer)
    yield server
    server.close()


def test_calls_are_answered_in_order_with_values_futures_and_errors(server):
    client = StreamClient("127.0.0.1", server.port, 10.0, "the test's server")
    try:
        calls = [
            client.call("later", torch.ones(3)),
            client.call("echo", torch.arange(4)),
            client.call("fail", 7),
            client.call("unpicklable"),
            client.call("echo", "still open"),
        ]
        assert torch.equal(calls[0].wait(), torch.full((3,), 3.0))
        assert torch.equal(calls[1].wait()[0], torch.arange(4))
        with pytest.raises(ValueError, match="refused 7"):
            calls[2].wait()
        with pytest.raises(RuntimeError, match="reply to unpicklable cannot be sent"):
            calls[3].wait()
        assert calls[4].wait() == ("still open",)
    finally:
        client.close()


def test_a_server_that_closes_fails_the_call_in_progress_and_later_ones_naming_it():
    listener = socket.create_server(("127.0.0.1", 0))
    accepted = []
    threading.Thread(target=lambda: accepted.append(listener.accept()[0]), daemon=True).start()
    client = StreamClient("127.0.0.1", listener.getsockname()[1], 10.0, "parameter server 1 (on 127.0.0.1)")
    try:
        pending = client.call("echo", torch.ones(10))
        deadline = time.monotonic() + 10
        while not accepted and time.monotonic() < deadline:
            time.sleep(0.01)
        accepted[0].close()  # the server's process died
        with pytest.raises(RuntimeError, match=r"the stream to parameter server 1 \(on 127.0.0.1\) closed"):
            pending.wait()
        with pytest.raises(RuntimeError, match="closed"):
            client.call("echo", 1).wait()
    finally:
        client.close()
        listener.close()


def test_connecting_where_nobody_listens_fails_at_once():
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    with pytest.raises(OSError):
        StreamClient("127.0.0.1", port, 5.0, "nobody")
