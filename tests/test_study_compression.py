"""The compression study's grid and report, on a grid small enough to train in seconds."""

import pytest

import examples.study.compensation as compensation
import examples.study.families as families
import examples.study.compression as study


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_tiny_grid_trains_each_run_in_float32_and_in_bf16_and_reports_the_pairs(tmp_path, monkeypatch):
    monkeypatch.setattr(families, "NUM_SAMPLES", 200)
    monkeypatch.setattr(compensation, "EPOCHS", 1)
    monkeypatch.setattr(study, "RATES", {"sgd": 0.1})
    monkeypatch.setattr(study, "SEEDS", (0, 1))
    study.main(["--out", str(tmp_path)])
    rows = compensation.read_rows(tmp_path / "runs.jsonl")
    assert len(rows) == len(study.PROTOCOLS) * 2 * 2 and {r["compression"] for r in rows} == {None, "bf16"}
    results = (tmp_path / "results.md").read_text()
    assert all(f"| sgd | {name} |" in results for name in ("hardsync", "async", "1-softsync"))
    study.main(["--out", str(tmp_path), "--resume"])  # nothing left to train
    assert len(compensation.read_rows(tmp_path / "runs.jsonl")) == len(rows)
