"""The learner's side of the stream (:mod:`lightning_rudra.transport.stream`): calls sent in order on a thread of
their own while their replies come in on another, through broken connections, each answered once."""

import logging
import secrets
import socket
import threading
import time
from collections import deque
from typing import Any, NamedTuple, Optional, Union

from torch.futures import Future

from lightning_rudra.transport.frames import (
    KEEPALIVE,
    DecodeError,
    Frame,
    FrameError,
    recv_frame,
)
from lightning_rudra.transport import timeline
from lightning_rudra.transport.stream_pieces import PIECE, PiecedCall
from lightning_rudra.transport.stream import IN_FLIGHT, RESENT, SESSION, ServerError, StreamOffer, shut
from lightning_rudra.transport.stream_dialer import GaveUp, Refused, StreamDialer

log = logging.getLogger(__name__)


_SMALL = 64 << 10  # a call of at most these bytes (a push's control) has its reply awaited as it goes out


class _Call(NamedTuple):
    """A call sent, kept until answered: sent again, whole, on a new connection if its own breaks."""

    number: int
    method: str
    frame: Union[Frame, PiecedCall]
    future: Future


class StreamClient:
    """A learner's connection to the :class:`StreamServer` of ``offer`` (connecting and the handshake wait
    ``timeout`` seconds at most). :meth:`call` returns a future at once; the calls go in order, up to
    :data:`~lightning_rudra.transport.stream.IN_FLIGHT` at once. A reply may take as long as the call does (a hardsync
    round): the server sends a keepalive frame meanwhile, and a connection that stays silent for ``timeout`` while a
    call waits (half-open: a dropped NAT entry, a firewall that lets RPC through but not this port) fails the calls,
    naming the server. A connection that breaks is opened again, and the calls in progress sent again (the server runs
    each once), for ``timeout`` seconds at most from the first break; a server that no longer listens ends it at once.
    Every call ends, with its value or an error, whatever ends the connection."""

    def __init__(self, offer: StreamOffer, timeout: float, what: str) -> None:
        self.what = what  # for messages: "parameter server 1 (on 10.0.0.2)"
        self.timeout = timeout
        self.offer = offer
        self.session = secrets.token_bytes(SESSION)
        self._closing = False
        self._dialer = StreamDialer(offer, timeout, self.session, what)
        self.sock = self._dialer.open(time.monotonic() + timeout)
        self._sent = 0  # calls sent in this session: each goes with its number
        # guards what both threads and callers share: the calls to send, those unanswered, what broke
        self._lock = threading.Lock()
        self._to_send = threading.Condition(self._lock)  # a call queued, room for one, or a break
        self._to_read = threading.Condition(self._lock)  # a call went out whole, or the receiving must stop
        self._closed: Optional[str] = None  # why, once no call can go through any more
        self._queue: deque[Union[None, tuple[tuple, Future], PiecedCall]] = deque()  # None: close
        self._unanswered: deque[_Call] = deque()  # sent, in order; replies come in this order
        self._broken: Optional[BaseException] = None  # what ended the receiving of the current connection
        self._broken_since: Optional[float] = None  # the first break no reply has come after
        self._sent_through = 0  # the last call sent whole on the current connection: its reply may be read
        self._receiving: Optional[socket.socket] = None  # the connection the receiving thread reads
        self._receiver = self._receive_on(self.sock)
        # (learner, server): the timeline's ``reply`` event is marked as a push's reply arrives, before its future
        # wakes the learner (a callback of the future would run after)
        self.timeline_numbers: Optional[tuple[int, int]] = None
        self._thread = threading.Thread(target=self._run, name="rudra-stream-client", daemon=True)
        self._thread.start()

    def call(self, method: str, *args: Any) -> Future:
        future: Future = Future()
        with self._lock:
            if self._closed is None:
                self._queue.append(((method, *args), future))
                self._to_send.notify()
                return future
            why = self._closed
        future.set_exception(RuntimeError(f"the stream to {self.what} closed: {why}"))
        return future

    def call_in_pieces(self) -> PiecedCall:
        """A call whose tensors go ahead of it as they are made (:mod:`~lightning_rudra.transport.stream_pieces`):
        its pieces are sent as they are added, the call once it is finished."""
        call = PiecedCall(self._to_send, self.what)
        with self._lock:
            if self._closed is None:
                self._queue.append(call)
                self._to_send.notify()
                return call
            why = self._closed
        call.future.set_exception(RuntimeError(f"the stream to {self.what} closed: {why}"))
        return call

    def _run(self) -> None:
        """The sending thread: the next call once fewer than ``IN_FLIGHT`` wait, or the connection mended once its
        receiving broke."""
        why = "this learner closed it"
        timed_out = False
        try:
            while True:
                with self._lock:
                    self._to_send.wait_for(
                        lambda: self._broken is not None or (bool(self._queue) and len(self._unanswered) < IN_FLIGHT)
                    )
                    broken, item = self._broken, None
                    if broken is None:
                        item = self._queue.popleft()
                if broken is not None:
                    self._mend(broken)
                elif item is None:
                    return
                elif isinstance(item, PiecedCall):
                    self._send_pieces(item)
                else:
                    self._send(*item)
        except socket.timeout:
            why = (
                f"nothing moved on it for {self.timeout:g} s (rpc_timeout) while a call waited (a half-open "
                "connection: a dropped NAT entry, a firewall that lets RPC through but not the stream's port?)"
            )
            timed_out = True
        except GaveUp as error:
            why, timed_out = str(error), error.timed_out  # timed out: the host may be cut off, not the server gone
        except BaseException as error:
            why = str(error) or type(error).__name__
        finally:
            self._end(why, timed_out)

    def _end(self, why: str, timed_out: bool) -> None:
        """No call goes through any more: each pending one fails, the one that waited first as RPC's own timeouts
        are worded where time ran out (learner/client.py tells a lost server by it)."""
        with self._lock:
            self._closed = why
            pending = [call.future for call in self._unanswered]
            pending += [item.future if isinstance(item, PiecedCall) else item[1] for item in self._queue if item]
            self._unanswered.clear()
            self._queue.clear()
            self._to_read.notify_all()
        self._stop_receiving(5.0)
        for index, future in enumerate(pending):
            if not future.done():
                ended = "timed out" if timed_out and index == 0 else "closed"
                future.set_exception(RuntimeError(f"the stream to {self.what} {ended}: {why}"))

    def _send(self, request: tuple, future: Future) -> None:
        """Send one call, pickled once (kept, to be sent again if its connection breaks); a call that cannot be
        sent fails alone."""
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
        call = _Call(self._sent, method, frame, future)
        with self._lock:
            self._unanswered.append(call)
        small = frame.size() <= _SMALL  # goes out at once, into the socket's buffer: its reply may be read already
        if small:
            self._sent_whole(call.number)
        try:
            frame.send(self.sock, call.number)
        except OSError as error:  # reset, aborted: the receiving thread sees it too, or is told
            self._mend(error)
            return
        if not small:
            self._sent_whole(call.number)

    def _send_pieces(self, call: PiecedCall) -> None:
        """Send a call in pieces as its maker adds them, then the call; through breaks, each mended at once."""
        self._sent += 1
        number = self._sent
        with self._lock:
            self._unanswered.append(_Call(number, call.method, call, call.future))
        while True:
            with self._lock:
                # bounded by the learner: it finishes or abandons every call in pieces it began (a failed step or
                # push abandons it, as does its next step or unwrap); a dead server ends it through the receiving
                # thread (a break, or silence past the timeout), close() at once
                self._to_send.wait_for(lambda: self._broken is not None or self._closing or call.next_frame())
                if self._closing:
                    raise ConnectionError("this learner closed it")
                broken, step = self._broken, call.next_frame()
            if broken is not None:
                self._mend(broken)
                continue
            assert step is not None
            frame, whole = step
            try:
                frame.send(self.sock, number if whole else number | PIECE)
            except OSError as error:
                self._mend(error)  # sends again what went before, this frame not among it
                continue
            with self._lock:
                if whole:
                    call.final_sent = True
                else:
                    call.sent += 1
            if whole:
                self._sent_whole(number)
                return

    def _sent_whole(self, number: int) -> None:
        """Call ``number`` went out whole: its reply may be read, and a reply's silence counts from now (an upload
        slower than ``timeout`` is not a half-open connection: each piece of it moved)."""
        with self._lock:
            self._sent_through = number
            self._to_read.notify_all()

    def _mend(self, broken: BaseException) -> None:
        """The connection broke (reset, aborted, end of file: maybe not the server): open it again and send the
        calls in progress again, for ``timeout`` seconds at most from the first break no reply came after. Silence or
        a peer out of step raise: no new connection mends those."""
        while True:
            if self._closing:
                raise ConnectionError("this learner closed it")
            if isinstance(broken, (socket.timeout, FrameError)) or not isinstance(broken, OSError):
                raise broken
            # ended first: it must not take a reply the new connection brings
            if not self._stop_receiving(self.timeout):
                raise GaveUp(f"it broke ({broken}) and its replies' thread did not stop", timed_out=False) from broken
            now = time.monotonic()
            with self._lock:
                if self._broken_since is None:
                    self._broken_since = now
                deadline = self._broken_since + self.timeout
            if now > self._broken_since:  # broken again: not at once, and never past the deadline
                if now + 0.5 >= deadline:
                    raise GaveUp(
                        f"it broke ({broken}) again and again for {self.timeout:g} s (rpc_timeout)", timed_out=True
                    ) from broken
                time.sleep(0.5)
            self._reconnect(broken, deadline)
            with self._lock:
                self._broken = None
                calls = list(self._unanswered)
            self._receiver = self._receive_on(self.sock)
            try:
                for call in calls:
                    if isinstance(call.frame, PiecedCall):
                        if not call.frame.resend(self.sock, call.number | RESENT):
                            continue  # its next piece goes from the sending thread, RESENT no more
                    else:
                        call.frame.send(self.sock, call.number | RESENT)
                    self._sent_whole(call.number)
                return
            except OSError as error:
                broken = error

    def _reconnect(self, broken: BaseException, deadline: float) -> None:
        log.info("the stream to %s broke (%s): opening it again", self.what, broken)
        self.sock.close()
        try:
            self.sock = self._dialer.open(deadline)
        except GaveUp as error:
            raise GaveUp(f"it broke ({broken}) and {error}", error.timed_out) from error
        except Refused as error:
            raise GaveUp(f"it broke ({broken}) and {error}", timed_out=False) from error
        if self._closing:  # close() shut the old socket while this one was being opened
            self.sock.close()
            raise ConnectionError("this learner closed it")

    def _stop_receiving(self, seconds: float) -> bool:
        """End the receiving thread (told, and its connection shut); whether it ended within ``seconds``."""
        with self._lock:
            sock, self._receiving = self._receiving, None
            self._to_read.notify_all()
        shut(sock)
        self._receiver.join(timeout=seconds)
        return not self._receiver.is_alive()

    def _receive_on(self, sock: socket.socket) -> threading.Thread:
        with self._lock:
            self._receiving, self._sent_through = sock, 0
        thread = threading.Thread(target=self._receive, args=(sock,), name="rudra-stream-replies", daemon=True)
        thread.start()
        return thread

    def _receive(self, sock: socket.socket) -> None:
        """The receiving thread of connection ``sock``: the replies, in the order of the calls, while any call
        waits. What ends it (a break, silence, a reply that is not one) goes to the sending thread."""
        try:
            while True:
                with self._lock:  # a reply is read only once its call went out whole
                    self._to_read.wait_for(
                        lambda: (
                            self._closed is not None
                            or self._receiving is not sock
                            or (bool(self._unanswered) and self._unanswered[0].number <= self._sent_through)
                        )
                    )
                    if self._closed is not None or self._receiving is not sock:
                        return
                    call = self._unanswered[0]
                # a call in pieces knows its method once finished: before its reply may be read
                method = call.frame.method if isinstance(call.frame, PiecedCall) else call.method
                reply: Union[BaseException, Any] = KEEPALIVE
                while reply is KEEPALIVE:
                    try:
                        reply = recv_frame(sock, self.offer.limits)
                    except DecodeError as error:
                        reply = RuntimeError(f"the reply of {self.what} to {method} could not be decoded: {error}")
                if not isinstance(reply, BaseException):
                    reply = self._value(method, reply)
                if self.timeline_numbers is not None and method in ("push", "push_deltas"):
                    timeline.mark("reply", *self.timeline_numbers)
                with self._lock:
                    self._unanswered.popleft()
                    self._broken_since = None
                    if self._queue:  # room for the next call, if one waits
                        self._to_send.notify()
                if isinstance(call.frame, PiecedCall) and call.frame.error is not None:
                    call.future.set_exception(call.frame.error)  # abandoned, or its call could not be sent
                elif isinstance(reply, _Answer):
                    call.future.set_result(reply.value)
                else:
                    call.future.set_exception(reply)
        except BaseException as error:
            with self._lock:
                if self._receiving is sock:  # else the sending thread ended it, and knows why
                    self._broken = error
                    self._to_send.notify()

    def _value(self, method: str, reply: Any) -> "Union[_Answer, BaseException]":
        if isinstance(reply, tuple) and len(reply) == 2 and reply[0] == "ok":
            return _Answer(reply[1])
        if isinstance(reply, tuple) and len(reply) == 3 and reply[0] == "error":
            return ServerError(str(reply[1]), str(reply[2]))
        raise FrameError(f"{self.what} answered {method} with something that is not a reply")

    def close(self) -> None:
        """Stop: the calls in progress fail (the socket is shut), later ones too."""
        self._closing = True
        self._dialer.stop()
        shut(self.sock)
        self.sock.close()
        with self._lock:
            self._queue.append(None)
            self._to_send.notify_all()
        self._thread.join(timeout=5.0)


class _Answer(NamedTuple):
    value: Any
