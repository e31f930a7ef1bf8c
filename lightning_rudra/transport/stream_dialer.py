"""How a learner gets into a stream server (:mod:`lightning_rudra.transport.stream`): a connection opened and proven
(each side shows the other it knows the run's secret), tried again until a deadline where another try can help."""

import hmac
import logging
import secrets
import socket
import time
from typing import Optional

from lightning_rudra.transport.stream import (
    MAGIC,
    NONCE,
    PROOF_SIZE,
    StreamOffer,
    handshake_proof,
    keep_alive,
    keepalive_interval,
    read_exactly,
    shut,
)

log = logging.getLogger(__name__)

_CONNECT_S = 2.0  # the longest a try at connecting takes


class Refused(ConnectionError):
    """A connection the other side turned down for good (a proof refused or not given): trying again cannot help."""


class GaveUp(ConnectionError):
    """The stream broke and could not be opened again: ``timed_out`` when time ran out (the host may be cut off),
    rather than a server that no longer listens or refuses."""

    def __init__(self, message: str, timed_out: bool) -> None:
        super().__init__(message)
        self.timed_out = timed_out


class StreamDialer:
    """Opens proven connections to the stream server of ``offer`` for session ``session`` (each step of the
    handshake waits ``timeout`` seconds at most); :meth:`stop` cuts an opening in progress short, and every later
    one."""

    def __init__(self, offer: StreamOffer, timeout: float, session: bytes, what: str) -> None:
        self.offer = offer
        self.timeout = timeout
        self.session = session
        self.what = what  # for messages: "parameter server 1 (on 10.0.0.2)"
        self._stopped = False
        self._opening: Optional[socket.socket] = None  # the connection being opened, if one is

    def open(self, deadline: float) -> socket.socket:
        """A proven connection, tried every half second until ``deadline`` (a link down, the server's handshake
        slots taken by strangers); at once an error where no retry can help (nobody listens, a refused proof)."""
        while True:
            if self._stopped:
                raise ConnectionError("this learner closed it")
            try:
                # a connect in short tries: stop() cannot cut one short, and a link still down answers none
                sock = self._connect(max(0.1, min(_CONNECT_S, self.timeout, deadline - time.monotonic())))
                log.debug("stream to %s at %s:%d opened", self.what, self.offer.address, self.offer.port)
                return sock
            except ConnectionRefusedError as error:
                raise GaveUp(f"nobody listens there any more ({error})", timed_out=False) from error
            except Refused:
                raise
            except OSError as error:
                if time.monotonic() + 0.5 >= deadline:
                    raise GaveUp(
                        f"could not open it within {self.timeout:g} s (rpc_timeout): {error}", timed_out=True
                    ) from error
                time.sleep(0.5)

    def stop(self) -> None:
        """No connection opens any more; one being opened is shut, rather than left to its handshake's timeout."""
        self._stopped = True
        shut(self._opening)

    def _connect(self, timeout: float) -> socket.socket:
        sock = socket.create_connection((self.offer.address, self.offer.port), timeout=timeout)
        self._opening = sock  # stop() shuts it too, rather than wait for its handshake's timeout
        try:
            if self._stopped:
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
            raise Refused(f"what listens there is not the stream of {self.what}")
        challenge, answer = said[len(MAGIC) :], secrets.token_bytes(NONCE) + self.session
        sock.sendall(MAGIC + answer + handshake_proof(self.offer.secret, b"learner", challenge, answer))
        try:
            shown = read_exactly(sock, PROOF_SIZE)
        except (ConnectionResetError, ConnectionAbortedError):  # broken, not refused: worth another try
            raise
        except ConnectionError as error:  # closed without a word: the proof was refused
            raise Refused(f"{self.what} refused this learner's proof that it belongs to the run") from error
        if not hmac.compare_digest(shown, handshake_proof(self.offer.secret, b"server", answer, challenge)):
            raise Refused(f"what listens there could not prove it is {self.what} (it does not know the secret)")
