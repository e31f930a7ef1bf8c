"""A process that forks server processes from an interpreter that has imported torch, its compiler stack and this
package once (``start_method="forkserver"``): a server process then starts in tens of milliseconds, not the seconds
of a fresh interpreter's imports, which every learner waits for at the start of every stage.

The process that calls ``fit`` owns the starter (:data:`SERVER_STARTER`); it ends with that process. Its learners
find it through ``STARTER_ENV``, a private folder (mode 0700) that holds its Unix socket and a random key, and ask it
with :func:`~lightning_rudra.server.forked_server.fork_server`: the starter answers only a peer that proves it read
the key (an HMAC of a fresh challenge), reads a request of plain JSON (never a pickle), forks, runs
:func:`lightning_rudra.server.process.main` on the request's command line with the learner's standard output and
error, working folder, environment and ``sys.path``, and reports the server's pid and then its exit code. Every read
and wait of either side is bounded. A forked server shows its command line in ``ps`` where the fork server's was
long enough to hold it; :func:`forked_servers` names every one exactly.
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
import sys
import tempfile
import time
import traceback
from typing import Any, Optional

from lightning_rudra.server.forked_server import FDS, INT, KEY, SOCKET, receive

log = logging.getLogger(__name__)

_SERVERS = "servers"  # in the starter's folder: a record per forked server
_HANDSHAKE_S = 5.0  # the longest the starter waits on one peer's challenge and request: it serves one at a time
_MAX_REQUEST = 1 << 20  # bytes: a command line, an environment and a sys.path


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
        with open(os.open(os.path.join(self.folder, KEY), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as f:
            f.write(os.urandom(32))
        process = multiprocessing.get_context("forkserver").Process(
            target=serve, args=(self.folder,), daemon=True, name="rudra-server-starter"
        )
        process.start()
        self._process = process
        deadline = time.monotonic() + timeout
        while not os.path.exists(os.path.join(self.folder, SOCKET)):
            if not process.is_alive() or time.monotonic() > deadline:
                process.kill()
                raise RuntimeError(
                    f"the server starter did not open its socket in {self.folder} within {timeout:.0f} s "
                    f"(exit code {process.exitcode})"
                )
            time.sleep(0.02)
        return self.folder


SERVER_STARTER = ServerStarter()


def serve(folder: str) -> None:
    """The starter's process: imports what a server process needs, then forks one per authenticated request
    until the process that owns it ends. One Python thread and no OpenMP pool, so that a fork copies no other
    thread's state (OpenBLAS's idle workers are fork-safe)."""
    import torch._dynamo  # noqa: F401  what a server's first optimizer imports (seconds)

    import lightning_rudra.server.process  # noqa: F401

    with open(os.path.join(folder, KEY), "rb") as f:
        key = f.read()
    os.mkdir(os.path.join(folder, _SERVERS))
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(os.path.join(folder, SOCKET) + ".new")
    listener.listen(64)
    os.rename(os.path.join(folder, SOCKET) + ".new", os.path.join(folder, SOCKET))  # ready once it exists
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
        data, fds, _, _ = socket.recv_fds(connection, 32 + INT.size, FDS)
        data += receive(connection, 32 + INT.size - len(data), deadline=deadline)
        if not hmac.compare_digest(data[:32], hmac.digest(key, challenge, "sha256")):
            raise PermissionError("a request without the key")
        (size,) = INT.unpack(data[32:])
        if len(fds) != FDS or not 0 < size <= _MAX_REQUEST:
            raise ValueError(
                f"a request of {size} bytes and {len(fds)} descriptors: expected 1 to {_MAX_REQUEST}, {FDS}"
            )
        request = _checked(json.loads(receive(connection, size, deadline=deadline)))
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
        connection.sendall(INT.pack(pid))
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
        connection.sendall(INT.pack(0))  # pid 0: refused
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
                connection.sendall(INT.pack(os.waitstatus_to_exitcode(status)))
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
        _as_a_fresh_interpreter()
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


def _as_a_fresh_interpreter() -> None:
    """Undo what the fork server's preload of the user's ``__main__`` may have set that a fresh server would not
    have: the root logger's level and handlers, torch's default dtype."""
    import torch

    logging.root.handlers.clear()
    logging.root.setLevel(logging.WARNING)
    torch.set_default_dtype(torch.float32)


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
