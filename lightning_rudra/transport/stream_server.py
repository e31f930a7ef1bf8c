"""The server's side of the stream (:mod:`lightning_rudra.transport.stream`): who may connect, and calls answered
in order, once each, whatever connection of their session carries them."""

import hmac
import logging
import secrets
import socket
import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Optional

import torch

from lightning_rudra.transport.frames import (
    DecodeError,
    Frame,
    FrameError,
    FrameLimits,
    recv_frame,
    send_keepalive,
)
from lightning_rudra.transport.stream import (
    MAGIC,
    NONCE,
    PROOF_SIZE,
    SESSION,
    StreamOffer,
    handshake_proof,
    keep_alive,
    keepalive_interval,
    read_exactly,
)

log = logging.getLogger(__name__)

# the answer to a connection beyond max_peers
_FULL = "connections at once (two per learner), and has as many: this one is refused"
_HANDSHAKES = 8  # connections at once that have not proved themselves yet: the rest are closed at once
_HANDSHAKES_PER_SOURCE = 2  # of those, from one address: a stranger's loop of connections leaves room for learners
_HANDSHAKE_S = 10.0  # the most a connection has to prove itself, all its handshake's bytes together


class _Session:
    """A client's calls as the server saw them: the number of the last, and its reply once made (kept until the next
    call shows it arrived)."""

    def __init__(self) -> None:
        self.number = 0
        self.replied = threading.Event()
        self.reply: Optional[Frame] = None
        self.connection: Optional[socket.socket] = None  # the newest: an older one is broken, its client says

    def begin(self, number: int) -> None:
        self.number, self.replied, self.reply = number, threading.Event(), None

    def settle(self, reply: Frame) -> None:
        self.reply = reply
        self.replied.set()


class StreamServer:
    """Listens on ``address`` (one address, a free port): a connection proves it knows ``secret``, then its calls
    are answered in order on a thread of its own: ``answer(method, args)`` gives a value or a future, whose value goes
    back (a raised exception as a :class:`ServerError`; a future is waited for with a keepalive frame every
    ``timeout / 4`` seconds, at most 5). A call sent again on a new connection of its session gets the reply made
    to it, not a second run. ``limits``: the largest frame taken; ``max_peers``: connections at once that proved
    themselves (a learner per server, with room for a lost one's)."""

    def __init__(
        self,
        address: str,
        answer: Callable[[str, tuple], Any],
        secret: bytes,
        limits: FrameLimits,
        timeout: float,
        max_peers: int,
    ) -> None:
        if not address or address in ("0.0.0.0", "::"):
            raise ValueError(
                f"the stream listens on the one address the learners reach this host at, never on every interface: "
                f"got {address!r}"
            )
        self.answer = answer
        self.secret = secret
        self.limits = limits
        self.timeout = timeout
        self.sock = socket.create_server((address, 0), family=socket.AF_INET6 if ":" in address else socket.AF_INET)
        self.port: int = self.sock.getsockname()[1]
        self.max_peers = max_peers
        self._peers = threading.BoundedSemaphore(max_peers)
        self._lock = threading.Lock()
        self._unproven: dict[str, int] = {}  # source address -> its connections in their handshake
        # the sessions of the clients that proved themselves, the least recently used first: as many as connections
        # may be open, and as many again of clients gone (a lost learner's)
        self._sessions: OrderedDict[bytes, _Session] = OrderedDict()
        threading.Thread(target=self._accept, name="rudra-stream-accept", daemon=True).start()

    def offer(self) -> StreamOffer:
        return StreamOffer(self.sock.getsockname()[0], self.port, self.secret, self.limits)

    def _accept(self) -> None:
        while True:
            try:
                conn, peer = self.sock.accept()
            except OSError:
                if self.sock.fileno() == -1:  # closed
                    return
                time.sleep(0.1)  # out of file descriptors, say: the learners' connections may free some
                continue
            source = str(peer[0])
            with self._lock:
                admitted = (
                    sum(self._unproven.values()) < _HANDSHAKES
                    and self._unproven.get(source, 0) < _HANDSHAKES_PER_SOURCE
                )
                if admitted:
                    self._unproven[source] = self._unproven.get(source, 0) + 1
            if not admitted:
                conn.close()  # more strangers than learners could need: they wait for nothing
                continue
            try:
                threading.Thread(target=self._serve, args=(conn, source), name="rudra-stream", daemon=True).start()
            except RuntimeError:  # no thread to be had
                self._proven(source)
                conn.close()

    def _proven(self, source: str) -> None:
        """A connection from ``source`` is out of its handshake, one way or the other."""
        with self._lock:
            self._unproven[source] -= 1
            if not self._unproven[source]:
                del self._unproven[source]

    def _serve(self, conn: socket.socket, source: str) -> None:
        """One connection, however it ends: nothing escapes this thread."""
        with conn:
            try:
                try:
                    conn.settimeout(self.timeout)
                    keep_alive(conn, keepalive_interval(self.timeout))
                    session = self._handshake(conn)
                finally:
                    self._proven(source)
                if session is None:
                    return
                if not self._peers.acquire(blocking=False):
                    error = ("error", "RuntimeError", f"the stream takes {self.max_peers} {_FULL}")
                    self._encode("a call", error).send(conn)
                    return
                try:
                    self._calls(conn, session)
                finally:
                    self._peers.release()
            except (OSError, EOFError):  # the learner left or was lost, or a stranger hung up
                return
            except BaseException as error:
                log.warning("lightning_rudra: a stream connection ended on an unexpected error: %r", error)

    def _handshake(self, conn: socket.socket) -> Optional[_Session]:
        """The session of a peer that proved it knows the secret (it then gets the server's proof); None for one
        that did not. Reads a fixed 88 bytes."""
        challenge = secrets.token_bytes(NONCE)
        conn.sendall(MAGIC + challenge)
        size = len(MAGIC) + NONCE + SESSION + PROOF_SIZE
        said = read_exactly(conn, size, time.monotonic() + min(self.timeout, _HANDSHAKE_S))
        conn.settimeout(self.timeout)  # a proven peer's calls: bounded per step again, as before the handshake
        magic, answer, shown = said[: len(MAGIC)], said[len(MAGIC) : -PROOF_SIZE], said[-PROOF_SIZE:]
        if magic != MAGIC or not hmac.compare_digest(
            shown, handshake_proof(self.secret, b"learner", challenge, answer)
        ):
            return None
        conn.sendall(handshake_proof(self.secret, b"server", answer, challenge))
        name = answer[NONCE:]
        with self._lock:
            session = self._sessions.pop(name, None) or _Session()
            self._sessions[name] = session
            if len(self._sessions) > 2 * self.max_peers:
                self._sessions.popitem(last=False)
            broken, session.connection = session.connection, conn
        if broken is not None:  # its thread ends now rather than when TCP's keepalive gives up on it
            try:
                broken.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return session

    def _calls(self, conn: socket.socket, session: _Session) -> None:
        while True:
            try:
                call = recv_frame(conn, self.limits, patient=True)
            except DecodeError as error:  # read whole, so in step: the session's next call. Say why, and go on
                reply = self._encode(
                    "a call", ("error", "RuntimeError", f"the server could not decode a call: {error}")
                )
                session.begin(session.number + 1)
                session.settle(reply)
                reply.send(conn)
                continue
            except FrameError as error:  # out of step: say why before closing (the peer may still read it)
                self._encode("a call", ("error", "RuntimeError", str(error))).send(conn)
                raise
            if not (isinstance(call, tuple) and len(call) > 1 and type(call[0]) is int and isinstance(call[1], str)):
                self._encode("a call", ("error", "ValueError", "a call is (number, method, *args)")).send(conn)
                continue
            number, method, *args = call
            if number == session.number + 1:
                session.begin(number)
                self._start(session, method, tuple(args))
            elif number != session.number or not number:  # numbered one by one from 1, whatever the connection
                why = f"call {number} out of order: the last call of this learner's session was {session.number}"
                self._encode(method, ("error", "RuntimeError", why)).send(conn)
                continue
            # a number seen already: sent again after its connection broke, answered with the reply made to it
            while not session.replied.wait(keepalive_interval(self.timeout)):
                send_keepalive(conn)  # the learner learns the server is alive (an OSError here: the connection is gone)
            assert session.reply is not None
            session.reply.send(conn)

    def _start(self, session: _Session, method: str, args: tuple) -> None:
        """Run a call; its reply settles ``session`` whenever it is made, whatever becomes of the connection."""
        try:
            value = self.answer(method, args)
        except BaseException as error:
            session.settle(self._encode(method, ("error", type(error).__name__, str(error))))
            return
        # Future.then gives torch's C future, which torch.futures.Future only derives from
        if not isinstance(value, torch._C.Future):
            session.settle(self._encode(method, ("ok", value)))
            return

        def settle(done: Any) -> None:
            reply: tuple
            try:
                reply = ("ok", done.wait())
            except BaseException as error:
                reply = ("error", type(error).__name__, str(error))
            session.settle(self._encode(method, reply))

        value.add_done_callback(settle)

    @staticmethod
    def _encode(method: str, reply: tuple) -> Frame:
        try:
            return Frame.encode(reply)
        except Exception as error:  # nothing was sent yet (a frame is pickled whole first): say why instead
            return Frame.encode(("error", "RuntimeError", f"the server's reply to {method} cannot be sent: {error}"))

    def close(self) -> None:
        self.sock.close()
