"""The tensor stream (pushes to a server on another host): frames carry a call with its tensors' bytes beside it, bit
for bit; a connection proves it knows the run's secret before anything of it is unpickled, and then only what the
wire carries is decoded, within the model's size; a server answers a connection's calls in order, a future's value
once it resolves (keepalive frames meanwhile), an error as its type's name and message; every call ends, with an
error that names the server when the connection closes, goes silent or cannot carry it."""

import pickle
import secrets
import socket
import struct
import threading
import time

import pytest
import torch
from torch.futures import Future

from lightning_rudra.core.clipping import Clipping
from lightning_rudra.core.compression import WeightMessage
from lightning_rudra.core.optimizers import hyperparameters
from lightning_rudra.core.update import Push, PushReply
from lightning_rudra.learner.client import _CONNECTION_LOST, _TIMED_OUT, LearnerClient
from lightning_rudra.transport import frames, stream, stream_dialer, stream_server
from lightning_rudra.transport.elastic import LearnerId
from lightning_rudra.transport.frames import FrameLimits, recv_frame, send_frame
from lightning_rudra.transport.stream import ServerError, StreamOffer
from lightning_rudra.transport.stream_client import StreamClient
from lightning_rudra.transport.stream_server import StreamServer

pytestmark = pytest.mark.timeout(60)

SECRET = secrets.token_bytes(32)
LIMITS = FrameLimits.for_model(1 << 20)


def test_a_frame_carries_tensors_of_every_dtype_and_shape_bit_for_bit_inside_the_project_s_messages():
    tensors = [
        torch.randn(1000),
        torch.randn(7, 3).to(torch.bfloat16),
        torch.tensor([True, False, True]),
        torch.arange(5, dtype=torch.int64),
        torch.tensor(2.5),  # 0-dim
        torch.empty(0),
        torch.randn(4, 6).t(),  # not contiguous
    ]
    hparams = [{"lr": 0.1, "betas": (0.9, 0.99), "nesterov": False, "name": "head", "decay": None, "c": 1j}]
    reply = PushReply("accepted", 1, 0.5, WeightMessage(False, tensors), [], 9)
    clippings = (Clipping(0.5, "value"), Clipping(1.0, "norm", (0, 1), 2.5))  # a push's, in turn (core.clipping)
    sent = ("push", LearnerId(3, 2), hparams, reply, clippings)
    left, right = socket.socketpair()
    with left, right:
        sender = threading.Thread(target=send_frame, args=(left, sent))
        sender.start()
        got = recv_frame(right, LIMITS)
        sender.join()
    method, learner, hparams_got, reply, clipping = got
    assert (method, learner, learner.incarnation, hparams_got) == ("push", 3, 2, hparams)
    assert clipping == clippings
    assert reply.status == "accepted" and reply.clock == 9 and reply.params.whole is False
    for a, b in zip(reply.params.flats, tensors):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def test_numpy_hyperparameters_cross_the_stream_as_plain_numbers():
    """A config's or a schedule's numpy numbers: the stream carries plain values only, and every push goes over it."""
    import numpy as np

    group = {
        "lr": np.float64(0.05),
        "momentum": np.float32(0.5),
        "betas": (np.float64(0.9), 0.99),
        "steps": np.int64(3),
    }
    hparams = hyperparameters({**group, "params": [torch.zeros(1)], "foreach": None})
    assert hparams == {"lr": 0.05, "momentum": 0.5, "betas": (0.9, 0.99), "steps": 3}
    assert {type(v) for v in (hparams["lr"], hparams["momentum"], *hparams["betas"], hparams["steps"])} == {float, int}
    left, right = socket.socketpair()
    with left, right:
        sender = threading.Thread(target=send_frame, args=(left, ("push", [hparams])))
        sender.start()
        assert recv_frame(right, LIMITS) == ("push", [hparams])
        sender.join()
    with pytest.raises(frames.DecodeError, match="numpy"):  # why: the raw values would be refused
        left, right = socket.socketpair()
        with left, right:
            sender = threading.Thread(target=send_frame, args=(left, ("push", [group])))
            sender.start()
            try:
                recv_frame(right, LIMITS)
            finally:
                sender.join()


def test_a_push_crosses_the_stream_whole_its_tensors_beside_its_fields():
    grads = [torch.randn(100), torch.randn(5).to(torch.bfloat16)]
    clipping = (Clipping(1.0, "norm", (0, 1), 2.5),)
    has_grad, buffers = torch.tensor([True, False]), [torch.ones(3)]
    push = Push(LearnerId(2, 1), 1, grads, has_grad, 7, [{"lr": 0.1}], buffers, True, [0, 3], [3], clipping)
    frame = frames.Frame.encode(("push", push))
    assert len(frame.tensors) == 4  # the gradient's two, has_grad, the buffers: the tensors travel beside the pickle
    left, right = socket.socketpair()
    with left, right:
        sender = threading.Thread(target=send_frame, args=(left, ("push", push)))
        sender.start()
        method, got = recv_frame(right, LIMITS)
        sender.join()
    assert method == "push" and isinstance(got, Push)
    assert (got.learner, got.learner.incarnation, got.optimizer, got.timestamp) == (2, 1, 1, 7)
    assert (got.hparams, got.finite, got.members, got.refused, got.clipping) == (
        [{"lr": 0.1}],
        True,
        [0, 3],
        [3],
        clipping,
    )
    for a, b in zip([*got.grads, got.has_grad, *got.buffers], [*grads, has_grad, *buffers]):
        assert a.dtype == b.dtype and torch.equal(a, b)


class _TwoArguments(Exception):
    def __init__(self, first, second):
        super().__init__(f"{first} and {second}")


class _NotCarried:
    pass


class _RunsCode:
    """Unpickling this runs ``open(path, "w")``: a file appears where nobody asked for one."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (str(self.path), "w"))


_RUNS: list = []  # the "run" calls the server made, in order
_GATES: dict = {}  # name -> the future of the "gate" calls of that name


def _answer(method, args):
    if method == "echo":
        return args
    if method == "run":  # a push: applied once, answered after ``args[1]`` seconds
        _RUNS.append(args[0])
        future = Future()
        threading.Timer(args[1], lambda: future.set_result(len(_RUNS))).start()
        return future
    if method == "later":  # a future that resolves on another thread, after a while, as a hardsync round does
        future = Future()
        threading.Timer(args[1], lambda: future.set_result(args[0] * 2)).start()
        return future.then(lambda done: done.value() + 1)
    if method == "gate":  # answered once an "open" call of the same name runs: a push that waits for a later one
        return _GATES.setdefault(args[0], Future())
    if method == "open":
        _GATES.setdefault(args[0], Future()).set_result(f"{args[0]} opened")
        return "opened"
    if method == "push":  # a call in pieces: the gradient the server was given, and when
        _RUNS.append(args[-1])
        return args[-1].grads
    if method == "fail":
        raise ValueError(f"refused {args[0]}")
    if method == "two_arguments":
        raise _TwoArguments("x", "y")
    if method == "unpicklable":
        return threading.Lock()
    if method == "not_carried":
        return _NotCarried()
    raise AssertionError(method)


@pytest.fixture
def server():
    server = StreamServer("127.0.0.1", _answer, SECRET, LIMITS, timeout=10.0, max_peers=4)
    yield server
    server.close()


def _client(server, timeout=10.0, secret=SECRET, what="the test's server"):
    return StreamClient(StreamOffer("127.0.0.1", server.port, secret, LIMITS), timeout, what)


def _closed(sock):
    """Whether the other side closed the connection (a reset, when it left bytes unread)."""
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True


def _send_call(sock, number, call):
    frames.Frame.encode(call).send(sock, number)


def _prove(sock, secret=SECRET, session=None):
    """The learner's side of the handshake, by hand."""
    said = stream.read_exactly(sock, len(stream.MAGIC) + stream.NONCE)
    session = session or secrets.token_bytes(stream.SESSION)
    challenge, answer = said[len(stream.MAGIC) :], secrets.token_bytes(stream.NONCE) + session
    sock.sendall(stream.MAGIC + answer + stream.handshake_proof(secret, b"learner", challenge, answer))
    return stream.read_exactly(sock, stream.PROOF_SIZE)


def test_calls_are_answered_in_order_with_values_futures_and_errors(server):
    client = _client(server)
    try:
        calls = [
            client.call("later", torch.ones(3), 0.2),
            client.call("echo", torch.arange(4)),
            client.call("fail", 7),
            client.call("unpicklable"),
            client.call("echo", "still open"),
        ]
        assert torch.equal(calls[0].wait(), torch.full((3,), 3.0))
        assert torch.equal(calls[1].wait()[0], torch.arange(4))
        with pytest.raises(ServerError, match="ValueError: refused 7"):
            calls[2].wait()
        with pytest.raises(RuntimeError, match="reply to unpicklable cannot be sent"):
            calls[3].wait()
        assert calls[4].wait() == ("still open",)
    finally:
        client.close()


def test_a_stranger_s_pickle_is_never_unpickled(server, tmp_path):
    """Regression: the server unpickled any frame from anyone (a file created by the server, seen)."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        sock.recv(len(stream.MAGIC) + stream.NONCE)
        send_frame(sock, ("leave", _RunsCode(tmp_path / "ran")))  # a frame, where the proof should be
        assert _closed(sock)  # nothing answered
    assert not (tmp_path / "ran").exists()


def test_a_learner_with_another_secret_is_refused_and_an_impostor_server_is_not_trusted(server):
    with pytest.raises(ConnectionError, match="refused this learner's proof that it belongs to the run"):
        _client(server, secret=secrets.token_bytes(32))
    # a process that took the port of a server that ended, say, and takes any proof: it must not get the gradients
    listener, connections, offer = _half_open_server(lambda conn: None, secret=secrets.token_bytes(32))
    try:
        with pytest.raises(ConnectionError, match="could not prove it is the test's server"):
            StreamClient(offer, 10.0, "the test's server")
    finally:
        listener.close()
        for conn in connections:
            conn.close()


def test_a_global_the_stream_does_not_carry_is_refused_with_a_clear_error_and_the_connection_goes_on(server, tmp_path):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        _prove(sock)
        _send_call(sock, 1, ("push", _RunsCode(tmp_path / "ran"), torch.ones(5)))
        status, kind, message = recv_frame(sock, LIMITS)
        assert (status, kind) == ("error", "RuntimeError")
        assert "could not decode a call: UnpicklingError: io.open is not carried by the stream" in message
        _send_call(sock, 2, ("echo", torch.arange(3)))  # still in step: the refused frame's tensor was read past
        status, (echoed,) = recv_frame(sock, LIMITS)
        assert status == "ok" and torch.equal(echoed, torch.arange(3))
    assert not (tmp_path / "ran").exists()


@pytest.mark.parametrize("pickled, tensors", [(1 << 40, 0), (10, 1 << 40), (0, 5)])
def test_a_frame_over_the_limits_is_refused_before_anything_is_allocated(server, pickled, tensors):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        _prove(sock)
        sock.sendall(frames._NUMBER.pack(1) + frames._HEADER.pack(pickled, tensors))
        status, kind, message = recv_frame(sock, LIMITS)
        assert status == "error" and "is not one of this run's stream: at most" in message
        assert _closed(sock)


def test_a_call_the_server_cannot_decode_is_answered_with_the_real_cause(server, monkeypatch):
    """Regression (issue 32 item 8): a MemoryError while decoding dropped the connection, and the learner was told
    "the stream ... closed: Connection reset by peer"."""
    allocate = torch.empty

    def empty(shape, dtype=None):
        if tuple(shape) == (12345,):
            raise MemoryError("cannot allocate 49380 bytes")
        return allocate(shape, dtype=dtype)

    monkeypatch.setattr(frames.torch, "empty", empty)
    client = _client(server)
    try:
        with pytest.raises(
            RuntimeError, match="could not decode a call: MemoryError: cannot allocate 49380 bytes"
        ) as err:
            client.call("echo", torch.ones(12345)).wait()
        # the learner reports it as the server's error, not as a server that died or did not answer
        assert not _CONNECTION_LOST.search(str(err.value)) and not _TIMED_OUT.search(str(err.value))
        assert client.call("echo", 1).wait() == (1,)
    finally:
        client.close()


def test_a_reply_the_learner_cannot_unpickle_ends_its_call_and_the_connection_goes_on(server):
    """Regression (issue 32 item 4): an exception whose __init__ takes two arguments killed the client's thread
    (TypeError while unpickling the reply), and the call never completed."""
    client = _client(server)
    try:
        with pytest.raises(ServerError, match="_TwoArguments: x and y") as raised:
            client.call("two_arguments").wait()
        assert raised.value.kind == "_TwoArguments"
        with pytest.raises(RuntimeError, match=r"the reply of the test's server to not_carried could not be decoded: "):
            client.call("not_carried").wait()
        assert client.call("echo", 2).wait() == (2,)
    finally:
        client.close()


def test_a_request_that_cannot_be_pickled_fails_its_call_only(server):
    """Regression (issue 32 item 4): the client's thread died (cannot pickle '_thread.lock'), the call never
    completed."""
    client = _client(server)
    try:
        with pytest.raises(RuntimeError, match="echo cannot be sent to the test's server: cannot pickle"):
            client.call("echo", threading.Lock()).wait()
        assert client.call("echo", 3).wait() == (3,)
    finally:
        client.close()


def _half_open_server(behave, secret=SECRET):
    """A server that takes any learner, proves it knows ``secret`` and then does ``behave(connection)``."""
    listener = socket.create_server(("127.0.0.1", 0))
    connections = []

    def serve():
        conn, _ = listener.accept()
        connections.append(conn)
        challenge = secrets.token_bytes(stream.NONCE)
        conn.sendall(stream.MAGIC + challenge)
        said = stream.read_exactly(conn, len(stream.MAGIC) + stream.NONCE + stream.SESSION + stream.PROOF_SIZE)
        conn.sendall(stream.handshake_proof(secret, b"server", said[len(stream.MAGIC) : -stream.PROOF_SIZE], challenge))
        behave(conn)

    threading.Thread(target=serve, daemon=True).start()
    offer = StreamOffer("127.0.0.1", listener.getsockname()[1], SECRET, LIMITS)
    return listener, connections, offer


def test_a_half_open_stream_fails_the_call_within_the_timeout_naming_the_server():
    """Regression (issue 32 item 4): a peer that takes pushes and never answers (a half-open connection) left the
    push waiting forever, while RPC's heartbeat on its own connection went on."""
    listener, connections, offer = _half_open_server(lambda conn: None)
    client = StreamClient(offer, 1.0, "parameter server 1 (on 127.0.0.1)")
    try:
        pending = client.call("push", torch.ones(10))
        later = client.call("push", torch.ones(10))
        with pytest.raises(RuntimeError, match=r"the stream to parameter server 1 \(on 127.0.0.1\) timed out") as err:
            pending.wait()
        assert "nothing moved on it for 1 s (rpc_timeout)" in str(err.value)
        # the learner counts it as a server that did not answer, as an RPC timeout, not as one whose process died
        assert _TIMED_OUT.search(str(err.value)) and not _CONNECTION_LOST.search(str(err.value))
        with pytest.raises(RuntimeError, match="closed: nothing moved on it") as err:
            later.wait()
        assert _CONNECTION_LOST.search(str(err.value))
        with pytest.raises(RuntimeError, match="closed"):
            client.call("push", 1).wait()
    finally:
        client.close()
        listener.close()
        for conn in connections:
            conn.close()


def test_a_long_call_is_kept_alive_past_the_timeout(server):
    server.timeout = 0.4  # keepalive frames every 0.1 s
    client = _client(server, timeout=0.4)
    try:  # a hardsync round that waits 1.5 s for a slow learner: not a silent server
        assert torch.equal(client.call("later", torch.ones(2), 1.5).wait(), torch.full((2,), 3.0))
    finally:
        client.close()


def test_a_reply_that_is_not_one_ends_every_pending_call_naming_the_server():
    listener, connections, offer = _half_open_server(lambda conn: send_frame(conn, ("what",)))
    client = StreamClient(offer, 10.0, "parameter server 1 (on 127.0.0.1)")
    try:
        calls = [client.call("push", i) for i in range(3)]
        for call in calls:
            with pytest.raises(RuntimeError, match=r"the stream to parameter server 1 \(on 127.0.0.1\) closed"):
                call.wait()
    finally:
        client.close()
        listener.close()
        for conn in connections:
            conn.close()


def test_a_server_that_closes_fails_the_call_in_progress_and_later_ones_naming_it():
    closed = threading.Event()

    def close_after_a_call(conn):
        frames.recv_number(conn)
        recv_frame(conn, LIMITS)
        listener.close()  # the server's process died: nobody listens there any more
        conn.close()
        closed.set()

    listener, _, offer = _half_open_server(close_after_a_call)
    client = StreamClient(offer, 10.0, "parameter server 1 (on 127.0.0.1)")
    try:
        pending = client.call("echo", torch.ones(10))
        # at once, not after trying for the timeout: nobody listens
        with pytest.raises(
            RuntimeError, match=r"the stream to parameter server 1 \(on 127.0.0.1\) closed: .* nobody listens"
        ):
            pending.wait()
        with pytest.raises(RuntimeError, match="closed"):
            client.call("echo", 1).wait()
    finally:
        client.close()
        listener.close()


@pytest.mark.parametrize("when", ["while the server runs the call", "before the call is sent"])
def test_a_broken_connection_is_opened_again_and_the_call_in_progress_runs_once(server, when):
    """Regression (issue 32, the chaos soak): a connection reset by ``ss -K`` ended the learner ("the stream ...
    closed: [Errno 103] Software caused connection abort"). The call in progress may or may not have reached the
    server: sent again, it is answered with the reply made to it, never run twice."""
    _RUNS.clear()
    client = _client(server)
    try:
        assert client.call("run", "first", 0.0).wait() == 1
        if when == "before the call is sent":
            client.sock.shutdown(socket.SHUT_RDWR)
            second = client.call("run", "second", 0.0)
        else:
            second = client.call("run", "second", 1.0)
            for _ in range(100):
                if len(_RUNS) == 2:
                    break
                time.sleep(0.02)
            client.sock.shutdown(socket.SHUT_RDWR)  # the server has it: its reply comes on the new connection
        assert second.wait() == 2
        assert client.call("run", "third", 0.0).wait() == 3
        assert _RUNS == ["first", "second", "third"]
    finally:
        client.close()


def test_a_call_sent_again_is_answered_from_its_session_and_out_of_order_numbers_are_refused(server):
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        _prove(sock, session=b"s" * stream.SESSION)
        _send_call(sock, 1, ("echo", "first"))
        assert recv_frame(sock, LIMITS) == ("ok", ("first",))
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        _prove(sock, session=b"s" * stream.SESSION)
        _send_call(sock, 1 | stream.RESENT, ("echo", "sent again: not run"))
        assert recv_frame(sock, LIMITS) == ("ok", ("first",))
        for number in (0, 3, 1 << 40):
            _send_call(sock, number, ("echo", "x"))
            status, kind, message = recv_frame(sock, LIMITS)
            assert status == "error" and f"call {number} out of order" in message
        _send_call(sock, 2, ("echo", "second"))
        assert recv_frame(sock, LIMITS) == ("ok", ("second",))


def test_connecting_where_nobody_listens_fails_at_once():
    with socket.create_server(("127.0.0.1", 0)) as probe:
        port = probe.getsockname()[1]
    with pytest.raises(OSError):
        StreamClient(StreamOffer("127.0.0.1", port, SECRET, LIMITS), 5.0, "nobody")


@pytest.mark.parametrize("address", ["", "0.0.0.0", "::"])
def test_the_stream_never_listens_on_every_interface(address):
    """Regression: with no address towards the rendezvous the stream listened on 0.0.0.0."""
    with pytest.raises(ValueError, match="never on every interface"):
        StreamServer(address, _answer, SECRET, LIMITS, 10.0, 4)


def _stranger(server, source):
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=10, source_address=(source, 0))
    return sock


def test_strangers_that_never_prove_themselves_hold_a_few_connections_at_most(server):
    # two from one address at most: a stranger's loop of connections leaves room for the learners elsewhere
    strangers = [_stranger(server, "127.0.0.2") for _ in range(stream_server._HANDSHAKES_PER_SOURCE)]
    # and a few in all, whatever their addresses
    strangers += [_stranger(server, f"127.0.0.{3 + i // 2}") for i in range(stream_server._HANDSHAKES - len(strangers))]
    try:
        for sock in strangers:  # each is being challenged
            assert sock.recv(len(stream.MAGIC)) == stream.MAGIC
        for source in ("127.0.0.2", "127.0.0.200"):
            with _stranger(server, source) as extra:
                assert _closed(extra)  # at once
        opened = []
        # a learner meanwhile tries again until the strangers' handshakes end (here: as they hang up)
        learner = threading.Thread(target=lambda: opened.append(_client(server)))
        learner.start()
        time.sleep(1.0)
        assert not opened
    finally:
        for sock in strangers:
            sock.close()
    learner.join(timeout=10)
    assert opened
    try:
        assert opened[0].call("echo", 4).wait() == (4,)
    finally:
        opened[0].close()


def test_a_frame_of_more_tensors_than_any_push_holds_is_refused_and_the_connection_goes_on(server):
    """Review (issue 32, D4): a 1 MiB pickle could name tens of thousands of empty tensors, each an allocation."""
    client = _client(server)
    try:
        # refused before it is sent
        with pytest.raises(RuntimeError, match="echo cannot be sent to the test's server: 1025 tensors, over the"):
            client.call("echo", [torch.empty(0)] * 1025).wait()
        assert len(client.call("echo", [torch.ones(1)] * 1024).wait()[0]) == 1024
    finally:
        client.close()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:  # and by the server, sent by hand
        _prove(sock)
        _send_call(sock, 1, ("echo", [torch.empty(0)] * 1025))
        status, _, message = recv_frame(sock, LIMITS)
        assert status == "error" and "could not decode a call: UnpicklingError: it holds more than 1024" in message
        _send_call(sock, 2, ("echo", 1))
        assert recv_frame(sock, LIMITS) == ("ok", (1,))


def test_the_unpickler_allows_the_wire_s_types_only():
    assert pickle.loads(pickle.dumps(torch.bfloat16)) is torch.bfloat16
    for refused in (pickle.dumps(_NotCarried()), pickle.dumps(print), pickle.dumps(torch.nn.Linear)):
        with pytest.raises(pickle.UnpicklingError, match="is not carried by the stream"):
            frames._Unpickler(memoryview(refused), 0).load()
    with pytest.raises(pickle.UnpicklingError, match="more bytes than its header declares"):
        frames._Unpickler(memoryview(frames.Frame.encode(torch.ones(3)).head[frames._HEADER.size :]), 11).load()


@pytest.mark.slow  # waits for seconds
def test_a_member_beyond_the_connections_a_run_needs_is_told_so(monkeypatch):
    # a connection beyond max_peers waits for a slot as long as a handshake may take (a lost learner's may free):
    # 2 s here, not the 10 s of a run
    monkeypatch.setattr(stream_server, "_HANDSHAKE_S", 2.0)
    server = StreamServer("127.0.0.1", _answer, SECRET, LIMITS, 10.0, max_peers=1)
    first = _client(server)
    try:
        assert first.call("echo", 5).wait() == (5,)
        second = _client(server)
        try:
            with pytest.raises(ServerError, match="the stream takes 1 connections at once"):
                second.call("echo", 6).wait()
        finally:
            second.close()
        assert first.call("echo", 7).wait() == (7,)
    finally:
        first.close()
        server.close()


def test_a_stranger_dripping_bytes_is_closed_when_its_whole_handshake_is_due(server, monkeypatch):
    """The handshake has one deadline for all its bytes: a byte now and then does not keep a slot (the server's
    timeout here is 10 s per step; the handshake's whole deadline 0.5 s)."""
    monkeypatch.setattr(stream_server, "_HANDSHAKE_S", 0.5)
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as stranger:
        assert stranger.recv(len(stream.MAGIC)) == stream.MAGIC
        closed = False
        for _ in range(60):  # 12 s of a byte every 0.2 s, were it never closed
            try:
                stranger.sendall(b"x")
                stranger.settimeout(0.2)
                closed = stranger.recv(64) == b""
            except socket.timeout:
                continue
            except OSError:
                closed = True
            if closed:
                break
        assert closed, "a stranger sending a byte every 0.2 s kept its handshake open"


class _BrokenHere:
    """A connection the learner sees break (``ss -K`` on its side) while the server's side stays open and silent."""

    def __init__(self, sock):
        self.sock = sock  # held: the server's side of it stays open

    def sendall(self, data):
        raise ConnectionResetError(104, "Connection reset by peer")

    def shutdown(self, how):
        pass

    def close(self):
        pass


def test_a_reconnect_takes_over_its_session_while_the_server_still_holds_the_broken_connection():
    """Review (issue 32): the broken connection's thread held the only peer slot, and the new connection was refused
    as one too many."""
    _RUNS.clear()
    server = StreamServer("127.0.0.1", _answer, SECRET, LIMITS, timeout=10.0, max_peers=1)
    client = _client(server)
    try:
        assert client.call("run", "first", 0.0).wait() == 1
        client.sock = _BrokenHere(client.sock)
        assert client.call("run", "second", 0.0).wait() == 2
        assert _RUNS == ["first", "second"]
    finally:
        client.close()
        server.close()


def test_a_re_sent_call_that_cannot_be_decoded_is_answered_from_its_session(server, tmp_path):
    """Review (issue 32): a re-sent push that failed to decode was answered "could not decode" though it had been
    applied, and the next push got its reply."""
    session = b"d" * stream.SESSION
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        _prove(sock, session=session)
        _send_call(sock, 1, ("echo", "first"))
        assert recv_frame(sock, LIMITS) == ("ok", ("first",))
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:
        _prove(sock, session=session)
        _send_call(sock, 1 | stream.RESENT, ("echo", _RunsCode(tmp_path / "ran")))  # its body is not needed
        assert recv_frame(sock, LIMITS) == ("ok", ("first",))
        _send_call(sock, 2, ("echo", "second"))
        assert recv_frame(sock, LIMITS) == ("ok", ("second",))
    assert not (tmp_path / "ran").exists()


def test_a_connected_session_outlives_any_number_of_others(server):
    """Review (issue 32): sessions were dropped in the order they connected, a live learner's with them, and its
    next call after a break was refused as out of order (or its first push applied twice)."""
    _RUNS.clear()
    client = _client(server)
    try:
        assert client.call("run", "first", 0.0).wait() == 1
        for _ in range(4 * server.max_peers):
            _client(server).close()
        client.sock.shutdown(socket.SHUT_RDWR)
        assert client.call("run", "second", 0.0).wait() == 2
        assert _RUNS == ["first", "second"]
    finally:
        client.close()


def test_a_call_over_the_stream_s_limits_fails_before_it_is_sent_and_the_connection_goes_on(server):
    """Review (issue 32): the server closed the connection on it, and the client reconnected and sent it again,
    thousands of times."""
    client = _client(server)
    try:
        with pytest.raises(RuntimeError, match="echo cannot be sent to the test's server: .* over the stream's"):
            client.call("echo", torch.ones(LIMITS.tensors // 4 + 1)).wait()
        assert client.call("echo", 1).wait() == (1,)
    finally:
        client.close()


def test_a_reconnect_that_runs_out_of_time_is_reported_as_a_timeout(monkeypatch):
    """Review (issue 32): it read as a server whose process died ("Broken pipe" in its message)."""
    listener, connections, offer = _half_open_server(lambda conn: conn.close())
    client = StreamClient(offer, 1.0, "parameter server 1 (on 127.0.0.1)")
    try:
        with pytest.raises(RuntimeError, match="timed out: it broke .* could not open it within 1 s") as err:
            client.call("echo", 1).wait()
        lost = object.__new__(LearnerClient)
        lost.what, lost.server_host, lost.timeout = "parameter server 1", "127.0.0.1", 1.0
        assert "did not answer within 1 s (rpc_timeout)" in lost._lost(err.value)
    finally:
        client.close()
        listener.close()


@pytest.mark.slow  # waits for seconds
def test_closing_while_a_connect_hangs_ends_the_client_s_thread(server, monkeypatch):
    """Review (issue 32): close() waited its 5 s for a connect that took rpc_timeout, and returned with the thread
    still trying."""
    client = _client(server, timeout=30.0)
    assert client.call("echo", 1).wait() == (1,)

    def unanswered(address, timeout=None):  # SYNs nobody answers
        time.sleep(timeout)
        raise socket.timeout("timed out")

    monkeypatch.setattr(stream_dialer.socket, "create_connection", unanswered)
    client.sock.shutdown(socket.SHUT_RDWR)
    pending = client.call("echo", 2)
    time.sleep(0.2)
    client.close()
    assert not client._thread.is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        pending.wait()


def test_closing_while_a_reconnect_s_handshake_hangs_shuts_it_at_once(server, monkeypatch):
    """Review (session 32): the connection being opened is the dialer's; close() must shut it, not leave the
    handshake to its timeout."""
    mute = socket.create_server(("127.0.0.1", 0))  # takes connections and says nothing: the handshake waits
    client = _client(server, timeout=30.0)
    try:
        assert client.call("echo", 1).wait() == (1,)
        monkeypatch.setattr(client._dialer, "offer", client.offer._replace(port=mute.getsockname()[1]))
        client.sock.shutdown(socket.SHUT_RDWR)
        pending = client.call("echo", 2)
        mute.settimeout(10)
        taken, _ = mute.accept()  # the reconnect: its handshake now waits for the listener's first bytes
        time.sleep(0.2)
        client.close()  # joins its thread for 5 s at most: without the shut, the handshake waits its 30
        assert not client._thread.is_alive()
        with pytest.raises(RuntimeError, match="closed: .*this learner closed it"):
            pending.wait()
        taken.close()
    finally:
        client.close()
        mute.close()


def test_a_call_whose_every_new_connection_breaks_ends_within_the_timeout():
    """Second review (issue 32): a connection that broke right after each handshake (a middlebox resetting what
    the call carries) was opened again thousands of times, for good."""
    opened = []

    def handshake_then_reset(conn):
        opened.append(conn)
        frames.recv_number(conn)
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        conn.close()

    listener = socket.create_server(("127.0.0.1", 0))

    def serve():
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            challenge = secrets.token_bytes(stream.NONCE)
            conn.sendall(stream.MAGIC + challenge)
            said = stream.read_exactly(conn, len(stream.MAGIC) + stream.NONCE + stream.SESSION + stream.PROOF_SIZE)
            conn.sendall(
                stream.handshake_proof(SECRET, b"server", said[len(stream.MAGIC) : -stream.PROOF_SIZE], challenge)
            )
            handshake_then_reset(conn)

    threading.Thread(target=serve, daemon=True).start()
    client = StreamClient(StreamOffer("127.0.0.1", listener.getsockname()[1], SECRET, LIMITS), 2.0, "the test's server")
    try:
        with pytest.raises(RuntimeError, match="timed out: it broke .* again and again for 2 s"):
            client.call("echo", 1).wait()
        assert len(opened) <= 2.0 / 0.5 + 1  # a try every half second
    finally:
        client.close()
        listener.close()


def test_a_learner_idle_past_its_forgotten_session_goes_on_and_a_call_sent_again_then_is_refused():
    """Second review (issue 32): a learner whose connection ended on the server's side, idle for over twice the
    timeout (a validation loop), was refused every later call as out of order."""
    server = StreamServer("127.0.0.1", _answer, SECRET, LIMITS, timeout=0.2, max_peers=2)
    client = _client(server, timeout=0.2)
    try:
        assert client.call("echo", 1).wait() == (1,)
        (session,) = server._sessions.values()
        session.connection.shutdown(socket.SHUT_RDWR)  # the server's side ends (ss -K there)
        time.sleep(0.6)  # idle past twice the timeout: the session is forgotten when the learner comes back
        assert client.call("echo", 2).wait() == (2,)
    finally:
        client.close()
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as sock:  # a session the server never saw
        _prove(sock)
        _send_call(sock, 7 | stream.RESENT, ("echo", "may have run"))
        status, _, message = recv_frame(sock, LIMITS)
        assert status == "error" and "no longer keeps the reply to call 7, sent again" in message
    server.close()


def test_a_session_older_than_twice_the_timeout_survives_its_connection_being_taken_over():
    """A newer connection set the session's connection aside before the older one's thread ended, which then found
    it idle since its start and forgot it: the call sent again was refused as no longer kept."""
    _RUNS.clear()
    server = StreamServer("127.0.0.1", _answer, SECRET, LIMITS, timeout=10.0, max_peers=1)
    client = _client(server)
    try:
        assert client.call("run", "first", 0.0).wait() == 1
        (session,) = server._sessions.values()
        session.idle_since -= 100  # made long ago, connected since
        second = client.call("run", "second", 1.0)
        for _ in range(100):
            if len(_RUNS) == 2:
                break
            time.sleep(0.02)
        client.sock.shutdown(socket.SHUT_RDWR)  # the learner's side breaks; the server's waits for the reply
        assert second.wait() == 2
        assert _RUNS == ["first", "second"]
    finally:
        client.close()
        server.close()


def _soon(future, seconds=5.0):
    """Whether ``future`` resolves within ``seconds`` (a call stuck behind another fails the test, not hangs it)."""
    deadline = time.monotonic() + seconds
    while not future.done() and time.monotonic() < deadline:
        time.sleep(0.01)
    return future.done()


def test_a_call_goes_out_while_the_one_before_still_waits_for_its_reply(server):
    """Issue 34: a learner with ``overlap`` sends its next push while the reply to the last still comes back (before,
    a connection carried one call at a time: the next push waited for the whole reply, and the link went one way at a
    time). The server reads the second call, runs it, and answers both in the order they came."""
    _GATES.clear()
    client = _client(server)
    try:
        first = client.call("gate", "a")  # answered only once the next call has run
        second = client.call("open", "a")
        assert _soon(first), "the second call was not sent while the first waited for its reply"
        assert first.wait() == "a opened" and second.wait() == "opened"
        # a reply made later than the next one's still comes first: each future gets its own
        slow, fast = client.call("later", 5, 0.3), client.call("echo", "x")
        assert slow.wait() == 11 and fast.wait() == ("x",)
    finally:
        client.close()


def test_at_most_in_flight_calls_wait_for_replies_the_next_waits_to_be_sent(server):
    _GATES.clear()
    _RUNS.clear()
    client, other = _client(server), _client(server)
    try:
        gated = [client.call("gate", name) for name in ("b", "c")]
        third = client.call("run", "third", 0.0)
        time.sleep(0.3)
        assert len(client._unanswered) == stream.IN_FLIGHT == 2 and len(client._queue) == 1 and not _RUNS
        assert other.call("open", "b").wait() == "opened"  # one answered: the third goes, and runs
        assert gated[0].wait() == "b opened"
        for _ in range(100):
            if _RUNS:
                break
            time.sleep(0.02)
        assert _RUNS == ["third"]
        assert not third.done()  # its reply comes after the one before it, which still waits
        assert other.call("open", "c").wait() == "opened"
        assert gated[1].wait() == "c opened" and third.wait() == 1
    finally:
        client.close()
        other.close()


def test_a_connection_broken_with_two_calls_in_flight_sends_both_again_and_each_runs_once(server):
    _RUNS.clear()
    client = _client(server)
    try:
        first, second = client.call("run", "first", 1.0), client.call("run", "second", 1.0)
        for _ in range(100):
            if len(_RUNS) == 2:
                break
            time.sleep(0.02)
        assert _RUNS == ["first", "second"]  # both read while the first's reply is not made
        client.sock.shutdown(socket.SHUT_RDWR)  # the replies come on the new connection, from the session
        assert first.wait() == 2 and second.wait() == 2
        assert client.call("run", "third", 0.0).wait() == 3
        assert _RUNS == ["first", "second", "third"]
    finally:
        client.close()


def _throttled_proxy(port, rate):
    """A listening socket relaying to ``port``, the client's bytes at ``rate`` bytes/s (a slow uplink)."""
    listener = socket.create_server(("127.0.0.1", 0))

    def pipe(src, dst, pause):
        try:
            while data := src.recv(64 << 10):
                dst.sendall(data)
                time.sleep(len(data) / rate if pause else 0)
        except OSError:
            pass
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def accept():
        try:
            while True:
                conn, _ = listener.accept()
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 64 << 10)
                onward = socket.create_connection(("127.0.0.1", port))
                threading.Thread(target=pipe, args=(conn, onward, True), daemon=True).start()
                threading.Thread(target=pipe, args=(onward, conn, False), daemon=True).start()
        except OSError:
            return

    threading.Thread(target=accept, daemon=True).start()
    return listener


@pytest.mark.slow  # waits for seconds
def test_a_call_slower_to_send_than_the_timeout_is_not_taken_for_a_silent_connection():
    """Review (issue 34): with a thread reading replies, the wait for a reply began as the call began to go out, so a
    push whose upload took longer than ``rpc_timeout`` (each piece of it moving) failed as a half-open connection.
    Silence counts from the moment the call went out whole, as before."""
    limits = FrameLimits.for_model(16 << 20)
    server = StreamServer("127.0.0.1", lambda method, args: args[0].numel(), SECRET, limits, 1.0, max_peers=4)
    proxy = _throttled_proxy(server.port, rate=3 << 20)
    client = StreamClient(StreamOffer("127.0.0.1", proxy.getsockname()[1], SECRET, limits), 1.0, "a slow uplink")
    try:
        client.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 64 << 10)
        started = time.monotonic()
        assert client.call("push", torch.zeros(2 << 20)).wait() == 2 << 20  # 8 MiB at 3 MiB/s: over 2 s
        assert time.monotonic() - started > 1.5
    finally:
        client.close()
        proxy.close()
        server.close()


@pytest.mark.slow  # waits for seconds
def test_a_client_that_reads_no_answers_is_not_read_either():
    """Review (issue 34): the server read and ran every call while its answers piled up unsent (a proven client that
    never reads grew the server by about 9 MiB/s). The reading waits for the answers to go: TCP holds the client."""
    ran = []

    def weights(method, args):  # a reply of a megabyte, as a push's: the socket's buffers fill after a few
        ran.append(1)
        return torch.zeros(1 << 18)

    quiet = StreamServer("127.0.0.1", weights, SECRET, LIMITS, 30.0, max_peers=4)
    sock = socket.create_connection(("127.0.0.1", quiet.port), timeout=30)
    try:
        _prove(sock)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        call = frames.Frame.encode(("echo",)).head

        def flood():
            try:
                for start in range(1, 10**6, 200):
                    sock.sendall(b"".join(frames._NUMBER.pack(start + i) + call for i in range(200)))
            except OSError:
                pass

        threading.Thread(target=flood, daemon=True).start()
        time.sleep(2.0)
        first = len(ran)
        time.sleep(1.0)
        assert len(ran) == first < 100, "the server kept running calls whose answers nobody read"
    finally:
        sock.close()
        quiet.close()


@pytest.mark.slow  # waits for seconds
def test_a_refusal_that_comes_while_a_call_goes_out_ends_that_call_and_the_next_ones():
    """Review (issue 34): a server full of peers refuses a connection with an error frame and closes it; the
    replies' thread took that frame for the reply to a call still going out, went idle, and the sending thread
    waited for it forever (close() too). Now the call fails, the next ones too, and close() is prompt."""
    limits = FrameLimits.for_model(16 << 20)
    full = StreamServer("127.0.0.1", lambda method, args: "ok", SECRET, limits, 0.5, max_peers=1)
    offer = StreamOffer("127.0.0.1", full.port, SECRET, limits)
    first = StreamClient(offer, 0.5, "the full server")
    second = StreamClient(offer, 0.5, "the full server")  # proven, then refused: its peer's slot stays taken
    try:
        assert first.call("echo").wait() == "ok"
        time.sleep(2.0)
        pushed, later = second.call("push", torch.zeros(4 << 20)), second.call("echo")
        assert _soon(pushed, 8.0) and _soon(later, 8.0)
        for future in (pushed, later):
            with pytest.raises(RuntimeError, match="the stream (to the full server|takes 1 connections)"):
                future.wait()
        started = time.monotonic()
        second.close()
        assert time.monotonic() - started < 2.0 and not second._thread.is_alive()
    finally:
        first.close()
        second.close()
        full.close()


def test_an_answer_that_cannot_be_written_ends_its_connection_with_a_warning(caplog, monkeypatch):
    """Review (issue 34): an error other than the connection's ended the answering thread silently, half-way through
    a frame, the connection left open: the learner waited for the timeout and read it as half-open. It is logged, the
    connection closes, and the call ends."""
    send = frames._send

    def failing(sock, data):  # the answer's megabyte, not the call's few bytes
        if len(data) > 100_000:
            raise RuntimeError("the test's failing write")
        send(sock, data)

    monkeypatch.setattr(frames, "_send", failing)
    odd = StreamServer("127.0.0.1", lambda method, args: torch.zeros(1 << 18), SECRET, LIMITS, 2.0, 4)
    client = StreamClient(StreamOffer("127.0.0.1", odd.port, SECRET, LIMITS), 2.0, "the odd server")
    try:
        with pytest.raises(RuntimeError, match="the stream to the odd server"):
            client.call("weights").wait()
        assert "a stream connection ended on an unexpected error" in caplog.text
    finally:
        client.close()
        odd.close()


def test_a_tensor_whose_bytes_cannot_be_read_fails_its_own_call_only(server):
    """Review (issue 34): a conjugate view's bytes cannot be read; the error came half-way through sending the
    frame and ended the stream, every later call with it. It now comes before anything is sent."""
    client = _client(server)
    try:
        with pytest.raises(RuntimeError, match="echo cannot be sent to the test's server: .*conjugate"):
            client.call("echo", torch.ones(2, dtype=torch.cfloat).conj()).wait()
        assert client.call("echo", "after").wait() == ("after",)
    finally:
        client.close()
