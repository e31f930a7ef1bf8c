"""The protocols study (examples/study/protocols.py): a tiny grid of every protocol trained and reported, and the
straggler of its real runs (examples/study/runner.py)."""

import json
import types

import pytest

import examples.study.protocols as study
from examples.study.compensation import read_rows
from examples.study.protocols_report import LABELS, reached
from examples.study.runner import Straggler


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_tiny_grid_trains_every_protocol_by_the_servers_replies_and_reports(tmp_path, monkeypatch):
    monkeypatch.setattr(study, "NUM_SAMPLES", 400)  # 288 to train on: 2 steps of μ = 8 per learner and epoch
    monkeypatch.setattr(study, "EPOCHS", 1)
    (tmp_path / "real.jsonl").write_text(
        json.dumps(
            dict(name="ddp", seed=0, epochs=1, test_error=0.5, train_seconds=3.0, samples_per_s=100.0, late=0)
            | dict(mean_staleness=0.0, max_staleness=0, curve=[[3.0, 0.5]], wall_seconds=9, straggler=None)
        )
        + "\n"
    )
    study.main(["--out", str(tmp_path), "--seeds", "0,1"])
    rows = read_rows(tmp_path / "runs.jsonl")
    assert [(r["protocol"], r["seed"]) for r in rows] == [(p, s) for s in (0, 1) for p in study.PROTOCOLS]
    for r in rows:
        assert len(r["errors"]) == len(r["val_errors"]) == len(r["times"]) == len(r["late"]) == len(r["held"])
        assert r["disagreements"][-1] == 0, r["protocol"]  # the server decided as the order assumed
        assert r["times"] == sorted(r["times"]) and r["times"][-1] >= r["budget"] - 1e-3
        if r["protocol"] == "hardsync":  # exactly its epochs, its time the budget the others train to
            assert len(r["errors"]) == 1 and r["times"][-1] == r["budget"]
        if r["protocol"] in ("hardsync", "batchsync", "backup"):
            assert r["max_staleness"] == 0
        if r["protocol"] == "ssp":
            assert r["max_staleness"] <= 4 and r["mean_staleness"] > 0
    findings = (tmp_path / "findings.md").read_text()
    assert all(f"| {label} | 2 |" in findings for label in LABELS.values())
    assert "| ddp | 0 | 1 | 0.500 |" in findings
    assert (tmp_path / "protocols.png").exists() and (tmp_path / "real.png").exists()
    study.main(["--out", str(tmp_path), "--seeds", "0,1", "--resume"])  # nothing left to train
    assert len(read_rows(tmp_path / "runs.jsonl")) == len(rows)


def test_time_to_a_target_is_the_first_epoch_at_or_below_it():
    assert reached([0.5, 0.3, 0.4, 0.2], [1.0, 2.0, 3.0, 4.0], 0.3) == 2.0
    assert reached([0.5, 0.4], [1.0, 2.0], 0.3) is None


def test_the_straggler_is_the_last_learner_and_sleeps_only_after_its_calibration(monkeypatch):
    slept = []
    monkeypatch.setattr("examples.study.runner.time.sleep", slept.append)
    clock = iter(float(i) for i in range(100))
    monkeypatch.setattr("examples.study.runner.time.perf_counter", lambda: next(clock))
    last, first = types.SimpleNamespace(global_rank=3, world_size=4), types.SimpleNamespace(global_rank=0, world_size=4)
    straggler = Straggler(seed=0)
    for i in range(20):
        straggler.on_train_batch_start(first, None, None, i)  # not the straggler: nothing
        straggler.on_train_batch_start(last, None, None, i)
    assert straggler.mean == 2.0 and len(slept) == 20 - 14  # batches 1 s apart: mean 2 s, after 14 timed
    assert Straggler(seed=0, mean=0.5).mean == 0.5
