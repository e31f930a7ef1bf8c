"""Running the study: each configuration in a subprocess of its own, one row of ``runs.csv`` per finished run."""

import csv
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Optional

from examples.study.grid import CSV_FIELDS, RESULT_FIELDS, RunConfig

REPO_ROOT = Path(__file__).resolve().parents[2]  # examples/study/runs.py: the repository


class RunFailed(RuntimeError):
    pass


def run_one(config: RunConfig, timeout: float, log_dir: Path) -> dict[str, Any]:
    """Train ``config`` in a subprocess (its own process group, so a timeout stops learners and server too)."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(REPO_ROOT)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    )
    env.setdefault("OMP_NUM_THREADS", "1")  # λ learners + a server share the cores: one thread each
    env.pop("MASTER_PORT", None)  # let Lightning pick a free port for every run
    with tempfile.TemporaryDirectory(prefix="rudra_study_") as tmp:
        result_path = Path(tmp) / "result.json"
        log_path = Path(tmp) / "output.log"
        command = [sys.executable, "-m", "examples.study.runner", *config.runner_args(), "--result", str(result_path)]
        start = time.perf_counter()
        with open(log_path, "w") as log:
            process = subprocess.Popen(
                command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
            try:
                returncode: Optional[int] = process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                returncode = None
            finally:  # also on Ctrl-C: stop the whole run (learners, server), not just learner 0
                _kill_group(process)
        wall = time.perf_counter() - start
        if returncode != 0 or not result_path.exists():
            log_dir.mkdir(parents=True, exist_ok=True)
            saved = log_dir / f"failed_{_slug(config)}.log"
            saved.write_text(log_path.read_text(errors="replace"))
            why = "timed out" if returncode is None else f"exit code {returncode}"
            raise RunFailed(f"{why} after {wall:.0f} s; output in {saved}")
        result = json.loads(result_path.read_text())
    result["wall_s"] = wall
    result["train_s"] = result.pop("train_seconds")
    return result


def _kill_group(process: subprocess.Popen) -> None:
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    process.wait()


def _slug(config: RunConfig) -> str:
    return "_".join(str(v).replace(".", "p") for v in config.key())


def read_rows(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    with open(path, newline="") as f:
        return [row for row in csv.DictReader(f) if row.get("protocol")]


def append_row(path: Path, config: RunConfig, result: dict[str, Any]) -> None:
    _upgrade(path)
    new = not path.exists() or path.stat().st_size == 0
    row: dict[str, Any] = {**asdict(config), "mu_lambda": config.mu_lambda}
    for name in RESULT_FIELDS[1:]:
        value = result.get(name)
        if name == "staleness":
            value = json.dumps(value or {}, separators=(",", ":"))
        elif isinstance(value, float):
            value = f"{value:.6g}"
        row[name] = "" if value is None else value
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS)
        if new:
            writer.writeheader()
        writer.writerow(row)
        f.flush()
        os.fsync(f.fileno())


def _upgrade(path: Path) -> None:
    """A ``runs.csv`` written before the configuration gained fields gets them (empty: their defaults)."""
    if not path.exists() or path.stat().st_size == 0:
        return
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        if reader.fieldnames == CSV_FIELDS:
            return
        rows = list(reader)
    tmp = path.with_suffix(".csv.tmp")
    with open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=CSV_FIELDS, restval="", extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    os.replace(tmp, path)


def row_key(row: dict[str, str]) -> tuple[Any, ...]:
    return RunConfig.from_row(row).key()
