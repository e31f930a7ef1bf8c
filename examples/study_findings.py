"""The paper-scale report: the Rudra paper's three findings, answered with numbers (``findings.md``, plots)."""

from pathlib import Path


def write_findings(rows: list[dict[str, str]], out: Path) -> list[Path]:
    return []
