"""What lightning_rudra logs (``transport/logs.py``): the switch that logs long waits (``RUDRA_LOG_WAITS``) on the
server's side (in-process) and through a real run (the popen launcher: what learner 0 and the server write to
stderr), the refusal of a bad value, and the server process's stderr handler. (A server whose stderr is broken:
tests/server/test_lost_learners.py.)"""

import io
import logging
import re
import threading
import time

import pytest
import torch

from lightning_rudra.core.optimizers import OptimizerSpec
from lightning_rudra.core.protocol import ProtocolConfig
from lightning_rudra.core.registration import Registration
from lightning_rudra.server import launch
from lightning_rudra.server import process as server
from lightning_rudra.server.parameter_server import ParameterServer
from lightning_rudra.transport import logs
from lightning_rudra.transport.rpc_world import StageWorld
from tests.script_runs import printed_result, run_script
from tests.server.test_lost_learners import push


@pytest.fixture
def watched():
    """Starts a server's watch, as its process does; ends it after the test."""
    servers: list[ParameterServer] = []

    def start(ps: ParameterServer) -> None:
        servers.append(ps)
        threading.Thread(target=ps.watch, daemon=True).start()

    yield start
    for ps in servers:
        ps.all_left.set()


def logged(caplog, text: str) -> str:
    """The first record that holds ``text``, once one is logged (bounded)."""
    for _ in range(600):
        found = [r.getMessage() for r in caplog.records if text in r.getMessage()]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"nothing logged with {text!r}: {[r.getMessage() for r in caplog.records]}")


@pytest.mark.slow  # waits for seconds
def test_with_the_switch_the_server_logs_each_long_wait_with_what_and_whom(monkeypatch, caplog, watched):
    monkeypatch.setenv(logs.WAITS, "0.3")
    caplog.set_level(logging.WARNING, logger="lightning_rudra")
    unregistered = ParameterServer(3, timeout=60.0, min_learners=1, name="parameter server 0")
    monkeypatch.setattr(server, "_server", unregistered)
    waits = [server.call_async("gather", 1, 0, None), server.call_async("attach", 2)]
    watched(unregistered)
    assert "parameter server 0 has waited" in logged(caplog, "for collective 1, on learners [1, 2]")
    assert "for the model, for learner 2 to pull, on learner 0, which registers it" in logged(caplog, "the model")
    assert not any(w.done() for w in waits)

    ps = ParameterServer(3, timeout=60.0, min_learners=1, name="parameter server 1")
    monkeypatch.setattr(server, "_server", ps)
    params = [torch.zeros(2)]
    spec = OptimizerSpec.from_optimizer(torch.optim.SGD(params, lr=1.0), params)
    server.call("register", Registration(ProtocolConfig(3, "hardsync"), params, [], [spec], None, False))
    pushed = [push(0, 1.0), push(2, 1.0)]
    watched(ps)
    assert "parameter server 1 has waited" in logged(caplog, "the hardsync round of optimizer 0, on learner 1")
    push(1, 1.0)
    assert all(p.done() for p in pushed)


@pytest.mark.slow  # waits for seconds
def test_without_the_switch_nothing_is_logged_of_waits(monkeypatch, caplog, watched):
    monkeypatch.delenv(logs.WAITS, raising=False)
    caplog.set_level(logging.DEBUG, logger="lightning_rudra")
    ps = ParameterServer(2, timeout=60.0, min_learners=1)  # the watch looks every second
    monkeypatch.setattr(server, "_server", ps)
    waiting = server.call_async("gather", 1, 0, None)
    watched(ps)
    time.sleep(2.5)
    assert not waiting.done() and not [r for r in caplog.records if "has waited" in r.getMessage()]


@pytest.mark.parametrize("value", ["soon", "0", "-3"])
def test_a_bad_value_of_the_switch_is_refused_naming_it_before_a_server_starts(monkeypatch, value):
    monkeypatch.setenv(logs.WAITS, value)
    with pytest.raises(ValueError, match=f"RUDRA_LOG_WAITS='{value}' is not a number of seconds: expected a positive"):
        launch.start_server(StageWorld("127.0.0.1", 1, 2, 60.0), 0)  # in the learner, before any process starts


def test_a_server_process_writes_its_records_to_stderr_as_it_printed_them(monkeypatch, server_logging):
    """A loss, at INFO, the way the server printed it before it logged; joins and refusals only at DEBUG."""
    monkeypatch.delenv(logs.LEVEL, raising=False)
    stream = io.StringIO()
    drain = server_logging(stream)
    ps = ParameterServer(2, timeout=5.0, min_learners=1)
    monkeypatch.setattr(server, "_server", ps)
    server.call("heartbeat", 1, "10.0.0.2", None)  # a join: DEBUG
    server.call("leave", 1, "ValueError: broke")
    drain(10.0)
    assert stream.getvalue() == (
        "lightning_rudra: learner 1 (on 10.0.0.2) was lost: it stopped with an error (ValueError: broke). Learners "
        "left: [0] (min_learners=1): training goes on.\n"
    )
    monkeypatch.setenv(logs.LEVEL, "LOUD")
    with pytest.raises(ValueError, match="RUDRA_LOG_LEVEL='LOUD' is not a logging level"):
        server_logging(stream)


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_with_the_switch_a_real_run_logs_who_waits_for_what_on_stderr(tmp_path, monkeypatch):
    """Learner 1 takes 4 s to set up: learner 0 and the server say, each second, that they wait at the setup barrier
    and on whom; a learner needs no logging configured for it (a warning)."""
    monkeypatch.setenv(logs.WAITS, "1")
    done = run_script(tmp_path, "waits_fit.py", "4")
    assert printed_result(done.stdout)["stats"]["clock"] == 32
    [server_said] = re.findall(
        r"lightning_rudra: parameter server 0 has waited 1 s for collective (\d+), on learner 1\n", done.stderr
    )
    learner_said = rf"learner 0 has waited 1 s for collective {server_said}, which every learner reaches, on the parameter server \(on 127.0.0.1\)\n"
    assert re.search(learner_said, done.stderr), done.stderr
