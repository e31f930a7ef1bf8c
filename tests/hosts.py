"""Several hosts on one machine: two Linux network namespaces joined by a virtual ethernet pair (needs root).

Each host has its own network stack (its own ports, its own address), and its processes run in UTS, pid and
mount namespaces of its own, with their own host name and ``/dev/shm``: a network namespace alone is not another
machine (one host name and one ``/dev/shm`` let the other host map the server's shared memory, one pid namespace
lets TensorPipe move tensors by cross-memory attach), and nothing would cross the link. The addresses exist only
inside the namespaces a test creates, and the namespaces, with any process still in them, are removed afterwards,
also when the test fails.

Run as ``python -m tests.hosts NAME COMMAND...``, this module is a host's first process (:func:`init`).
"""

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from functools import lru_cache
from typing import Iterator, Optional

REPO = Path(__file__).resolve().parent.parent


@lru_cache(maxsize=None)
def why_no_hosts() -> Optional[str]:
    """None where namespaces can be made here, else the reason (for pytest's skip)."""
    if sys.platform != "linux":
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    probe = f"rudra{os.getpid()}probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10)
    if made.returncode != 0:
        return f"a network namespace cannot be made here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


LEFT = "LEFT ON HOST"  # how init names a process still running on its host once the command has ended
_LEFT_WAIT_S = 20.0  # how long init waits for the command's other processes to end by themselves


@dataclass
class Host:
    namespace: str
    interface: str
    address: str

    def start(self, args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        """Start ``args`` on this host (its network namespace, and UTS, pid and mount namespaces of its own under
        :func:`init`, which the namespace's name names), stdout and stderr to ``log``. Killing the returned process
        kills every process on the host (init first, and the kernel the rest of its pid namespace)."""
        with open(log, "w") as out:
            return subprocess.Popen(
                [
                    "ip",
                    "netns",
                    "exec",
                    self.namespace,
                    "unshare",
                    "--uts",
                    "--pid",
                    "--fork",
                    "--kill-child",
                    "--mount-proc",
                    sys.executable,
                    "-m",
                    "tests.hosts",
                    self.namespace,
                    *args,
                ],
                env=env,
                cwd=REPO,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def pids(self) -> list[int]:
        """The processes running in this host's namespace."""
        listed = subprocess.run(["ip", "netns", "pids", self.namespace], capture_output=True, text=True, timeout=10)
        return [int(pid) for pid in listed.stdout.split()]

    def link_bytes(self) -> int:
        """Bytes this host's end of the link has sent and received so far (its interface's counters)."""
        stats = f"/sys/class/net/{self.interface}/statistics"
        read = subprocess.run(
            ["ip", "netns", "exec", self.namespace, "cat", f"{stats}/tx_bytes", f"{stats}/rx_bytes"],
            check=True,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return sum(int(count) for count in read.stdout.split())

    def cut_link(self) -> None:
        _ip("-n", self.namespace, "link", "set", self.interface, "down")


@contextmanager
def two_hosts() -> Iterator[list[Host]]:
    tag = os.getpid() % 100000
    subnet = f"10.{200 + tag % 50}.{tag // 50 % 250}"  # private, and only inside the two namespaces below
    hosts = [Host(f"rudra{tag}h{i}", f"rv{tag}h{i}", f"{subnet}.{i + 1}") for i in range(2)]
    try:
        for host in hosts:
            _ip("netns", "add", host.namespace)
        _ip("link", "add", hosts[0].interface, "type", "veth", "peer", "name", hosts[1].interface)
        for host in hosts:
            _ip("link", "set", host.interface, "netns", host.namespace)
            _ip("-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", host.interface)
            _ip("-n", host.namespace, "link", "set", host.interface, "up")
            _ip("-n", host.namespace, "link", "set", "lo", "up")
        yield hosts
    finally:
        for host in hosts:
            for pid in host.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            subprocess.run(["ip", "netns", "del", host.namespace], capture_output=True, timeout=10)


def host_env(**variables: object) -> dict[str, str]:
    """This process's environment for a host's processes, without any rendezvous variable of its own."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE", "LOCAL_RANK", "TP_SOCKET_IFNAME")
        and not key.startswith("SLURM_")
    }
    env["PYTHONPATH"] = str(REPO)
    env.update({key: str(value) for key, value in variables.items()})
    return env


def _running_here() -> list[str]:
    """The processes of this pid namespace but this one (its init), not yet reaped ones, with their command lines."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                if stat.read().rpartition(")")[2].split()[0] in ("Z", "X"):
                    continue
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                command = cmdline.read().replace(b"\0", b" ").decode(errors="replace").strip()
            found.append(f"{entry} {command}")
        except OSError:
            continue  # ended meanwhile
    return found


def init(name: str, args: list[str]) -> int:
    """A host's first process (pid 1 of its pid namespace): take the host name ``name`` and a ``/dev/shm`` of the
    host's own, run ``args``, then wait (bounded) for what it started to end by itself, reaping it, and print a
    ``LEFT`` line for each process still running: this process's exit would kill them unseen. Returns the
    command's exit status."""
    socket.sethostname(name)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1g", "tmpfs", "/dev/shm"], check=True, timeout=10)
    code = subprocess.call(args)
    deadline = time.monotonic() + _LEFT_WAIT_S
    while True:
        try:
            while os.waitpid(-1, os.WNOHANG)[0]:  # orphans are this process's to reap
                pass
        except ChildProcessError:
            pass
        left = _running_here()
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    for process in left:
        print(f"{LEFT} {name}: {process}", flush=True)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(init(sys.argv[1], sys.argv[2:]))
