"""Several hosts on one machine: two Linux network namespaces joined by a virtual ethernet pair (needs root).

Each host has its own network stack (its own ports, its own address); the addresses exist only inside the
namespaces a test creates, and the namespaces, with any process still in them, are removed afterwards, also when
the test fails.
"""

import os
import shutil
import signal
import subprocess
import sys
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


@dataclass
class Host:
    namespace: str
    interface: str
    address: str

    def start(self, args: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
        """Start ``args`` in this host's namespace, stdout and stderr to ``log``."""
        with open(log, "w") as out:
            return subprocess.Popen(["ip", "netns", "exec", self.namespace, *args], env=env, cwd=REPO, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)

    def pids(self) -> list[int]:
        """The processes running in this host's namespace."""
        listed = subprocess.run(["ip", "netns", "pids", self.namespace], capture_output=True, text=True, timeout=10)
        return [int(pid) for pid in listed.stdout.split()]

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
    env = {key: value for key, value in os.environ.items()
           if key not in ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "WORLD_SIZE", "LOCAL_RANK", "TP_SOCKET_IFNAME")
           and not key.startswith("SLURM_")}
    env["PYTHONPATH"] = str(REPO)
    env.update({key: str(value) for key, value in variables.items()})
    return env
