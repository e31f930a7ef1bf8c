import pytest


@pytest.fixture(autouse=True)
def fresh_master_port(monkeypatch):
    """Lightning's launchers set MASTER_PORT in this process and leave it: without this, the next test's learners
    would meet on the last test's port, where that test's processes may still be closing."""
    monkeypatch.delenv("MASTER_PORT", raising=False)
