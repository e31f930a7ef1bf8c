"""Pushes to a server over a TCP connection of their own: the tensors' bytes go straight to the socket, the rest of
the call pickled beside them (:mod:`lightning_rudra.transport.frames`); on the server's host the tensors stay in
shared memory and only the call travels. RPC (TensorPipe) carries everything else.

Why: across a shaped link, plain sockets move a push and its reply in the link's own time, where TensorPipe's copies
took more (the measurement is in benchmarks/NOTES.md); on one host a socket's round trip for a push's control takes
about half of TensorPipe's (1.0 against 2.1 ms for an 8,010-parameter model, push and update included). A connection
carries up to :data:`IN_FLIGHT` calls at once and answers them in order: each side sends on one thread and receives
on another, so that a call goes out while the reply to the one before still comes in, and a push returns a future at
once, as an RPC does. Nothing here knows about the parameter server: a call is ``(method, *args)``.

Who may talk: the server hands a secret of its own to the learners that ask for the stream through RPC
(:class:`StreamOffer`); a connection proves it knows it (an HMAC of the other side's random challenge, both ways)
before anything of it is unpickled, and until then the server reads only the fixed-size handshake. Errors travel as
their type's name and message (:class:`ServerError`), never as pickled exceptions.

A connection that breaks (reset by a firewall or ``ss -K``, aborted by the kernel) is opened again and the calls in
progress sent again, within ``rpc_timeout``. They may or may not have reached the server, so each call goes with its
number in the client's session (named in the handshake), ahead of its frame: the server answers a number it has seen
with the reply it made (it keeps the last :data:`IN_FLIGHT`), and never runs a push twice. One connection of a
session is served at a time.
"""

import hashlib
import hmac
import math
import socket
import time
from typing import Any, NamedTuple, Optional


from lightning_rudra.core.errors import BY_NAME
from lightning_rudra.transport.frames import FrameLimits

MAGIC = b"rudra-s3"  # the protocol and its version, first on the wire both ways
NONCE = 32
SESSION = 16  # a client's calls are numbered within its session, whatever connection carries them
PROOF_SIZE = hashlib.sha256().digest_size
# on a call's number: sent again after its connection broke (a number the server has forgotten is then refused,
# since it may have run; a first sending runs)
RESENT = 1 << 63
# calls a client has sent and not yet had answered, at most: two, so that a learner with ``overlap`` sends its next
# push while the reply to the last comes back (both directions of the link busy); the server keeps as many replies
IN_FLIGHT = 2


class StreamOffer(NamedTuple):
    """Where a server takes pushes over the stream, the secret that proves a connection belongs to the run, and
    the largest frame either side sends."""

    address: str
    port: int
    secret: bytes
    limits: FrameLimits


class ServerError(RuntimeError):
    """An error a call was answered with, as its type's name and its message. RuntimeError: the learner's error
    handling treats it as any error of the server's (:mod:`lightning_rudra.learner.client`), and raises one of the
    package's errors again as its class (:func:`~lightning_rudra.core.errors.carried`), whose message it keeps."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message if kind == "RuntimeError" or kind in BY_NAME else f"{kind}: {message}")
        self.kind = kind


def handshake_proof(secret: bytes, role: bytes, challenge: bytes, answer: bytes) -> bytes:
    return hmac.new(secret, role + challenge + answer, hashlib.sha256).digest()


def keep_alive(sock: socket.socket, seconds: float) -> None:
    """TCP keepalive: a peer gone without a word (a host switched off, a NAT entry dropped) ends the connection
    after about ``seconds`` of silence plus four probes as far apart."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for option, value in (("TCP_KEEPIDLE", seconds), ("TCP_KEEPINTVL", seconds), ("TCP_KEEPCNT", 4)):
        if hasattr(socket, option):  # Linux; elsewhere the system's defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), max(1, int(value)))


def keepalive_interval(timeout: float) -> float:
    """How often a side that waits says it is alive: four times within the other side's ``timeout``."""
    return max(0.05, min(5.0, timeout / 4))


def read_exactly(sock: socket.socket, count: int, deadline: float = math.inf) -> bytes:
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


def shut(sock: Optional[Any]) -> None:
    """Shut a connection both ways, if it is still open: a thread blocked on it wakes."""
    try:
        if sock is not None:
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
