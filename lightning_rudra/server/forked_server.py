"""A server process forked by the server starter (:mod:`~lightning_rudra.server.starter`), as the learner that asked
for it sees it (:class:`ForkedServer`), the request that asks for one (:func:`fork_server`), and what both sides of
the starter's socket share."""

import hmac
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
from typing import Any, Optional

STARTER_ENV = "LIGHTNING_RUDRA_SERVER_STARTER"  # the starter's folder, in the environment of the learners it serves
SOCKET, KEY = "socket", "key"  # in the starter's folder
FDS = 3  # a request carries the learner's stdout, stderr and the read end of a pipe it keeps open while alive
INT = struct.Struct("!i")


class ForkedServer:
    """A server process forked by the starter, as the learner that asked for it sees it: what
    :class:`subprocess.Popen` offers the code that starts and stops servers (``pid``, ``returncode``, ``poll``,
    ``wait``, ``kill``). While this object is open, the server knows its learner is alive."""

    def __init__(self, connection: socket.socket, pid: int, alive: int) -> None:
        self.pid = pid
        self.returncode: Optional[int] = None
        self._connection = connection
        self._alive = alive  # the write end of the pipe whose end tells the server its learner died

    def poll(self) -> Optional[int]:
        if self.returncode is None and readable(self._connection, 0):
            self._read_code()
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            if not readable(self._connection, timeout):
                raise subprocess.TimeoutExpired(f"parameter server (pid {self.pid})", timeout or 0.0)
            self._read_code()
        assert self.returncode is not None
        return self.returncode

    def kill(self) -> None:
        if self.poll() is None:  # not a pid the starter has reaped, and the kernel may have given to another process
            self._kill()

    def _kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def _read_code(self) -> None:
        data = receive(self._connection, INT.size, eof_ok=True)
        if data is None:  # the starter ended first (its owner is ending): no code to read, and nobody reaps it
            self._kill()
            self.returncode = -signal.SIGKILL
        else:
            (self.returncode,) = INT.unpack(data)
        self._connection.close()
        os.close(self._alive)


def fork_server(folder: str, argv: list[str], new_session: bool, timeout: float) -> ForkedServer:
    """Ask the starter in ``folder`` for a server process that runs
    :func:`lightning_rudra.server.process.main` on ``argv`` (:func:`~lightning_rudra.server.launch.start_server`'s
    command line), in a session of its own if ``new_session``. Raises ``OSError`` when the starter cannot be reached
    or refuses, after ``timeout`` seconds at most."""
    with open(os.path.join(folder, KEY), "rb") as f:
        key = f.read()
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    alive_r, alive_w = os.pipe()
    try:
        connection.settimeout(timeout)
        connection.connect(os.path.join(folder, SOCKET))
        challenge = receive(connection, 32)
        request = json.dumps(
            {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "path": sys.path, "new_session": new_session}
        ).encode()
        answer = hmac.digest(key, challenge, "sha256") + INT.pack(len(request))
        socket.send_fds(connection, [answer], [1, 2, alive_r])  # the descriptors a server started by Popen inherits
        connection.sendall(request)
        (pid,) = INT.unpack(receive(connection, INT.size))
        if pid <= 0:
            raise ConnectionRefusedError(f"the server starter in {folder} refused the request")
        os.write(alive_w, b"\1")  # the server is this learner's: had it given up, the server would see EOF first
        connection.settimeout(None)  # from here the waits are ForkedServer's, each with its own bound
    except BaseException:
        connection.close()  # a server forked all the same sees its learner gone (alive_w closed) and exits
        os.close(alive_w)
        raise
    finally:
        os.close(alive_r)
    return ForkedServer(connection, pid, alive_w)


def readable(connection: socket.socket, timeout: Optional[float]) -> bool:
    with selectors.DefaultSelector() as selector:
        selector.register(connection, selectors.EVENT_READ)
        return bool(selector.select(timeout))


def receive(connection: socket.socket, size: int, eof_ok: bool = False, deadline: Optional[float] = None) -> Any:
    data = b""
    while len(data) < size:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{len(data)} of {size} bytes before the deadline")
            connection.settimeout(left)
        chunk = connection.recv(size - len(data))
        if not chunk:
            if eof_ok and not data:
                return None
            raise ConnectionResetError(f"the peer closed the connection after {len(data)} of {size} bytes")
        data += chunk
    return data
