"""The compensation study's grid, report and plot, on a grid small enough to train in seconds."""

import pytest

import examples.study.compensation as study


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_tiny_grid_trains_and_reports(tmp_path, monkeypatch):
    for name, value in dict(NUM_SAMPLES=200, EPOCHS=1, LEARNERS=(2,), SEEDS=(0,), RATES={"sgd": (0.05, 0.1)}).items():
        monkeypatch.setattr(study, name, value)
    study.main(["--out", str(tmp_path)])
    rows = study.read_rows(tmp_path / "runs.jsonl")
    # the sweep (2 rates), hardsync at the chosen rate (the sweep's run, not again), async and 4-softsync × 4 rules
    assert len(rows) == 2 + 3 * len(study.RULES)
    assert all(len(r["errors"]) == (1 if r["protocol"] == "hardsync" else 2) for r in rows)
    assert {r["mean_staleness"] for r in rows if r["protocol"] == "hardsync"} == {0.0}
    findings = (tmp_path / "findings.md").read_text()
    assert "| async | 2 | 64 |" in findings and "| 4-softsync | 16 | 8 |" in findings
    assert (tmp_path / "compensation.png").stat().st_size > 0
    study.main(["--out", str(tmp_path), "--resume"])  # nothing left to train
    assert len(study.read_rows(tmp_path / "runs.jsonl")) == len(rows)
