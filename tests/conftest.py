import pytest


@pytest.fixture(autouse=True)
def fresh_master_port(monkeypatch):
    """Lightning's launchers set MASTER_PORT in this process and leave it: without this, the next test's learners
    would meet on the last test's port, where that test's processes may still be closing."""
    monkeypatch.delenv("MASTER_PORT", raising=False)


@pytest.fixture
def server_logging(monkeypatch):
    """``start(stream)``: this process logs as a server process does (:func:`~lightning_rudra.transport.logs.log_to_stderr`),
    to ``stream``; returns what waits for the records to be written. Undone after the test."""
    import logging

    from lightning_rudra.transport import logs

    package = logging.getLogger("lightning_rudra")
    handlers, level, propagate = list(package.handlers), package.level, package.propagate
    yield logs.log_to_stderr
    package.handlers = handlers
    package.propagate = propagate
    package.setLevel(level)
