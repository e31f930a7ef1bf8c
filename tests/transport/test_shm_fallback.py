"""Shared memory that fails in real runs: a server killed in the middle of an update, a learner with the server's
host name but another /dev/shm, a /dev/shm too small for the model. Real learner and server processes."""

import ctypes
import os
import signal
import subprocess
import warnings

import pytest
import torch
import torch.distributed.rpc as rpc

from lightning_rudra.core.protocol import ProtocolConfig
from lightning_rudra.learner.learner import Learner
from lightning_rudra.transport.shm import SHM_DIR
from tests import rpc_harness as harness
from tests.learner.test_rpc import check_ok, sgd_reference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]

_CLONE_NEWNS = 0x00020000


def server_killed_mid_update(rank, clients, config):
    """The learner maps the server's weights; the server dies with the version odd, as in the middle of an
    update; the learner pulls."""
    _, learner, _ = harness.start(rank, clients, config)
    [link] = learner.links
    assert link.shm is not None
    os.kill(rpc.rpc_sync(clients[0].server, os.getpid, timeout=10), signal.SIGKILL)
    link.shm.header[0] += 1
    try:
        learner.pull()
    except RuntimeError as error:
        return str(error)
    return "pulled"


def test_a_pull_from_a_server_killed_mid_update_fails_naming_it():
    [result] = harness.run_learners(1, server_killed_mid_update, config=ProtocolConfig(1, "async"))
    assert result.startswith("the parameter server (on 127.0.0.1) ") and "middle of an update" in result, result


def train_in_another_dev_shm(rank, clients, config, steps, mu):
    """Give the thread that maps the server's files (this one) a mount namespace of its own with an empty
    /dev/shm, as a container with the host's network and host name has; then train, recording warnings."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(_CLONE_NEWNS) != 0:
        return f"skip: unshare(CLONE_NEWNS): {os.strerror(ctypes.get_errno())}"
    # private first: a mount here must not propagate to the machine's /dev/shm
    for command in (["mount", "--make-rprivate", "/"], ["mount", "-t", "tmpfs", "tmpfs", "/dev/shm"]):
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            return f"skip: {' '.join(command)}: {done.stderr}"
    offered = []  # what the server offers the learner: its files, in the machine's /dev/shm
    attach = clients[0].attach
    clients[0].attach = lambda: offered.append(attach()) or offered[-1]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = harness.train(rank, clients, config, steps, mu)
    [(names, _)] = offered
    return {
        **result,
        "warnings": [str(w.message) for w in caught],
        "left": os.listdir("/dev/shm"),
        "prefix": os.path.basename(names.header).removesuffix("header"),
    }


def test_a_learner_with_the_servers_host_name_but_another_dev_shm_uses_rpc():
    steps, mu = 4, 5
    [result] = harness.run_learners(1, train_in_another_dev_shm, config=ProtocolConfig(1, "async"), steps=steps, mu=mu)
    if isinstance(result, str) and result.startswith("skip: "):
        pytest.skip(result)
    check_ok([result])
    assert not result["shared_memory"] and result["left"] == []  # it created nothing in its /dev/shm
    assert any("could not map" in w and "through RPC instead" in w for w in result["warnings"]), result["warnings"]
    for mine, expected in zip(result["params"], sgd_reference(steps, mu)):
        torch.testing.assert_close(mine, expected, rtol=0, atol=0)
    assert not [name for name in os.listdir(SHM_DIR) if name.startswith(result["prefix"])]  # the server's are gone


@pytest.fixture
def small_tmpfs(tmp_path):
    """A tmpfs of 8 pages: the server's files fit while sparse, not once written."""
    directory = tmp_path / "shm"
    directory.mkdir()
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=32k", "tmpfs", str(directory)], capture_output=True, text=True
    )
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {done.stderr}")
    try:
        yield directory
    finally:
        subprocess.run(["umount", str(directory)], check=True)


def wide_model():
    torch.manual_seed(0)
    return torch.nn.Linear(6, 4096)  # 28 672 weights: 112 KiB, more than the small tmpfs holds


def train_wide(rank, clients, config, steps):
    net = wide_model()
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    learner = Learner(net, clients)
    [wrapped] = learner.wrap([opt])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        learner.register(config, [opt], None)
        learner.pull()
        for _ in range(steps):
            wide_step(net, wrapped)
        learner.finish()
    return {
        "params": [p.detach().clone() for p in net.parameters()],
        "warnings": [str(w.message) for w in caught],
        "shared_memory": learner.links[0].shm is not None,
    }


def wide_step(net, optimizer):
    optimizer.zero_grad()
    net(harness.data()[0]).pow(2).mean().backward()
    optimizer.step()


def test_a_dev_shm_smaller_than_the_model_falls_back_to_rpc(small_tmpfs, monkeypatch):
    monkeypatch.setenv("LIGHTNING_RUDRA_SHM_DIR", str(small_tmpfs))
    steps = 3
    [result] = harness.run_learners(1, train_wide, config=ProtocolConfig(1, "async"), steps=steps)
    check_ok([result])
    assert not result["shared_memory"] and os.listdir(small_tmpfs) == []
    assert any(
        "No space left on device" in w and f"Free space in {small_tmpfs}" in w and "through RPC instead" in w
        for w in result["warnings"]
    ), result["warnings"]
    reference = wide_model()
    opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for _ in range(steps):
        wide_step(reference, opt)
    for mine, expected in zip(result["params"], reference.parameters()):
        torch.testing.assert_close(mine, expected, rtol=0, atol=0)
