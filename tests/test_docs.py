"""The docs hold together (no processes): every relative link and every ``docs/`` path named in README.md,
CONTRIBUTING.md and docs/*.md leads to a file that exists (anchors: only the file part is checked), every
argument of ``RudraStrategy.__init__`` has its entry in docs/options.md, and the README stays short."""

import inspect
import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]
# what Lightning passes to every strategy: its plumbing, not options of ours
LIGHTNING_PLUMBING = {
    "self",
    "accelerator",
    "parallel_devices",
    "cluster_environment",
    "checkpoint_io",
    "precision_plugin",
}

_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_DOCS_PATH = re.compile(r"(?<![\w./-])docs/[\w./-]*[\w/-]|(?<![\w./-])docs/(?=[\s`)'\"])")


def _relative_links(text: str) -> list[str]:
    targets = []
    for target in _LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL (https:, mailto:) or an anchor on the same page
        targets.append(target.split("#", 1)[0])
    return targets


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_leads_to_a_file(page):
    missing = [
        target for target in _relative_links(page.read_text(encoding="utf-8")) if not (page.parent / target).exists()
    ]
    assert not missing, f"{page.relative_to(ROOT)} links to what does not exist: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_docs_path_named_exists(page):
    named = set(_DOCS_PATH.findall(page.read_text(encoding="utf-8")))
    missing = sorted(path for path in named if not (ROOT / path).exists())
    assert not missing, f"{page.relative_to(ROOT)} names docs/ paths that do not exist: {missing}"


def test_the_link_checks_see_links_and_paths():
    text = (
        "[a](docs/options.md#protocol) ![b](study/x.png) [c](https://lightning.ai) [d](#here) "
        "see `docs/study/paper/findings.md`, and docs/faults.md."
    )
    assert _relative_links(text) == ["docs/options.md", "study/x.png"]
    assert sorted(_DOCS_PATH.findall(text)) == ["docs/faults.md", "docs/options.md", "docs/study/paper/findings.md"]


def test_every_argument_of_the_strategy_is_in_the_options_reference():
    from lightning_rudra import RudraStrategy

    arguments = [
        name for name in inspect.signature(RudraStrategy.__init__).parameters if name not in LIGHTNING_PLUMBING
    ]
    assert "compensation" in arguments and "protocol" in arguments
    reference = (ROOT / "docs" / "options.md").read_text(encoding="utf-8")
    missing = [name for name in arguments if f"`{name}`" not in reference]
    assert not missing, f"docs/options.md does not describe: {missing}"


def test_the_readme_reads_in_ten_minutes():
    size = len((ROOT / "README.md").read_bytes())
    assert size <= 12 * 1024, f"README.md is {size} bytes: move the reference to docs/ (at most 12288)"


def test_the_readmes_performance_table_is_what_the_committed_results_files_make():
    # python -m benchmarks.readme wrote it: a results file rerun (or a hand edit of the table) without rewriting it
    # fails here; a shallow clone lacks the commits the results name
    shallow = subprocess.run(
        ["git", "rev-parse", "--is-shallow-repository"], cwd=ROOT, capture_output=True, text=True, timeout=30
    )
    if shallow.returncode != 0 or shallow.stdout.strip() != "false":
        pytest.skip("needs the repository's history (not a shallow clone)")
    from benchmarks import readme

    text = (ROOT / "README.md").read_text(encoding="utf-8")
    assert readme.render(text) == text, "README.md's table is stale: run python -m benchmarks.readme and commit it"
