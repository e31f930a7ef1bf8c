"""Pushes to a server on another host over a TCP connection of their own: the tensors' bytes go straight to the
socket, the rest of the call pickled beside them (:mod:`lightning_rudra.transport.frames`). RPC (TensorPipe) carries
everything else.

Why: across a link shaped to 1 Gbit/s, a learner and a server that each push 20 MB to the other and answer with
20 MB took 0.52-0.60 s through TensorPipe, against 0.33 s on plain sockets in the same pattern (the link's own
time: 40 MB each way), measured side by side on this project's 2-core machine. A connection carries one call at a
time, in order; the learner's side sends and receives on a thread of its own, so that a push returns a future at
once, as an RPC does. Nothing here knows about the parameter server: a call is ``(method, *args)``.

Who may talk: the server hands a secret of its own to the learners that ask for the stream through RPC
(:class:`StreamOffer`); a connection proves it knows it (an HMAC of the other side's random challenge, both ways)
before anything of it is unpickled, and until then the server reads only the fixed-size handshake. Errors travel as
their type's name and message (:class:`ServerError`), never as pickled exceptions.
"""

import hashlib
import hmac
import logging
import math
import queue
import secrets
import socket
import threading
import time
from typing import Any, Callable, NamedTuple, Optional

import torch
from torch.futures import Future

from lightning_rudra.transport.frames import (
    KEEPALIVE,
    DecodeError,
    Frame,
    FrameError,
    FrameLimits,
    recv_frame,
    send_keepalive,
)

log = logging.getLogger(__name__)

_MAGIC = b"rudra-s1"  # the protocol and its version, first on the wire both ways
_NONCE = 32
_PROOF = hashlib.sha256().digest_size
# the answer to a connection beyond max_peers
_FULL = "connections at once (two per learner), and has as many: this one is refused"
_HANDSHAKES = 8  # connections at once that have not proved themselves yet: the rest are closed at once
_HANDSHAKE_S = 10.0  # the most a connection has to prove itself, all its handshake's bytes together


class StreamOffer(NamedTuple):
    """Where a server takes pushes over the stream, the secret that proves a connection belongs to the run, and
    the largest frame either side sends."""

    address: str
    port: int
    secret: bytes
    limits: FrameLimits


class ServerError(RuntimeError):
    """An error a call was answered with, as its type's name and its message. RuntimeError: the learner's error
    handling treats it as any error of the server's (:mod:`lightning_rudra.learner.client`)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message if kind == "RuntimeError" else f"{kind}: {message}")
        self.kind = kind


def _proof(secret: bytes, role: bytes, challenge: bytes, answer: bytes) -> bytes:
    return hmac.new(secret, role + challenge + answer, hashlib.sha256).digest()


def _keep_alive(sock: socket.socket, seconds: float) -> None:
    """TCP keepalive: a peer gone without a word (a host switched off, a NAT entry dropped) ends the connection
    after about ``seconds`` of silence plus four probes as far apart."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option, value in (("TCP_KEEPIDLE", seconds), ("TCP_KEEPINTVL", seconds), ("TCP_KEEPCNT", 4)):
        if hasattr(socket, option):  # Linux; elsewhere the system's defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), max(1, int(value)))


def _interval(timeout: float) -> float:
    """How often a side that waits says it is alive: four times within the other side's ``timeout``."""
    return max(0.05, min(5.0, timeout / 4))


def _exactly(sock: socket.socket, count: int, deadline: float = math.inf) -> bytes:
    """``count`` bytes of the handshake, all of them before ``deadline`` (``time.monotonic()``): a peer that sends
    a byte now and then holds its connection no longer than one that sends nothing."""
    data = b""
    while len(data) < count:
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("the handshake took too long")
        if left != math.inf:
            sock.settimeout(min(left, sock.gettimeout() or left))
        piece = sock.recv(count - len(data))
        if not piece:
            raise ConnectionError("the connection closed (end of file) during the handshake")
        data += piece
    return data


class StreamServer:
    """Listens on ``address`` (one address, a free port): a connection proves it knows ``secret``, then its calls
    are answered in order on a thread of its own: ``answer(method, args)`` gives a value or a future, whose value goes
    back (a raised exception as a :class:`ServerError`; a future is waited for with a keepalive frame every
    ``timeout / 4`` seconds, at most 5). ``limits``: the largest frame taken; ``max_peers``: connections at once
    that proved themselves (a learner per server, with room for a lost one's)."""

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
        self._handshakes = threading.BoundedSemaphore(_HANDSHAKES)
        self.max_peers = max_peers
        self._peers = threading.BoundedSemaphore(max_peers)
        threading.Thread(target=self._accept, name="rudra-stream-accept", daemon=True).start()

    def offer(self) -> StreamOffer:
        return StreamOffer(self.sock.getsockname()[0], self.port, self.secret, self.limits)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                if self.sock.fileno() == -1:  # closed
                    return
                time.sleep(0.1)  # out of file descriptors, say: the learners' connections may free some
                continue
            if not self._handshakes.acquire(blocking=False):
                conn.close()  # more strangers than learners could need: they wait for nothing
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), name="rudra-stream", daemon=True).start()
            except RuntimeError:  # no thread to be had
                self._handshakes.release()
                conn.close()

    def _serve(self, conn: socket.socket) -> None:
        """One connection, however it ends: nothing escapes this thread."""
        with conn:
            try:
                try:
                    conn.settimeout(self.timeout)
                    _keep_alive(conn, _interval(self.timeout))
                    proved = self._handshake(conn)
                finally:
                    self._handshakes.release()
                if not proved:
                    return
                if not self._peers.acquire(blocking=False):
                    self._reply(conn, "a call", ("error", "RuntimeError", f"the stream takes {self.max_peers} {_FULL}"))
                    return
                try:
                    self._calls(conn)
                finally:
                    self._peers.release()
            except (OSError, EOFError):  # the learner left or was lost, or a stranger hung up
                return
            except BaseException as error:
                log.warning("lightning_rudra: a stream connection ended on an unexpected error: %r", error)

    def _handshake(self, conn: socket.socket) -> bool:
        """Whether the peer proved it knows the secret; it then gets the server's proof. Reads a fixed 72 bytes."""
        challenge = secrets.token_bytes(_NONCE)
        conn.sendall(_MAGIC + challenge)
        said = _exactly(conn, len(_MAGIC) + _NONCE + _PROOF, time.monotonic() + min(self.timeout, _HANDSHAKE_S))
        conn.settimeout(self.timeout)  # a proven peer's calls: bounded per step again, as before the handshake
        magic, answer, proof = said[: len(_MAGIC)], said[len(_MAGIC) : -_PROOF], said[-_PROOF:]
        if magic != _MAGIC or not hmac.compare_digest(proof, _proof(self.secret, b"learner", challenge, answer)):
            return False
        conn.sendall(_proof(self.secret, b"server", answer, challenge))
        return True

    def _calls(self, conn: socket.socket) -> None:
        while True:
            try:
                call = recv_frame(conn, self.limits, patient=True)
            except DecodeError as error:  # read whole: say why, and go on
                self._reply(conn, "a call", ("error", "RuntimeError", f"the server could not decode a call: {error}"))
                continue
            except FrameError as error:  # out of step: say why before closing (the peer may still read it)
                self._reply(conn, "a call", ("error", "RuntimeError", str(error)))
                raise
            if not (isinstance(call, tuple) and call and isinstance(call[0], str)):
                self._reply(conn, "a call", ("error", "ValueError", f"a call is (method, *args), not {type(call)}"))
                continue
            method, *args = call
            self._reply(conn, method, self._answer(conn, method, tuple(args)))

    def _answer(self, conn: socket.socket, method: str, args: tuple) -> tuple:
        """The reply to a call. A future is waited for with a keepalive frame now and then, which tells the learner
        the server is alive (an OSError there: the connection is gone)."""
        try:
            value = self.answer(method, args)
        except BaseException as error:
            return ("error", type(error).__name__, str(error))
        # Future.then gives torch's C future, which torch.futures.Future only derives from
        if isinstance(value, torch._C.Future):
            done = threading.Event()
            value.add_done_callback(lambda _: done.set())
            while not done.wait(_interval(self.timeout)):
                send_keepalive(conn)
            try:
                value = value.wait()
            except BaseException as error:
                return ("error", type(error).__name__, str(error))
        return ("ok", value)

    def _reply(self, conn: socket.socket, method: str, reply: tuple) -> None:
        try:
            frame = Frame.encode(reply)
        except Exception as error:  # nothing was sent yet (a frame is pickled whole first): say why instead
            frame = Frame.encode(("error", "RuntimeError", f"the server's reply to {method} cannot be sent: {error}"))
        frame.send(conn)

    def close(self) -> None:
        self.sock.close()


class StreamClient:
    """A learner's connection to the :class:`StreamServer` of ``offer`` (connecting and the handshake wait
    ``timeout`` seconds at most). :meth:`call` returns a future at once; the calls go in order. A reply may take as
    long as the call does (a hardsync round): the server sends a keepalive frame meanwhile, and a connection that
    stays silent for ``timeout`` (half-open: a dropped NAT entry, a firewall that lets RPC through but not this port)
    fails the call, naming the server. Every call ends, with its value or an error, whatever ends the connection."""

    def __init__(self, offer: StreamOffer, timeout: float, what: str) -> None:
        self.what = what  # for messages: "parameter server 1 (on 10.0.0.2)"
        self.timeout = timeout
        self.limits = offer.limits
        self.sock = socket.create_connection((offer.address, offer.port), timeout=timeout)
        try:
            _keep_alive(self.sock, _interval(timeout))
            self._handshake(offer.secret)
        except BaseException:
            self.sock.close()
            raise
        self._lock = threading.Lock()
        self._closed: Optional[str] = None  # why, once no call can go through any more
        self._calls: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="rudra-stream-client", daemon=True)
        self._thread.start()
        log.debug("stream to %s at %s:%d opened", what, offer.address, offer.port)

    def _handshake(self, secret: bytes) -> None:
        said = _exactly(self.sock, len(_MAGIC) + _NONCE)
        if said[: len(_MAGIC)] != _MAGIC:
            raise ConnectionError(f"what listens there is not the stream of {self.what}")
        challenge, answer = said[len(_MAGIC) :], secrets.token_bytes(_NONCE)
        self.sock.sendall(_MAGIC + answer + _proof(secret, b"learner", challenge, answer))
        try:
            proof = _exactly(self.sock, _PROOF)
        except ConnectionError as error:
            raise ConnectionError(f"{self.what} refused this learner's proof that it belongs to the run") from error
        if not hmac.compare_digest(proof, _proof(secret, b"server", answer, challenge)):
            raise ConnectionError(f"what listens there could not prove it is {self.what} (it does not know the secret)")

    def call(self, method: str, *args: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed is None:
                self._calls.put(((method, *args), future))
                return future
            why = self._closed
        future.set_exception(RuntimeError(f"the stream to {self.what} closed: {why}"))
        return future

    def _run(self) -> None:
        current: Optional[Future] = None
        why = "this learner closed it"
        try:
            while True:
                item = self._calls.get()
                if item is None:
                    return
                request, current = item
                self._call(request, current)
                current = None
        except socket.timeout:
            why = (
                f"nothing moved on it for {self.timeout:g} s (rpc_timeout) while a call waited (a half-open "
                "connection: a dropped NAT entry, a firewall that lets RPC through but not the stream's port?)"
            )
            if current is not None:  # the call that waited: worded as RPC's own timeouts are (learner/client.py)
                current.set_exception(RuntimeError(f"the stream to {self.what} timed out: {why}"))
        except BaseException as error:
            why = str(error) or type(error).__name__
        finally:
            with self._lock:
                self._closed = why
                pending = [current]
                while not self._calls.empty():
                    item = self._calls.get_nowait()
                    pending.append(item[1] if item is not None else None)
            for future in pending:
                if future is not None and not future.done():
                    future.set_exception(RuntimeError(f"the stream to {self.what} closed: {why}"))

    def _call(self, request: tuple, future: Future) -> None:
        """One call: its future ends here, or the error raised (the connection unusable) ends it."""
        method = request[0]
        try:
            frame = Frame.encode(request)
        except Exception as error:
            future.set_exception(RuntimeError(f"{method} cannot be sent to {self.what}: {error}"))
            return
        frame.send(self.sock)
        while True:
            try:
                reply = recv_frame(self.sock, self.limits)
            except DecodeError as error:
                future.set_exception(
                    RuntimeError(f"the reply of {self.what} to {method} could not be decoded: {error}")
                )
                return
            if reply is not KEEPALIVE:
                break
        if isinstance(reply, tuple) and len(reply) == 2 and reply[0] == "ok":
            future.set_result(reply[1])
        elif isinstance(reply, tuple) and len(reply) == 3 and reply[0] == "error":
            future.set_exception(ServerError(str(reply[1]), str(reply[2])))
        else:
            raise ConnectionError(f"{self.what} answered {method} with something that is not a reply")

    def close(self) -> None:
        """Stop: a call in progress fails (its socket is shut), later ones too."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        self._calls.put(None)
        self._thread.join(timeout=5.0)
