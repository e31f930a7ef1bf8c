"""The server's side of the stream (:mod:`lightning_rudra.transport.stream`): who may connect, and calls answered
in order, once each, whatever connection of their session carries them: read on one thread, answered on another."""

import hmac
import logging
import secrets
import socket
import threading
import time
from typing import Any, Callable, Optional, Union

import torch

from lightning_rudra.transport.frames import (
    DecodeError,
    Frame,
    FrameError,
    FrameLimits,
    recv_frame,
    recv_number,
    send_keepalive,
)
from lightning_rudra.transport.stream_pieces import ABANDONED, PIECE, Assembly
from lightning_rudra.transport.stream_session import Answers, Session
from lightning_rudra.transport.stream import (
    IN_FLIGHT,
    MAGIC,
    NONCE,
    PROOF_SIZE,
    RESENT,
    SESSION,
    StreamOffer,
    handshake_proof,
    keep_alive,
    keepalive_interval,
    read_exactly,
    shut,
)

log = logging.getLogger(__name__)

# the answer to a connection beyond max_peers
_FULL = "connections at once (two per learner), and has as many: this one is refused"
_HANDSHAKES = 8  # connections at once that have not proved themselves yet: the rest are closed at once
_HANDSHAKES_PER_SOURCE = 2  # of those, from one address: a stranger's loop of connections leaves room for learners
_SENT_BY_THE_READER = 64 << 10  # an answer of at most these bytes, made at once, goes out from the reading thread
_HANDSHAKE_S = 10.0  # the most a connection has to prove itself, all its handshake's bytes together


class StreamServer:
    """Listens on ``address`` (one address, a free port): a connection proves it knows ``secret``, then its calls
    are answered in order on a thread of its own: ``answer(method, args)`` gives a value or a future, whose value goes
    back (a raised exception as a :class:`ServerError`; a future is waited for with a keepalive frame every
    ``timeout / 4`` seconds, at most 5). A call sent again on a new connection of its session gets the reply made
    to it, not a second run; a session whose connection has been gone for twice ``timeout`` (its client has given
    up) is forgotten. ``limits``: the largest frame taken; ``max_peers``: connections at once that proved
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
        self._sessions: dict[bytes, Session] = {}
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
                    name = self._handshake(conn)
                finally:
                    self._proven(source)
                if name is not None:
                    self._serve_session(conn, name)
            except (OSError, EOFError):  # the learner left or was lost, or a stranger hung up
                return
            except BaseException as error:
                log.warning("lightning_rudra: a stream connection ended on an unexpected error: %r", error)

    def _serve_session(self, conn: socket.socket, name: bytes) -> None:
        """The calls of session ``name`` on ``conn``, its newest connection: an older one is broken, its client
        says, and its thread ends first (freeing its peer slot). A connection refused leaves no session."""
        self._replace(name, None)
        if not self._peers.acquire(timeout=min(self.timeout, _HANDSHAKE_S)):
            self._refuse(conn, f"the stream takes {self.max_peers} {_FULL}")
            return
        try:
            with self._lock:
                session = self._sessions.setdefault(name, Session())
            self._replace(name, conn)
            with session.changed:  # one thread serves a session at a time
                session.changed.wait_for(lambda: not session.busy or session.connection is not conn, self.timeout)
                if session.connection is not conn or session.busy:  # a newer one came, or the older never ended
                    return
                session.busy = True
            try:
                self._calls(conn, session)
            finally:
                with session.changed:
                    session.busy = False
                    if session.connection is conn:
                        session.connection = None
                        session.idle_since = time.monotonic()
                    session.changed.notify_all()
        finally:
            self._forget_idle()
            self._peers.release()

    def _replace(self, name: bytes, conn: Optional[socket.socket]) -> None:
        """``conn`` serves session ``name`` from now on (None: none yet): the connection it had ends now, rather
        than when TCP finds out."""
        with self._lock:
            session = self._sessions.get(name)
        if session is None:
            return
        with session.changed:
            replaced, session.connection = session.connection, conn
            session.idle_since = time.monotonic()  # in use: not to be forgotten while the new connection comes
            session.changed.notify_all()  # its thread, if it waits for a reply, stops waiting
        if replaced is not None and replaced is not conn:
            shut(replaced)

    def _forget_idle(self) -> None:
        """Forget the sessions whose connection ended over twice ``timeout`` ago: their clients gave up."""
        now = time.monotonic()
        with self._lock:
            for gone in [
                key
                for key, session in self._sessions.items()
                if session.connection is None and not session.busy and now - session.idle_since > 2 * self.timeout
            ]:
                del self._sessions[gone]

    def _handshake(self, conn: socket.socket) -> Optional[bytes]:
        """The session's name of a peer that proved it knows the secret (it then gets the server's proof); None for
        one that did not. Reads a fixed 88 bytes."""
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
        return answer[NONCE:]

    def _refuse(self, conn: socket.socket, why: str) -> None:
        """Say ``why`` and close, letting the peer read it: what it still sends is read and dropped for a while
        (closing with unread bytes would reset the connection, and the answer with it)."""
        self._encode("a call", ("error", "RuntimeError", why)).send(conn)
        conn.shutdown(socket.SHUT_WR)
        deadline = time.monotonic() + min(self.timeout, _HANDSHAKE_S)
        while time.monotonic() < deadline:
            conn.settimeout(max(0.01, deadline - time.monotonic()))
            if not conn.recv(1 << 16):
                return

    def _calls(self, conn: socket.socket, session: Session) -> None:
        """Read the calls of ``conn`` and run each new one, while a thread of its own answers them in the order they
        came (:meth:`_answers`)."""
        line = Answers()
        answering = threading.Thread(
            target=self._answers, args=(conn, session, line), name="rudra-stream-answers", daemon=True
        )
        answering.start()

        def stop_answering() -> bool:
            """Whether the answering thread ended: it wakes at once, or within one send's ``timeout``."""
            line.ended.set()
            with session.changed:
                session.changed.notify_all()
            answering.join(self.timeout)
            return not answering.is_alive()

        try:
            self._read_calls(conn, session, line)
        except FrameError as error:  # out of step: say why (the peer may still read it) and close
            if stop_answering():  # first: one thread writes at a time
                self._refuse(conn, str(error))
            raise
        finally:
            if not stop_answering():  # still sending to a peer that reads nothing: the connection is over
                shut(conn)  # its send fails at once
                answering.join(self.timeout)

    def _read_calls(self, conn: socket.socket, session: Session, line: Answers) -> None:
        def over() -> bool:
            return line.ended.is_set() or session.connection is not conn

        while True:
            with session.changed:  # a client that does not read its answers is not read either (TCP holds it)
                session.changed.wait_for(lambda: len(line.due) < IN_FLIGHT or over())
                if over():
                    return
            number, call = self._read_call(conn)
            resent, number = bool(number & RESENT), number & ~RESENT
            with session.changed:
                last = session.number
                # numbered one by one from 1, whatever the connection; a session forgotten here (its learner idle
                # past twice the timeout) goes on with its next call
                fresh = number == last + 1 or (not last and not resent and number > 0)
                kept = resent and number in session.replies
                if fresh:
                    session.begin(number)
            answer: Union[int, Frame] = number
            if fresh:
                self._start(session, number, call)
            elif not kept:  # a number seen already is sent again after its connection broke: the reply made to it
                why = (
                    f"the server no longer keeps the reply to call {number}, sent again: its session was forgotten"
                    if resent and not last
                    else f"call {number} out of order: the last call of this learner's session was {last}"
                )
                answer = self._encode("a call", ("error", "RuntimeError", why))
            with session.changed:
                made = answer if isinstance(answer, Frame) else session.replies.get(answer)
                # small, made at once, nothing before it: sent from here, a thread's wake-up sooner (a push's control
                # on the server's own host); else by the answering thread, in order, while this one reads on
                now = made is not None and made.size() <= _SENT_BY_THE_READER and not line.due and not line.writing
                if now:
                    line.writing = True
                else:
                    line.due.append(answer)
                    session.changed.notify_all()
            if now:
                assert made is not None
                try:
                    made.send(conn)
                finally:
                    with session.changed:
                        line.writing = False
                        session.changed.notify_all()

    def _read_call(self, conn: socket.socket) -> tuple[int, Any]:
        """The next call's number and the call, its pieces first if it came in pieces (a :class:`DecodeError` where
        it cannot be run: read whole all the same, so in step)."""
        number = recv_number(conn)
        pieces = Assembly(self.limits) if number & PIECE else None
        while number & PIECE:
            pieces.add(self._frame(conn))  # type: ignore[union-attr]
            # patient, as between calls: the learner's backward pass makes the next piece; a dead learner's host is
            # noticed by the connection's TCP keepalive, which ends the connection and drops the pieces
            following = recv_number(conn)
            if following & ~(PIECE | RESENT) != number & ~(PIECE | RESENT):  # RESENT: until the break's last piece
                raise FrameError(
                    f"a piece of call {number & ~(PIECE | RESENT)} followed by call {following & ~(PIECE | RESENT)}"
                )
            number = following
        call = self._frame(conn)
        return number, call if pieces is None or isinstance(call, DecodeError) else pieces.fill(call)

    def _frame(self, conn: socket.socket) -> Any:
        try:
            return recv_frame(conn, self.limits)
        except DecodeError as error:  # read whole, so in step
            return error

    def _answers(self, conn: socket.socket, session: Session, line: Answers) -> None:
        """Send the answers due on ``conn`` in order, each once made, with a keepalive frame while one is awaited
        that tells the learner the server is alive; until ``conn`` ends or no longer serves the session."""
        due = line.due

        def ready() -> bool:
            if line.ended.is_set() or session.connection is not conn:
                return True
            # a number forgotten meanwhile is answered at once (a client out of step: it sent more than it may)
            head_made = bool(due) and (isinstance(due[0], Frame) or session.replies.get(due[0], due[0]) is not None)
            return head_made and not line.writing

        try:
            while True:
                with session.changed:
                    made = session.changed.wait_for(ready, keepalive_interval(self.timeout))
                    if line.ended.is_set() or session.connection is not conn:
                        return
                    if line.writing or not (made or due):  # the reading writes an answer, or nothing is awaited
                        continue
                    reply = None
                    if made:
                        head = due.popleft()
                        reply = head if isinstance(head, Frame) else session.replies.get(head)
                        if reply is None:
                            why = f"the server no longer keeps the reply to call {head}: more than {IN_FLIGHT} waited"
                            reply = self._encode("a call", ("error", "RuntimeError", why))
                    line.writing = True
                try:
                    if reply is not None:
                        reply.send(conn)
                    else:
                        send_keepalive(conn)
                finally:
                    with session.changed:
                        line.writing = False
                        session.changed.notify_all()  # the reading may go on (it waits for room, or to write)
        except BaseException as error:  # the connection is gone, or cannot be written in step: its reading ends too
            if not isinstance(error, OSError):
                log.warning("lightning_rudra: a stream connection ended on an unexpected error: %r", error)
            shut(conn)
        finally:
            line.ended.set()
            with session.changed:
                session.changed.notify_all()

    def _start(self, session: Session, number: int, call: Any) -> None:
        """Run call ``number``; its reply settles ``session`` whenever it is made, whatever becomes of the
        connection."""
        if isinstance(call, DecodeError):
            session.settle(
                number, self._encode("a call", ("error", "RuntimeError", f"the server could not decode a call: {call}"))
            )
            return
        if not (isinstance(call, tuple) and call and isinstance(call[0], str)):
            why = f"a call is (method, *args), not {type(call).__name__}"
            session.settle(number, self._encode("a call", ("error", "ValueError", why)))
            return
        method, *args = call
        if call == ABANDONED:  # a call in pieces its learner never finished
            session.settle(number, self._encode(method, ("ok", None)))
            return
        try:
            value = self.answer(method, tuple(args))
        except BaseException as error:
            session.settle(number, self._encode(method, ("error", type(error).__name__, str(error))))
            return
        # Future.then gives torch's C future, which torch.futures.Future only derives from
        if not isinstance(value, torch._C.Future):
            session.settle(number, self._encode(method, ("ok", value)))
            return

        def settle(done: Any) -> None:
            reply: tuple
            try:
                reply = ("ok", done.wait())
            except BaseException as error:
                reply = ("error", type(error).__name__, str(error))
            session.settle(number, self._encode(method, reply))

        value.add_done_callback(settle)

    @staticmethod
    def _encode(method: str, reply: tuple) -> Frame:
        try:
            return Frame.encode(reply)
        except Exception as error:  # nothing was sent yet (a frame is pickled whole first): say why instead
            return Frame.encode(("error", "RuntimeError", f"the server's reply to {method} cannot be sent: {error}"))

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes the thread in accept(), which close alone would not
        except OSError:
            pass
        self.sock.close()
