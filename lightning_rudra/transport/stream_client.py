"""The learner's side of the stream (:mod:`lightning_rudra.transport.stream`): calls sent in order on a thread of
its own, through broken connections, each answered once."""

import hmac
import logging
import queue
import secrets
import socket
import threading
import time
from typing import Any, Optional

from torch.futures import Future

from lightning_rudra.transport.frames import (
    KEEPALIVE,
    DecodeError,
    Frame,
    FrameError,
    recv_frame,
)
from lightning_rudra.transport.stream import (
    MAGIC,
    NONCE,
    PROOF_SIZE,
    RESENT,
    SESSION,
    ServerError,
    StreamOffer,
    keep_alive,
    keepalive_interval,
    handshake_proof,
    read_exactly,
)

log = logging.getLogger(__name__)


_CONNECT_S = 2.0  # the longest a try at connecting takes


class _Refused(ConnectionError):
    """A connection the other side turned down for good (a proof refused or not given): trying again cannot help."""


class _GaveUp(ConnectionError):
    """The stream broke and could not be opened again: ``timed_out`` when time ran out (the host may be cut off),
    rather than a server that no longer listens or refuses."""

    def __init__(self, message: str, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class StreamClient:
    """A learner's connection to the :class:`StreamServer` of ``offer`` (connecting and the handshake wait
    ``timeout`` seconds at most). :meth:`call` returns a future at once; the calls go in order. A reply may take as
    long as the call does (a hardsync round): the server sends a keepalive frame meanwhile, and a connection that
    stays silent for ``timeout`` (half-open: a dropped NAT entry, a firewall that lets RPC through but not this port)
    fails the call, naming the server. A connection that breaks is opened again, and the call in progress sent again
    (the server runs it once), for ``timeout`` seconds at most from the first break; a server that no longer listens
    ends it at once. Every call ends, with its value or an error, whatever ends the connection."""

    def __init__(self, offer: StreamOffer, timeout: float, what: str) -> None:
        self.what = what  # for messages: "parameter server 1 (on 10.0.0.2)"
        self.timeout = timeout
        self.offer = offer
        self.session = secrets.token_bytes(SESSION)
        self._closing = False
        self._opening: Optional[socket.socket] = None  # the connection being opened, if one is
        self.sock = self._open(time.monotonic() + timeout)
        self._sent = 0  # calls sent in this session: each goes with its number
        self._lock = threading.Lock()
        self._closed: Optional[str] = None  # why, once no call can go through any more
        self._calls: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="rudra-stream-client", daemon=True)
        self._thread.start()

    def _open(self, deadline: float) -> socket.socket:
        """A proven connection, tried every half second until ``deadline`` (a link down, the server's handshake
        slots taken by strangers); at once an error where no retry can help (nobody listens, a refused proof)."""
        while True:
            if self._closing:
                raise ConnectionError("this learner closed it")
            try:
                # a connect in short tries: close() cannot cut one short, and a link still down answers none
                sock = self._connect(max(0.1, min(_CONNECT_S, self.timeout, deadline - time.monotonic())))
                log.debug("stream to %s at %s:%d opened", self.what, self.offer.address, self.offer.port)
                return sock
            except ConnectionRefusedError as error:
                raise _GaveUp(f"nobody listens there any more ({error})", timed_out=False) from error
            except _Refused:
                raise
            except OSError as error:
                if time.monotonic() + 0.5 >= deadline:
                    raise _GaveUp(
                        f"could not open it within {self.timeout:g} s (rpc_timeout): {error}", timed_out=True
                    ) from error
                time.sleep(0.5)

    def _connect(self, timeout: float) -> socket.socket:
        sock = socket.create_connection((self.offer.address, self.offer.port), timeout=timeout)
        self._opening = sock  # close() shuts it too, rather than wait for its handshake's timeout
        try:
            if self._closing:
                raise ConnectionError("this learner closed it")
            sock.settimeout(self.timeout)
            keep_alive(sock, keepalive_interval(self.timeout))
            self._handshake(sock)
        except BaseException:
            sock.close()
            raise
        return sock

    def _handshake(self, sock: socket.socket) -> None:
        said = read_exactly(sock, len(MAGIC) + NONCE)
        if said[: len(MAGIC)] != MAGIC:
            raise _Refused(f"what listens there is not the stream of {self.what}")
        challenge, answer = said[len(MAGIC) :], secrets.token_bytes(NONCE) + self.session
        sock.sendall(MAGIC + answer + handshake_proof(self.offer.secret, b"learner", challenge, answer))
        try:
            shown = read_exactly(sock, PROOF_SIZE)
        except (ConnectionResetError, ConnectionAbortedError):  # broken, not refused: worth another try
            raise
        except ConnectionError as error:  # closed without a word: the proof was refused
            raise _Refused(f"{self.what} refused this learner's proof that it belongs to the run") from error
        if not hmac.compare_digest(shown, handshake_proof(self.offer.secret, b"server", answer, challenge)):
            raise _Refused(f"what listens there could not prove it is {self.what} (it does not know the secret)")

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
                self._send(request, current)
                current = None
        except socket.timeout:
            why = (
                f"nothing moved on it for {self.timeout:g} s (rpc_timeout) while a call waited (a half-open "
                "connection: a dropped NAT entry, a firewall that lets RPC through but not the stream's port?)"
            )
            if current is not None:  # the call that waited: worded as RPC's own timeouts are (learner/client.py)
                current.set_exception(RuntimeError(f"the stream to {self.what} timed out: {why}"))
        except _GaveUp as error:
            why = str(error)
            if error.timed_out and current is not None:  # as above: the host may be cut off, not the server gone
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

    def _send(self, request: tuple, future: Future) -> None:
        """One call, pickled once and sent again on a new connection each time one breaks, for ``timeout`` seconds
        at most from the first break; its future ends here, or the error raised (no connection to be had) ends it."""
        method = request[0]
        try:
            frame = Frame.encode(request)
        except Exception as error:
            future.set_exception(RuntimeError(f"{method} cannot be sent to {self.what}: {error}"))
            return
        over = frame.over(self.offer.limits)
        if over is not None:  # the server would refuse it, and close the connection
            future.set_exception(RuntimeError(f"{method} cannot be sent to {self.what}: {over}"))
            return
        self._sent += 1
        deadline = None
        while True:
            try:
                return self._call(self._sent if deadline is None else self._sent | RESENT, method, frame, future)
            except (socket.timeout, FrameError):  # silence, or a peer out of step: no new connection mends those
                raise
            except OSError as error:  # reset, aborted, end of file: the connection broke, maybe not the server
                if self._closing:
                    raise
                if deadline is None:
                    deadline = time.monotonic() + self.timeout
                else:  # broken again: not at once, and never past the deadline
                    if time.monotonic() + 0.5 >= deadline:
                        raise _GaveUp(
                            f"it broke ({error}) again and again for {self.timeout:g} s (rpc_timeout)", timed_out=True
                        ) from error
                    time.sleep(0.5)
                self._reconnect(error, deadline)

    def _reconnect(self, broken: OSError, deadline: float) -> None:
        log.info("the stream to %s broke (%s): opening it again", self.what, broken)
        self.sock.close()
        try:
            self.sock = self._open(deadline)
        except _GaveUp as error:
            raise _GaveUp(f"it broke ({broken}) and {error}", error.timed_out) from error
        except _Refused as error:
            raise _GaveUp(f"it broke ({broken}) and {error}", timed_out=False) from error
        if self._closing:  # close() shut the old socket while this one was being opened
            self.sock.close()
            raise ConnectionError("this learner closed it")

    def _call(self, number: int, method: str, frame: Frame, future: Future) -> None:
        frame.send(self.sock, number)
        while True:
            try:
                reply = recv_frame(self.sock, self.offer.limits)
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
            raise FrameError(f"{self.what} answered {method} with something that is not a reply")

    def close(self) -> None:
        """Stop: a call in progress fails (its socket is shut), later ones too."""
        self._closing = True
        for sock in (self.sock, self._opening):
            try:
                if sock is not None:
                    sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        self.sock.close()
        self._calls.put(None)
        self._thread.join(timeout=5.0)
