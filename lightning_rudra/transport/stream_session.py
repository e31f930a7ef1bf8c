"""What a stream's server keeps of a learner's session (:mod:`lightning_rudra.transport.stream_server`): its calls'
numbers and their replies, across its connections, and what one connection still owes it."""

import socket
import threading
import time
from collections import deque
from typing import Optional, Union

from lightning_rudra.transport.frames import Frame
from lightning_rudra.transport.stream import IN_FLIGHT


class Session:
    """A client's calls as the server saw them: the number of the last, the replies to the last ``IN_FLIGHT`` once
    made (kept until later calls show they arrived: a client sends a call only with fewer than ``IN_FLIGHT``
    unanswered), and the one connection that serves it."""

    def __init__(self) -> None:
        self.changed = threading.Condition()  # a reply made, a call read, or the connection replaced
        self.number = 0
        self.replies: dict[int, Optional[Frame]] = {}  # number -> its reply, None until made
        self.connection: Optional[socket.socket] = None
        self.busy = False  # a thread serves it
        self.idle_since = time.monotonic()  # when its last connection ended

    def begin(self, number: int) -> None:
        """Call ``number`` runs: the replies its client has had are forgotten."""
        self.number = number
        self.replies[number] = None
        for answered in [kept for kept in self.replies if kept <= number - IN_FLIGHT]:
            del self.replies[answered]

    def settle(self, number: int, reply: Frame) -> None:
        with self.changed:
            if number in self.replies:  # else later calls began: its client had this reply already
                self.replies[number] = reply
                self.changed.notify_all()


class Answers:
    """What one connection owes: the answers due, in the order of its calls (a call's number, its reply once made,
    or an answer made already), whether a thread is writing one (one at a time), and whether the connection ended."""

    def __init__(self) -> None:
        self.due: deque[Union[int, Frame]] = deque()
        self.writing = False
        self.ended = threading.Event()
