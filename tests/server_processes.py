"""The server processes of a run still there, whether fresh interpreters (``popen``, ``spawn``: their command line
names the server) or forked by this test process's server starter (``forkserver``: its record names them)."""

import os
import time
from typing import Optional

from lightning_rudra.server.starter import SERVER_STARTER, forked_servers


def server_pids(port: int, server: Optional[int] = None) -> list[int]:
    """The pids of the server processes of the run on ``port`` (``server``: that one only), read from /proc (ps may
    cut lines) and from the starter's record; a zombie counts as ended."""
    found = []
    for pid, argv in {**_fresh_servers(), **_forked()}.items():
        named = f"tcp://127.0.0.1:{port}" in argv and "--server" in argv
        if named and (server is None or argv[argv.index("--server") + 1] == str(server)) and running(pid):
            found.append(pid)
    return sorted(found)


def _fresh_servers() -> dict[int, list[str]]:
    found = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as file:
                argv = file.read().decode(errors="replace").split("\0")
        except OSError:
            continue
        if any("lightning_rudra.server.process" in arg for arg in argv):
            found[int(entry)] = argv
    return found


def _forked() -> dict[int, list[str]]:
    return forked_servers(SERVER_STARTER.folder) if SERVER_STARTER.folder and SERVER_STARTER.pid else {}


def running(pid: int) -> bool:
    """A process that exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def still_running(pids: list[int], within: float = 30.0) -> list[int]:
    """Those of ``pids`` still running after ``within`` seconds: popen's children run the user's script to its end,
    which may come a little after learner 0's (its own leave, the RPC world's shutdown); one that never ends stays."""
    deadline = time.monotonic() + within
    while any(running(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [pid for pid in pids if running(pid)]
