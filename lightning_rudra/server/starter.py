"""A process that forks server processes from an interpreter that has imported torch, its compiler stack and this
package once (``start_method="forkserver"``): a server process then starts in tens of milliseconds, not the seconds
of a fresh interpreter's imports, which every learner waits for at the start of every stage.

The process that calls ``fit`` owns the starter (:data:`SERVER_STARTER`); it ends with that process. Its learners
find it through :data:`STARTER_ENV`, a private folder (mode 0700) that holds its Unix socket and a random key, and
ask it with :func:`fork_server`: the starter answers only a peer that proves it read the key (an HMAC of a fresh
challenge), reads a request of plain JSON (never a pickle), forks, runs :func:`lightning_rudra.server.process.main`
on the request's command line with the learner's standard output and error, working folder, environment and
``sys.path``, and reports the server's pid and then its exit code. Every read and wait of either side is bounded.
A forked server's command line (``ps``) is its starter's: :func:`forked_servers` says which is which.
"""

import atexit
import hmac
import json
import logging
import multiprocessing
import os
import selectors
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Optional

log = logging.getLogger(__name__)

STARTER_ENV = "LIGHTNING_RUDRA_SERVER_STARTER"  # the starter's folder, in the environment of the learners it serves
_SOCKET, _KEY, _SERVERS = "socket", "key", "servers"
_HANDSHAKE_S = 5.0  # the longest the starter waits on one peer's challenge and request: it serves one at a time
_MAX_REQUEST = 1 << 20  # bytes: a command line, an environment and a sys.path
_FDS = 3  # a request carries the learner's stdout, stderr and the read end of a pipe it keeps open while alive
_INT = struct.Struct("!i")


class ServerStarter:
    """The starter of this process, started on the first :meth:`ensure_running` and ended with this process."""

    def __init__(self) -> None:
        self.folder: Optional[str] = None
        self._process: Optional[Any] = None

    @property
    def pid(self) -> Optional[int]:
        return None if self._process is None else self._process.pid

    def ensure_running(self, timeout: float = 60.0) -> str:
        """The folder of a running starter, forked from this process's fork server (which imported what the
        learners need; the starter imports the rest once). Waits, bounded, until it listens."""
        if self._process is not None and self._process.is_alive():
            assert self.folder is not None
            return self.folder
        self.folder = tempfile.mkdtemp(prefix="rudra-starter-")  # mode 0700: only this user reaches the socket
        atexit.register(shutil.rmtree, self.folder, True)  # first: the key goes even if the starter cannot start
        with open(os.open(os.path.join(self.folder, _KEY), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(os.urandom(32))
        process = multiprocessing.get_context("forkserver").Process(
            target=serve, args=(self.folder,), daemon=True, name="rudra-server-starter"
        )
        process.start()
        self._process = process
        deadline = time.monotonic() + timeout
        while not os.path.exists(os.path.join(self.folder, _SOCKET)):
            if not process.is_alive() or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(
                    f"the server starter did not open its socket in {self.folder} within {timeout:.0f} s "
                    f"(exit code {process.exitcode})"
                )
            time.sleep(0.02)
        return self.folder


SERVER_STARTER = ServerStarter()


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
        if self.returncode is None and _readable(self._connection, 0):
            self._read_code()
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        if self.returncode is None:
            if not _readable(self._connection, timeout):
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
        data = _receive(self._connection, _INT.size, eof_ok=True)
        if data is None:  # the starter ended first (its owner is ending): no code to read, and nobody reaps it
            self._kill()
            self.returncode = -signal.SIGKILL
        else:
            (self.returncode,) = _INT.unpack(data)
        self._connection.close()
        os.close(self._alive)


def fork_server(folder: str, argv: list[str], new_session: bool, timeout: float) -> ForkedServer:
    """Ask the starter in ``folder`` for a server process that runs
    :func:`lightning_rudra.server.process.main` on ``argv`` (:func:`~lightning_rudra.server.launch.start_server`'s
    command line), in a session of its own if ``new_session``. Raises ``OSError`` when the starter cannot be reached
    or refuses, after ``timeout`` seconds at most."""
    with open(os.path.join(folder, _KEY), "rb") as f:
        key = f.read()
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    alive_r, alive_w = os.pipe()
    try:
        connection.settimeout(timeout)
        connection.connect(os.path.join(folder, _SOCKET))
        challenge = _receive(connection, 32)
        request = json.dumps(
            {"argv": argv, "env": dict(os.environ), "cwd": os.getcwd(), "path": sys.path, "new_session": new_session}
        ).encode()
        answer = hmac.digest(key, challenge, "sha256") + _INT.pack(len(request))
        socket.send_fds(connection, [answer], [1, 2, alive_r])  # the descriptors a server started by Popen inherits
        connection.sendall(request)
        (pid,) = _INT.unpack(_receive(connection, _INT.size))
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


def serve(folder: str) -> None:
    """The starter's process: imports what a server process needs, then forks one per authenticated request
    until the process that owns it ends. Single-threaded, so that a fork copies no other thread's state."""
    import torch._dynamo  # noqa: F401  what a server's first optimizer imports (seconds)

    import lightning_rudra.server.process  # noqa: F401

    with open(os.path.join(folder, _KEY), "rb") as f:
        key = f.read()
    os.mkdir(os.path.join(folder, _SERVERS))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.path.join(folder, _SOCKET) + ".new")
    listener.listen(64)
    os.rename(os.path.join(folder, _SOCKET) + ".new", os.path.join(folder, _SOCKET))  # ready once it exists
    child_ended_r, child_ended_w = os.pipe()
    os.set_blocking(child_ended_r, False)
    os.set_blocking(child_ended_w, False)
    signal.set_wakeup_fd(child_ended_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    # a terminal's Ctrl-C reaches this process group: the starter ends with its owner, not with that (a learner
    # whose starter ended kills its server, an elastic one too, which runs in a session of its own not to see it)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    owner = multiprocessing.parent_process()
    assert owner is not None
    children: dict[int, socket.socket] = {}
    with selectors.DefaultSelector() as selector:
        selector.register(listener, selectors.EVENT_READ)
        selector.register(child_ended_r, selectors.EVENT_READ)
        selector.register(owner.sentinel, selectors.EVENT_READ)
        while True:
            ready = {key.fileobj for key, _ in selector.select()}
            if owner.sentinel in ready:
                break
            if child_ended_r in ready:
                _report_ended(child_ended_r, children, folder)
            if listener in ready:
                connection, _ = listener.accept()
                others = (selector, listener, connection, child_ended_r, child_ended_w, *children.values())
                pid = _answer(connection, folder, key, others)
                if pid is None:
                    connection.close()
                else:
                    children[pid] = connection
    shutil.rmtree(folder, ignore_errors=True)


def _answer(connection: socket.socket, folder: str, key: bytes, close_in_child: tuple) -> Optional[int]:
    """Read one request and fork its server; the pid, or None for a request refused."""
    fds: list[int] = []
    deadline = time.monotonic() + _HANDSHAKE_S  # for the whole handshake: a peer that trickles bytes is cut off too
    try:
        connection.settimeout(_HANDSHAKE_S)
        challenge = os.urandom(32)
        connection.sendall(challenge)
        data, fds, _, _ = socket.recv_fds(connection, 32 + _INT.size, _FDS)
        data += _receive(connection, 32 + _INT.size - len(data), deadline=deadline)
        if not hmac.compare_digest(data[:32], hmac.digest(key, challenge, "sha256")):
            raise PermissionError("a request without the key")
        (size,) = _INT.unpack(data[32:])
        if len(fds) != _FDS or not 0 < size <= _MAX_REQUEST:
            raise ValueError(
                f"a request of {size} bytes and {len(fds)} descriptors: expected 1 to {_MAX_REQUEST}, {_FDS}"
            )
        request = _checked(json.loads(_receive(connection, size, deadline=deadline)))
        connection.settimeout(None)
    except Exception as error:  # whatever a peer sends (JSON nested too deep: RecursionError) is refused, not fatal
        _refuse(connection, fds, error)
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        pid = os.fork()
    except OSError as error:  # EAGAIN, ENOMEM: this request is refused (its learner starts a fresh interpreter)
        _refuse(connection, fds, error)
        return None
    if pid == 0:
        _run_server(request, fds, close_in_child)  # never returns
    for fd in fds:
        os.close(fd)
    _record(folder, pid, request["argv"])
    try:
        connection.sendall(_INT.pack(pid))
    except OSError:  # the learner is gone: its server sees it (the pipe's write end closed) and exits
        pass
    return pid


def forked_servers(folder: str) -> dict[int, list[str]]:
    """The servers the starter in ``folder`` forked that have not ended, by pid: each one's command line."""
    found = {}
    for name in os.listdir(os.path.join(folder, _SERVERS)):
        try:
            with open(os.path.join(folder, _SERVERS, name)) as f:
                found[int(name)] = json.load(f)
        except (FileNotFoundError, ValueError):  # ended, or being written
            pass
    return found


def _record(folder: str, pid: int, argv: list[str]) -> None:
    path = os.path.join(folder, _SERVERS, str(pid))
    with open(path + ".new", "w") as f:
        json.dump(argv, f)
    os.rename(path + ".new", path)


def _refuse(connection: socket.socket, fds: list[int], error: Exception) -> None:
    log.warning("server starter: a request refused: %s", error)
    for fd in fds:
        os.close(fd)
    try:
        connection.settimeout(_HANDSHAKE_S)
        connection.sendall(_INT.pack(0))  # pid 0: refused
    except OSError:
        pass


def _checked(request: Any) -> dict:
    kinds = {"argv": list, "env": dict, "cwd": str, "path": list, "new_session": bool}
    if not isinstance(request, dict) or set(request) != set(kinds):
        raise ValueError(f"a request with keys {sorted(request) if isinstance(request, dict) else request!r}")
    for name, kind in kinds.items():
        if not isinstance(request[name], kind):
            raise TypeError(f"a request's {name} is a {type(request[name]).__name__}, expected a {kind.__name__}")
    strings = [*request["argv"], *request["path"], *request["env"].keys(), *request["env"].values()]
    if not all(isinstance(s, str) for s in strings):
        raise TypeError("a request's command line, path and environment must be strings")
    return request


def _report_ended(child_ended_r: int, children: dict[int, socket.socket], folder: str) -> None:
    try:
        while os.read(child_ended_r, 512):
            pass
    except BlockingIOError:
        pass
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        try:
            os.remove(os.path.join(folder, _SERVERS, str(pid)))
        except FileNotFoundError:
            pass
        if connection is not None:
            try:
                connection.sendall(_INT.pack(os.waitstatus_to_exitcode(status)))
            except OSError:
                pass  # its learner is gone
            connection.close()


def _run_server(request: dict, fds: list[int], close_in_child: tuple) -> None:
    """In the forked child: become the server process the learner would have started."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)  # a fresh interpreter's
        for item in close_in_child:
            item.close() if hasattr(item, "close") else os.close(item)
        _forget_the_fork_server()
        if request["new_session"]:
            os.setsid()
        stdout, stderr, alive = fds
        os.dup2(stdout, 1)
        os.dup2(stderr, 2)
        os.close(stdout)
        os.close(stderr)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[:] = request["path"]
        argv = [*request["argv"], "--parent-fd", str(alive)]
        _show_as([sys.executable, "lightning_rudra.server.process", *argv])
        from lightning_rudra.server.process import main

        main(argv)
        code = 0
    except SystemExit as exit:
        code = exit.code if isinstance(exit.code, int) else (0 if exit.code is None else 1)
        if exit.code is not None and not isinstance(exit.code, int):
            print(exit.code, file=sys.stderr)  # as the interpreter does
    except BaseException:
        traceback.print_exc()
    finally:
        from lightning_rudra.transport.logs import drain_records

        drain_records(2.0)  # what an interpreter's exit does (atexit), which os._exit skips
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _show_as(command: list[str]) -> None:
    """What ps and ``/proc/<pid>/cmdline`` show of this process: not the fork server's command line, which hides
    that it is a server and which one. As setproctitle does, the bytes of the original command line are overwritten
    (truncated to their length); best effort."""
    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[45]), int(fields[46])  # arg_start and arg_end, fields 48 and 49 of proc(5)
        title = "\0".join(command).encode()[: end - start - 1]
        with open("/proc/self/mem", "r+b", buffering=0) as memory:
            memory.seek(start)
            memory.write(title + b"\0" * (end - start - len(title)))
    except (OSError, ValueError, IndexError):
        pass


def _forget_the_fork_server() -> None:
    """A forked server holds nothing of the fork server's that a fresh interpreter has not: the pipes that keep the
    owner's fork server and resource tracker running (an elastic server outlives the owner) and its sentinel."""
    from multiprocessing import forkserver, process, resource_tracker

    server: Any = forkserver._forkserver  # type: ignore[attr-defined]
    tracker: Any = resource_tracker._resource_tracker
    inherited = [server._forkserver_alive_fd, tracker._fd, *(getattr(server, "_inherited_fds", None) or [])]
    parent = process._parent_process  # type: ignore[attr-defined]
    if parent is not None:
        inherited.append(parent.sentinel)
    for fd in inherited:
        if fd is not None:
            try:
                os.close(fd)
            except OSError:
                pass
    server._forkserver_alive_fd, server._inherited_fds, tracker._fd = None, [], None
    process._parent_process = None  # type: ignore[attr-defined]


def _readable(connection: socket.socket, timeout: Optional[float]) -> bool:
    with selectors.DefaultSelector() as selector:
        selector.register(connection, selectors.EVENT_READ)
        return bool(selector.select(timeout))


def _receive(connection: socket.socket, size: int, eof_ok: bool = False, deadline: Optional[float] = None) -> Any:
    data = b""
    while len(data) < size:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{len(data)} of {size} bytes in {_HANDSHAKE_S:g} s")
            connection.settimeout(left)
        chunk = connection.recv(size - len(data))
        if not chunk:
            if eof_ok and not data:
                return None
            raise ConnectionResetError(f"the peer closed the connection after {len(data)} of {size} bytes")
        data += chunk
    return data
