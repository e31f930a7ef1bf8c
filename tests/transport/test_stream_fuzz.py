"""A fuzzer against a live run's stream: while a learner trains through the stream (async, one learner: exactly plain
SGD), another thread of its process throws random, truncated, oversized and well-formed-but-wrong frames at the
server's stream port: unauthenticated, with a wrong proof, and authenticated ones with a wrong method, learner,
shapes or incarnation, or a pickle that would run code. The run must end with plain SGD's weights, every wrong call
answered with an error (a connection dropped only where the frame broke the protocol), nothing run, no thread dead
(nothing on the server's stderr), no process crashed, the server's memory and threads bounded.

``RUDRA_FUZZ_SECONDS=600 python -m pytest -m slow tests/transport/test_stream_fuzz.py`` fuzzes for ten minutes
(the learner trains as long); the seed is fixed (``RUDRA_FUZZ_SEED`` changes it)."""

import os
import pickle
import random
import secrets
import socket
import threading
import time
import types

import pytest
import torch

from lightning_rudra.core.protocol import ProtocolConfig
from lightning_rudra.core.update import Push
from lightning_rudra.learner import link as link_module
from lightning_rudra.transport import frames, stream
from lightning_rudra.transport.elastic import LearnerId
from lightning_rudra.transport.frames import recv_frame, send_frame
from tests import rpc_harness as harness

SECONDS = float(os.environ.get("RUDRA_FUZZ_SECONDS", "0"))
SEED = int(os.environ.get("RUDRA_FUZZ_SEED", "32"))
MIN_STEPS, MIN_CASES, MU, LR = 40, 300, 4, 0.1

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300 + 2 * SECONDS)]


class _RunsCode:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def _status(pid: int, field: str) -> int:
    with open(f"/proc/{pid}/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith(field + ":"))


def _listening_ports(pid: int) -> set[int]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as lines:
            for line in list(lines)[1:]:
                fields = line.split()
                if fields[3] == "0A" and fields[9] in inodes:  # LISTEN
                    ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


class Fuzzer:
    """Throws one random case after another at the stream of ``offer`` until stopped; counts what came back."""

    def __init__(self, offer, model_shapes, marker):
        self.offer = offer
        self.shapes = model_shapes
        self.marker = marker  # a file that only code run by the server could create
        self.random = random.Random(SEED)
        self.cases = 0
        self.counts: dict[str, int] = {}
        self.failures: list[str] = []
        self.stop = threading.Event()

    def run(self):
        cases = [getattr(self, name) for name in sorted(dir(self)) if name.startswith("case_")]
        while not self.stop.is_set():
            case = self.random.choice(cases)
            try:
                with socket.create_connection((self.offer.address, self.offer.port), timeout=30) as sock:
                    # as the learners' stream does: without it each call's second segment waits for a delayed ack
                    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                    case(sock)
                    self._hang_up(sock)
            except Exception as error:  # an unexpected answer, or none where one was due
                self.failures.append(f"{case.__name__}: {type(error).__name__}: {error}")
            self.counts[case.__name__] = self.counts.get(case.__name__, 0) + 1
            self.cases += 1

    def _hang_up(self, sock):
        """Close, and wait for the server to close too: its connection no longer counts against its limit."""
        try:
            sock.shutdown(socket.SHUT_WR)
            while sock.recv(65536):
                pass
        except OSError:
            pass

    def _bytes(self, n):
        return bytes(self.random.getrandbits(8) for _ in range(n))

    def _prove(self, sock, secret=None):
        said = stream.read_exactly(sock, len(stream.MAGIC) + stream.NONCE)
        challenge, answer = said[len(stream.MAGIC) :], secrets.token_bytes(stream.NONCE + stream.SESSION)
        sock.sendall(
            stream.MAGIC + answer + stream.handshake_proof(secret or self.offer.secret, b"learner", challenge, answer)
        )
        return stream.read_exactly(sock, stream.PROOF_SIZE)

    def _closed(self, sock):
        try:
            return sock.recv(1024) == b""
        except ConnectionResetError:
            return True

    def _refused(self, sock, call, expected, number=1):
        """An authenticated call (the first of its session: ``number`` 1) that must be answered with an error
        containing ``expected``."""
        self._prove(sock)
        frames.Frame.encode(call).send(sock, number)
        while True:
            reply = recv_frame(sock, self.offer.limits)
            if reply is not frames.KEEPALIVE:
                break
        assert reply[0] == "error" and expected in reply[2], reply

    # strangers: nothing they send is read beyond the handshake
    def case_random_bytes_unauthenticated(self, sock):
        stream.read_exactly(sock, len(stream.MAGIC) + stream.NONCE)  # the challenge
        # a whole handshake's worth or more, so that the server judges it at once (fewer is a truncated handshake)
        answer = len(stream.MAGIC) + stream.NONCE + stream.SESSION + stream.PROOF_SIZE
        sock.sendall(self._bytes(self.random.randrange(answer, 300)))
        assert self._closed(sock)

    def case_pickle_instead_of_a_proof(self, sock):
        stream.read_exactly(sock, len(stream.MAGIC) + stream.NONCE)
        send_frame(sock, ("leave", LearnerId(0), _RunsCode(self.marker)))
        assert self._closed(sock)

    def case_truncated_handshake(self, sock):
        sock.recv(8)
        sock.sendall(stream.MAGIC + self._bytes(self.random.randrange(0, 60)))

    def case_wrong_proof(self, sock):
        try:
            self._prove(sock, secret=secrets.token_bytes(32))
        except ConnectionError:
            return
        raise AssertionError("a wrong proof was taken")

    # members of the run (they know the secret) that send what no learner would
    def case_random_frame(self, sock):
        self._prove(sock)
        sock.sendall(self._bytes(self.random.randrange(1, 4096)))

    def case_oversized_frame(self, sock):
        self._prove(sock)
        big = self.offer.limits.tensors + self.random.randrange(1, 1 << 40)
        sock.sendall(frames._NUMBER.pack(1) + frames._HEADER.pack(self.random.randrange(1, 100), big))
        reply = recv_frame(sock, self.offer.limits)
        assert reply[0] == "error" and "is not one of this run's stream" in reply[2], reply
        assert self._closed(sock)

    def case_truncated_frame(self, sock):
        self._prove(sock)
        frame = frames.Frame.encode(self._push(LearnerId(0), [torch.ones(self.shapes[0])]))
        data = frames._NUMBER.pack(1) + frame.head + b"".join(bytes(frames._bytes(t)) for t in frame.tensors)
        sock.sendall(data[: self.random.randrange(1, len(data))])

    def case_wrong_method(self, sock):
        method, args = self.random.choice(
            [("leave", (LearnerId(0), "fuzz")), ("register", ()), ("load_optimizer_state", (0, {})), ("evil", ())]
        )
        self._refused(sock, (method, *args), "is not a call the stream takes")

    def _push(self, learner, grads=None):
        grads = grads if grads is not None else [torch.zeros(self.shapes[0])]
        return ("push", Push(learner, 0, grads, torch.ones(len(self.shapes), dtype=torch.bool), 0, [{"lr": LR}], []))

    def case_wrong_learner(self, sock):
        learner, expected = self.random.choice(
            [(LearnerId(5), "refused: this run's learners are 0..0"), ("0", "refused"), (-1, "refused")]
        )
        self._refused(sock, self._push(learner), expected)

    def case_wrong_incarnation(self, sock):
        push = self._push(LearnerId(0, self.random.randrange(1, 5)))
        self._refused(sock, push, "this process has not asked to rejoin")

    def case_wrong_shapes(self, sock):
        grads = [torch.ones(self.random.randrange(1, 200)) for _ in range(self.random.randrange(0, 3))]
        self._refused(sock, self._push(LearnerId(0), grads), "")

    def case_wrong_arguments(self, sock):
        call = ("push", LearnerId(0)) + tuple(
            self.random.choice([1, "x", None]) for _ in range(self.random.randrange(9))
        )
        self._refused(sock, call, "")

    def case_call_out_of_order(self, sock):  # calls are numbered from 1; a new session cannot have sent one again
        number, expected = self.random.choice([(0, "out of order"), (stream.RESENT | 5, "no longer keeps the reply")])
        self._refused(sock, self._push(LearnerId(0)), expected, number)

    def case_code_in_a_member_s_frame(self, sock):
        call = ("push", LearnerId(0), _RunsCode(self.marker), torch.ones(3))
        self._refused(sock, call, "is not carried by the stream")

    def case_malformed_pickle(self, sock):
        pickled = bytearray(pickle.dumps(("push", [1, 2, 3], {"a": 1.0}), protocol=5))
        for _ in range(self.random.randrange(1, 4)):
            pickled[self.random.randrange(len(pickled))] = self.random.getrandbits(8)
        self._prove(sock)
        sock.sendall(frames._NUMBER.pack(1) + frames._HEADER.pack(len(pickled), 0) + bytes(pickled))
        reply = recv_frame(sock, self.offer.limits)  # an error or, if it still means something, an answer
        assert reply[0] in ("ok", "error"), reply


def fuzzed_training(rank, clients, config, marker):
    """Learner 0 believes its server is on another host, so its pushes go over the stream; a thread fuzzes the
    stream meanwhile."""
    link_module.socket = types.SimpleNamespace(gethostname=lambda: "another-host")
    [server] = harness.SERVER_PIDS  # the one this learner started
    ports_before = _listening_ports(server)
    net, learner, wrapped = harness.start(rank, clients, config, lr=LR)
    client = clients[0]
    assert client.stream is not None, "the learner did not push over the stream"
    offer = client._sync("stream_address")
    fuzzer = Fuzzer(offer, [p.numel() for p in net.parameters()], marker)
    thread = threading.Thread(target=fuzzer.run, daemon=True)
    rss = [_status(server, "VmRSS")]
    thread.start()
    deadline = time.monotonic() + SECONDS
    steps = 0
    while steps < MIN_STEPS or fuzzer.cases < MIN_CASES or time.monotonic() < deadline:
        harness.step(net, wrapped, _rows(steps))
        steps += 1
        if steps % 10 == 0:
            rss.append(_status(server, "VmRSS"))
    learner.finish()
    fuzzer.stop.set()
    thread.join(timeout=60)
    return {
        "params": [p.detach().clone() for p in net.parameters()],
        "steps": steps,
        "stats": client.stats(),
        "stream_port_opened_late": offer.port not in ports_before,
        "cases": fuzzer.cases,
        "counts": fuzzer.counts,
        "failures": fuzzer.failures,
        "rss_kb": rss,
        "threads": _status(server, "Threads"),
    }


def _rows(step):
    return torch.arange(step * MU, (step + 1) * MU) % 96


def _plain_sgd(steps):
    net = harness.model()
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    x, y = harness.data()
    for step in range(steps):
        opt.zero_grad()
        torch.nn.functional.mse_loss(net(x[_rows(step)]), y[_rows(step)]).backward()
        opt.step()
    return [p.detach() for p in net.parameters()]


def test_a_fuzzed_stream_leaves_the_run_exact_and_the_server_whole(tmp_path):
    marker, stderr = tmp_path / "ran", tmp_path / "stderr"
    [result] = harness.run_learners(
        1, fuzzed_training, config=ProtocolConfig(1, "async"), stderr=str(stderr), marker=str(marker), timeout=30.0
    )
    assert isinstance(result, dict), result
    print(f"{result['cases']} cases over {result['steps']} steps: {result['counts']}; server RSS {result['rss_kb']} kB")
    assert not result["failures"], sorted(set(result["failures"]))[:20]
    kinds = sorted(name for name in dir(Fuzzer) if name.startswith("case_"))
    assert result["cases"] >= MIN_CASES and sorted(result["counts"]) == kinds  # every kind of case was thrown
    assert result["stream_port_opened_late"]  # not listening before a learner asked for it
    assert not marker.exists()  # nothing the fuzzer sent was run
    for mine, expected in zip(result["params"], _plain_sgd(result["steps"])):
        torch.testing.assert_close(mine, expected, rtol=0, atol=0)
    stats = result["stats"]
    assert stats.clock == result["steps"] == stats.gradients and stats.staleness == {0: result["steps"]}
    assert max(result["rss_kb"]) - result["rss_kb"][0] < 200_000, result["rss_kb"]  # kB
    assert result["threads"] < 60, result["threads"]
    printed = stderr.read_text()
    assert "Traceback" not in printed and "Exception in thread" not in printed, printed[-3000:]
    assert "unexpected error" not in printed, printed[-3000:]
