"""Helpers of the tests that run a script of ``tests/scripts/`` as a user runs one (a fresh interpreter, started
by hand or by a launcher) and read what it printed."""

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent


def run_script(tmp_path, name: str, *args: str, timeout: float = 200) -> subprocess.CompletedProcess:
    """``python tests/scripts/NAME ARGS...`` in ``tmp_path``, the repository on its path and no ``MASTER_PORT`` of
    this process's: its output, once it ended with 0."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("MASTER_PORT", None)
    done = subprocess.run(
        [sys.executable, str(REPO / "tests" / "scripts" / name), *args],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def print_result(**fields: Any) -> None:
    """A script's result for its test: one ``RESULT`` line (JSON), which :func:`printed_result` reads."""
    print("RESULT " + json.dumps(fields), flush=True)


def printed_result(output: str) -> dict[str, Any]:
    """What a script printed on its one ``RESULT`` line (JSON)."""
    [line] = [line for line in output.splitlines() if line.startswith("RESULT ")]
    return json.loads(line[len("RESULT ") :])
