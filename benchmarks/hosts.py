"""Several hosts on one machine: two Linux network namespaces joined by a virtual ethernet pair (needs root).

Each host has its own network stack (its own ports, its own address), and its processes run in UTS, pid and
mount namespaces of its own, with their own host name and ``/dev/shm``: a network namespace alone is not another
machine (one host name and one ``/dev/shm`` let the other host map the server's shared memory, one pid namespace
lets TensorPipe move tensors by cross-memory attach), and nothing would cross the link. The addresses exist only
inside the namespaces a test creates, and the namespaces, with any process still in them, are removed afterwards,
also when the test fails. With ``rate``, each end of the link is shaped by a token bucket (``tc qdisc ... tbf``) to
that bandwidth; latency cannot be added: this kernel has no ``netem``.

Here rather than under ``tests/`` because the benchmark's network phase (``benchmarks/network.py``) runs its hosts
with it too, and the benchmarks import nothing from the tests; the tests of several hosts import it from here.

Run as ``python -m benchmarks.hosts NAME COMMAND...``, this module is a host's first process (:func:`init`).
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
def why_no_hosts(shaped: bool = False) -> Optional[str]:
    """None where namespaces (``shaped``: and a shaped link) can be made here, else the reason (for pytest's skip)."""
    if sys.platform != "linux":
        return "network namespaces are Linux's"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if shutil.which("ip") is None:
        return "the ip command (iproute2) is not installed"
    if shaped and shutil.which("tc") is None:
        return "the tc command (iproute2) is not installed: the link cannot be shaped"
    probe = f"rudra{os.getpid()}probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=10)
    if made.returncode != 0:
        return f"a network namespace cannot be made here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=10)
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True, timeout=10)


LEFT = "LEFT ON HOST"  # how init names a process still running on its host once the command has ended
SHM_LEFT = "SHM LEFT ON HOST"  # how init names a file its command left in the host's /dev/shm
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
                    "benchmarks.hosts",
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

    def qdisc(self) -> str:
        """The queueing discipline on this host's end of the link, as ``tc qdisc show`` prints it."""
        return subprocess.run(
            ["tc", "-n", self.namespace, "qdisc", "show", "dev", self.interface],
            check=True,
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()

    def cut_link(self) -> None:
        _ip("-n", self.namespace, "link", "set", self.interface, "down")


def link_counters(interface: str) -> tuple[int, int]:
    """Bytes sent and received so far by ``interface`` of this process's network namespace (a process on a host
    reads its own end of the link)."""
    stats = Path("/sys/class/net", interface, "statistics")
    return int((stats / "tx_bytes").read_text()), int((stats / "rx_bytes").read_text())


def _shape(host: Host, rate: str) -> None:
    """A token bucket on the host's end of the link: ``rate`` (tc's units: ``1gbit``) out of it, a burst of 4 ms at
    that rate (at least 64 KiB, a TSO segment: a smaller bucket drops every large packet) and up to 20 ms queued."""
    burst = max(64 * 1024, rate_bits(rate) // 8 * 4 // 1000)
    subprocess.run(
        ["tc", "-n", host.namespace, "qdisc", "add", "dev", host.interface, "root", "tbf", "rate", rate]
        + ["burst", str(burst), "latency", "20ms"],
        check=True,
        capture_output=True,
        text=True,
        timeout=10,
    )


def rate_bits(rate: str) -> int:
    """Bits per second of a rate in tc's units (``10gbit``, ``500mbit``)."""
    for unit, scale in (("gbit", 10**9), ("mbit", 10**6), ("kbit", 10**3), ("bit", 1)):
        if rate.endswith(unit):
            return int(float(rate[: -len(unit)]) * scale)
    raise ValueError(f"rate {rate!r}: expected a number of gbit, mbit, kbit or bit (tc's units), e.g. '1gbit'")


@contextmanager
def two_hosts(rate: Optional[str] = None) -> Iterator[list[Host]]:
    """Two hosts joined by a link, shaped to ``rate`` each way if given (tc's units: ``1gbit``). Everything made
    here goes on the way out, also on an error or Ctrl-C: the processes, then the namespaces, which take their ends
    of the link and its queueing disciplines with them."""
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
            if rate is not None:
                _shape(host, rate)
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
    ``LEFT`` line for each process still running: this process's exit would kill them unseen, and a ``SHM_LEFT``
    line for each file left in the host's ``/dev/shm``. Returns the command's exit status."""
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
    for file in sorted(os.listdir("/dev/shm")):
        print(f"{SHM_LEFT} {name}: {file}", flush=True)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(init(sys.argv[1], sys.argv[2:]))
