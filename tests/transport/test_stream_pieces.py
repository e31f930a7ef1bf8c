"""A call in pieces over the stream (a push whose gradient goes bucket by bucket during the backward pass): the server
gets the gradient the pieces make, bit for bit, whatever their order; a push that carries its own gradient takes it;
pieces that do not make a gradient fail their call alone, the connection in step; a call never finished runs
nothing; a break while pieces go sends them again, and the call runs once."""

import multiprocessing
import socket
import time
import types

import pytest
import torch

from lightning_rudra.core.update import Push
from lightning_rudra.transport import frames
from lightning_rudra.transport.frames import TensorPiece, recv_frame
from lightning_rudra.transport.stream import ServerError
from lightning_rudra.transport.stream_pieces import PIECE
from lightning_rudra.transport.stream_server import StreamServer
from tests.transport.test_stream import _RUNS, LIMITS, SECRET, _answer, _client, _prove, _send_call

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def server():
    server = StreamServer("127.0.0.1", _answer, SECRET, LIMITS, timeout=10.0, max_peers=4)
    yield server
    server.close()


def _push(grads=None):
    return Push(3, 0, grads, torch.tensor([True, True]), 5, [{"lr": 0.1}], [], True)


def _pieces(flats, size):
    """Each flat tensor cut into pieces of ``size`` elements, last first (the backward pass's order)."""
    cut = [
        TensorPiece(t, flat.numel(), start, flat[start : start + size].clone())
        for t, flat in enumerate(flats)
        for start in range(0, flat.numel(), size)
    ]
    return cut[::-1]


def test_a_push_in_pieces_reaches_the_server_whole_bit_for_bit(server):
    _RUNS.clear()
    flats = [torch.randn(1000), torch.randn(37).to(torch.bfloat16)]
    client = _client(server)
    try:
        call = client.call_in_pieces()
        for piece in _pieces(flats, 300):
            call.add(piece)
            time.sleep(0.002)  # made one by one, as a backward pass makes them
        got = call.finish("push", _push()).wait()
        assert [g.dtype for g in got] == [torch.float32, torch.bfloat16]
        assert all(torch.equal(a, b) for a, b in zip(got, flats))
        assert client.call("echo", "after").wait() == ("after",)  # the stream goes on in step
    finally:
        client.close()


def test_a_push_that_carries_its_gradient_takes_it_and_the_pieces_are_dropped(server):
    """The learner's gradient changed after a piece went: it pushes the whole of it instead."""
    client = _client(server)
    try:
        call = client.call_in_pieces()
        call.add(TensorPiece(0, 10, 5, torch.ones(5)))
        whole = [torch.arange(10.0)]
        assert torch.equal(call.finish("push", _push(whole)).wait()[0], whole[0])
    finally:
        client.close()


@pytest.mark.parametrize(
    "pieces, why",
    [
        ([TensorPiece(0, 10, 0, torch.ones(5))], "tensor 0's pieces end at element 5 of 10"),
        ([TensorPiece(0, 10, 0, torch.ones(6)), TensorPiece(0, 10, 5, torch.ones(5))], "they overlap"),
        ([TensorPiece(0, 10, 0, torch.ones(5)), TensorPiece(0, 10, 6, torch.ones(4))], "gap or overlap at element 5"),
        ([TensorPiece(0, 10, 0, torch.ones(0))], r"piece \(0, 10, 0\) of 0 elements"),
        ([TensorPiece(0, 10, 8, torch.ones(5))], "overruns its 10"),
        ([TensorPiece(1, 10, 0, torch.ones(10))], "not 0 to 0"),
        ([TensorPiece(0, 10, 0, torch.ones(5)), TensorPiece(0, 12, 5, torch.ones(7))], "disagree"),
        ([TensorPiece(0, 1 << 40, 0, torch.ones(5))], "more than the stream's"),
        ([("not", "a piece")], "not tuple"),
    ],
)
def test_pieces_that_do_not_make_a_gradient_fail_their_call_and_the_stream_goes_on(server, pieces, why):
    client = _client(server)
    try:
        call = client.call_in_pieces()
        for piece in pieces:
            call.add(piece)
        with pytest.raises(ServerError, match=why):
            call.finish("push", _push()).wait()
        assert client.call("echo", "still in step").wait() == ("still in step",)
    finally:
        client.close()


def test_pieces_ahead_of_a_call_that_takes_no_gradient_fail_it(server):
    client = _client(server)
    try:
        call = client.call_in_pieces()
        call.add(TensorPiece(0, 5, 0, torch.ones(5)))
        with pytest.raises(ServerError, match="a call that takes no gradient"):
            call.finish("echo", "x").wait()
    finally:
        client.close()


def test_a_call_never_finished_runs_nothing_and_fails_with_its_reason(server):
    _RUNS.clear()
    client = _client(server)
    try:
        call = client.call_in_pieces()
        call.add(TensorPiece(0, 5, 0, torch.ones(5)))
        with pytest.raises(RuntimeError, match="the backward pass failed"):
            call.abandon(RuntimeError("the backward pass failed")).wait()
        assert client.call("echo", "next").wait() == ("next",)
        assert _RUNS == []
    finally:
        client.close()


def test_a_break_while_pieces_go_sends_them_again_and_the_push_runs_once(server):
    _RUNS.clear()
    flats = [torch.randn(4000)]
    client = _client(server)
    try:
        before = client.call("run", "before", 0.5)  # a reply still coming, as with overlap
        call = client.call_in_pieces()
        pieces = _pieces(flats, 1000)
        call.add(pieces[0])
        call.add(pieces[1])
        time.sleep(0.2)
        client.sock.shutdown(socket.SHUT_RDWR)  # the pieces sent so far go again on the new connection
        for piece in pieces[2:]:
            call.add(piece)
        got = call.finish("push", _push()).wait()
        assert before.wait() >= 1
        assert torch.equal(got[0], flats[0])
        assert [r if isinstance(r, str) else "push" for r in _RUNS] == ["before", "push"]
    finally:
        client.close()


def test_a_piece_of_one_call_followed_by_another_call_is_out_of_step(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        _prove(sock)
        frames.Frame.encode(TensorPiece(0, 5, 0, torch.ones(5))).send(sock, 1 | PIECE)
        _send_call(sock, 2, ("push", _push()))
        status, kind, message = recv_frame(sock, LIMITS)
        assert status == "error" and "a piece of call 1 followed by call 2" in message


def test_closing_a_client_whose_call_waits_for_pieces_ends_it(server):
    client = _client(server)
    call = client.call_in_pieces()
    call.add(TensorPiece(0, 5, 0, torch.ones(5)))
    client.close()
    assert not client._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        call.future.wait()


def test_pieces_that_write_one_element_over_and_over_are_refused_at_once_not_kept():
    """Regression (review of issue 34): overlaps were found only when the call ended, each piece's span kept till
    then: a client could make the server hold memory without bound."""
    from lightning_rudra.transport.stream_pieces import Assembly

    assembly = Assembly(LIMITS)
    for _ in range(100):
        assembly.add(TensorPiece(0, 10, 0, torch.ones(10)))
    assert "overlap" in assembly.error and sum(map(len, assembly.spans.values())) == 1


def test_a_call_of_more_pieces_than_a_learner_makes_is_refused(monkeypatch):
    from lightning_rudra.transport import stream_pieces

    monkeypatch.setattr(stream_pieces, "PIECES_LIMIT", 4)
    assembly = stream_pieces.Assembly(LIMITS)
    for start in range(6):
        assembly.add(TensorPiece(0, 10, start, torch.ones(1)))
    assert assembly.error == "more than 4 pieces" and assembly.pieces == 5


def test_an_abandoned_call_runs_nothing_on_the_server_and_is_answered(server):
    """The call that ends pieces never finished is answered with nothing, not an error, and runs nothing."""
    _RUNS.clear()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        _prove(sock)
        frames.Frame.encode(TensorPiece(0, 5, 0, torch.ones(5))).send(sock, 1 | PIECE)
        _send_call(sock, 1, ("abandoned",))
        assert recv_frame(sock, LIMITS) == ("ok", None)
        _send_call(sock, 2, ("echo", "next"))
        assert recv_frame(sock, LIMITS) == ("ok", ("next",))
    assert _RUNS == []


def _serve_until_killed(ports, secret):
    server = StreamServer("127.0.0.1", _answer, secret, LIMITS, timeout=3.0, max_peers=4)
    ports.put(server.port)
    time.sleep(120)  # killed first


@pytest.mark.slow  # a server process of its own: torch's import, seconds
def test_a_server_killed_between_pieces_fails_the_push_naming_it():
    """The learner's backward pass goes on after its server died: the next piece or the push notices, and the push
    fails saying why, not waits."""
    context = multiprocessing.get_context("spawn")
    ports = context.Queue()
    process = context.Process(
        target=_serve_until_killed, args=(ports, SECRET), daemon=True
    )  # a new import draws another
    process.start()
    client = _client(types.SimpleNamespace(port=ports.get(timeout=50)), timeout=3.0)
    try:
        call = client.call_in_pieces()
        call.add(TensorPiece(0, 10, 0, torch.ones(5)))
        process.kill()
        process.join()
        call.add(TensorPiece(0, 10, 5, torch.ones(5)))
        with pytest.raises(RuntimeError, match="the stream to the test's server closed: .* nobody listens there"):
            call.finish("push", _push()).wait()
    finally:
        client.close()
