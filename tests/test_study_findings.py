"""The paper-scale study's grid and report, on rows made up here (no training: the tiny grid in
tests/test_examples.py trains for real)."""

import json
from dataclasses import asdict

import pytest

from examples.study.findings import write_findings
from examples.study.grid import (
    PAPER_ALPHA0,
    PAPER_LEARNERS,
    PAPER_NS,
    PAPER_SEEDS,
    RunConfig,
    choose_alpha0,
    paper_grid,
    paper_grid_without_momentum,
    paper_sweep,
)


def row(config: RunConfig, error: float, staleness: dict[int, int]) -> dict[str, str]:
    values = {**asdict(config), "test_error": error, "staleness": json.dumps(staleness)}
    return {k: str(v) for k, v in values.items()}


def test_the_paper_grid_has_every_configuration_the_findings_need():
    sweep = paper_sweep()
    assert {c.lr for c in sweep} == set(PAPER_ALPHA0[0.9]) and {c.seed for c in sweep} == set(PAPER_SEEDS)
    assert {c.momentum for c in sweep} == {0.9} and {c.momentum for c in paper_sweep(momentum=0.0)} == {0.0}
    grid = paper_grid(0.1)
    assert {c.lr for c in grid} == {0.1} and {c.momentum for c in grid} == {0.9}
    plain = paper_grid_without_momentum(1.0)
    assert {(c.lr, c.momentum, c.seed) for c in plain} == {(1.0, 0.0, PAPER_SEEDS[0])}
    assert {(c.n, c.lr_modulation) for c in plain if c.learners == 30 and c.protocol != "hardsync"} == {
        (n, m) for n in PAPER_NS for m in ("none", "mean")
    }
    simulated = [c for c in grid if c.simulated]
    assert {c.learners for c in simulated} == set(PAPER_LEARNERS[1:])
    assert all(c.mu_lambda == 240 for c in simulated if c.protocol == "softsync" and c.n == 1)
    at_30 = {(c.n, c.lr_modulation) for c in simulated if c.learners == 30 and c.protocol != "hardsync"}
    assert at_30 >= {(n, m) for n in PAPER_NS for m in ("none", "mean", "per_gradient")}
    assert {(c.protocol, c.learners) for c in grid if not c.simulated and c.protocol != "single"} == {
        ("hardsync", 4),
        ("softsync", 4),
        ("async", 4),
    }
    assert len({c.key() for c in grid}) == len(grid)


def test_alpha0_is_the_lowest_mean_error_of_the_sweep_and_the_report_shows_it(tmp_path):
    error_at = {0.05: 0.30, 0.1: 0.12, 0.2: 0.15, 0.3: 0.9, 0.25: 0.2, 0.5: 0.3, 0.75: 0.11, 1.0: 0.4}
    sweeps = paper_sweep() + paper_sweep(momentum=0.0)
    rows = [row(c, error_at[c.lr] + 0.001 * (c.seed - 42), {}) for c in sweeps]
    assert choose_alpha0(rows) == 0.1 and choose_alpha0(rows, momentum=0.0) == 0.75
    swept = {c.key() for c in sweeps}
    grids = paper_grid(0.1) + paper_grid_without_momentum(0.75)
    for config in (c for c in grids if c.key() not in swept):  # the baselines at α0 ran in the sweeps
        n = max(config.n, 1)
        error = (
            0.5
            if config.lr_modulation == "none" and config.n >= 15
            else 0.9
            if config.lr_modulation == "none" and config.n == 1
            else 0.13
        )
        rows.append(row(config, error, {} if config.protocol == "single" else {n - 1: 3, n: 6, 2 * n + 1: 1}))
    written = write_findings(rows, tmp_path)
    assert [p.name for p in written] == [
        "findings.md",
        "findings_mu_lambda.png",
        "findings_staleness.png",
        "findings_modulation.png",
    ]
    report = (tmp_path / "findings.md").read_text()
    assert (
        "| 0.9 | 0.1 (chosen) | 0.121 ± 0.001 (3) |" in report and "| 0 | 0.75 (chosen) | 0.111 ± 0.001 (3) |" in report
    )
    # ⟨σ⟩ of the made-up histogram: (3(n−1) + 6n + (2n+1)) / 10; one gradient in ten beyond 2n
    assert "| 2 | 2.00 | 1.93 | 1.00e-01 | 5 |" in report
    assert "| 30 | 0.500 ± 0.000 (3) | 0.130 ± 0.000 (3) | 0.130 (1) | 0.500 (1) | 0.130 (1) |" in report
    assert (
        "| 16 | 15 | 0.130 ± 0.000 (3) | 0.130 ± 0.000 (3) | 960 | 0.130 ± 0.000 (3) | 0.130 (1) | 0.130 (1) |"
        in report
    )
    # 1-softsync rows are those with α0/⟨σ⟩, never the unmodulated ones (made up here as 0.9)
    assert "| 30 | 8 | 0.130 ± 0.000 (3) | 0.130 ± 0.000 (3) | 1800 |" in report
    assert "| 1 | 240 | 0.121 ± 0.001 (3) | (single learner) | 60 |" in report
    for png in written[1:]:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_without_a_finished_sweep_there_is_no_report(tmp_path):
    assert write_findings([], tmp_path) == []
    with pytest.raises(ValueError, match="no run of the α0 sweep has finished"):
        choose_alpha0([])
