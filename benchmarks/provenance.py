"""Where a results file comes from: the machine, the commit, and whether the code that ran is the commit's.

A results file in ``benchmarks/results/`` (the default ``--out``) is published: the README's numbers are made from
it (``benchmarks.readme``). So a run whose code differs from HEAD (tracked files under ``CODE``, the results
folder left out) is refused there before it starts, and refused again at its end if the code changed meanwhile (its
numbers then go to a temporary folder). Elsewhere, or with ``--allow-modified``, it runs, its results say
``"modified": true`` and ``git diff HEAD`` is stored beside them (``NAME.diff``).
"""

import datetime
import importlib.metadata
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKOUT = ROOT  # where this module is: the code that runs must come from here too (ROOT is a tests' scratch repo)
CODE = ("lightning_rudra", "benchmarks", "examples")  # what a run's numbers depend on
RESULTS = os.path.join("benchmarks", "results")


class ModifiedTree(Exception):
    """Refused: results of code that is not a commit's, into the published results folder."""


def git(*args: str, root: Optional[str] = None) -> str:
    """A git command's stdout in the repository (``root``: ``ROOT``); "?" where git fails."""
    try:
        done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=30, cwd=root or ROOT)
    except (OSError, subprocess.SubprocessError):
        return "?"
    return done.stdout.strip() if done.returncode == 0 else "?"


def _pathspec() -> list[str]:
    return ["--", *CODE, f":(exclude){RESULTS}"]


def tree_state(root: Optional[str] = None) -> dict[str, Any]:
    """HEAD's full hash, the files under ``CODE`` that differ from it (staged or not), untracked Python files
    there or at the root (an untracked ``examples/mnist1d/__init__.py`` shadows ``examples/mnist1d.py``, a
    ``sitecustomize.py`` runs in every worker), the packages imported from another checkout, and the diff. Where
    git cannot answer, the tree counts as modified: unknown code is not a commit's."""
    files = git("diff", "HEAD", "--name-only", *_pathspec(), root=root)
    untracked = git("ls-files", "--others", "--exclude-standard", "--", *CODE, "*.py", root=root)
    modified = [] if files == "" else ["(git could not say)"] if files == "?" else files.splitlines()
    modified += [f for f in untracked.splitlines() if f.endswith(".py") and f != "?"]
    if untracked == "?" and not modified:
        modified = ["(git could not say)"]
    modified += _foreign()
    return {
        "commit": git("rev-parse", "HEAD", root=root),
        "modified_files": modified,
        "diff": git("diff", "HEAD", *_pathspec(), root=root),
    }


def _foreign() -> list[str]:
    """The packages of ``CODE`` that this process imported from outside this checkout (``CHECKOUT``: PYTHONPATH
    naming another one), each as its file."""
    out = []
    for name in CODE:
        where = getattr(sys.modules.get(name), "__file__", None)
        if where and not os.path.realpath(where).startswith(os.path.realpath(CHECKOUT) + os.sep):
            out.append(f"{name} from {os.path.realpath(where)}")
    return out


def publishes(out: str, root: Optional[str] = None) -> bool:
    """Whether ``out`` is the published results folder (or inside it)."""
    results = os.path.realpath(os.path.join(root or ROOT, RESULTS))
    path = os.path.realpath(out)
    return path == results or path.startswith(results + os.sep)


def check_tree(out: str, allow_modified: bool, root: Optional[str] = None) -> dict[str, Any]:
    """The tree's state (``tree_state``) if a run may write its results into ``out``; raises ``ModifiedTree``
    naming the modified files and what to do if it may not."""
    state = tree_state(root)
    if state["modified_files"] and publishes(out, root) and not allow_modified:
        raise ModifiedTree(
            f"the code differs from HEAD ({state['commit'][:12]}) in: {', '.join(state['modified_files'])}. "
            f"Results in {RESULTS}/ are published (the README is made from them), so they must be a commit's: "
            "commit these changes first, or write elsewhere (--out DIR), or pass --allow-modified (the results are "
            "marked modified and `git diff HEAD` is stored beside them)."
        )
    return state


def meta(mode: str, state: dict[str, Any], module: str, argv: Optional[list[str]]) -> dict[str, Any]:
    """The run's metadata: mode, its command (``python -m MODULE ARGV``), date, the commit (full hash) and whether
    the code was modified, the machine."""
    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass

    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "?"

    return {
        "mode": mode,
        "command": shlex.join(["python", "-m", module, *(sys.argv[1:] if argv is None else argv)]),
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "commit": state["commit"],
        "modified": bool(state["modified_files"]),
        "modified_files": state["modified_files"],
        # older results files say whether lightning_rudra/ alone was modified: kept for readers of both
        "package_modified": any(f.startswith("lightning_rudra/") for f in state["modified_files"]),
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "torch": version("torch"),
        "lightning": version("pytorch-lightning"),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_start": os.getloadavg(),
    }


def write(out: str, name: str, result: dict[str, Any], markdown: str, start: dict[str, Any]) -> str:
    """Write ``NAME.json``, ``NAME.md`` (and ``NAME.diff`` for modified code) into ``out``, unless the code changed
    since the run started (``start``: its ``tree_state``) and ``out`` is published: then into a temporary folder,
    and ``ModifiedTree`` is raised after, naming it. Returns the folder written."""
    end = tree_state()
    # a commit of results or docs meanwhile is no change of the code
    moved = end["commit"] != start["commit"] and git(
        "diff", "--name-only", start["commit"], end["commit"], *_pathspec()
    )
    changed = end["diff"] != start["diff"] or bool(moved)
    folder = tempfile.mkdtemp(prefix="rudra-bench-") if changed and publishes(out) else out
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(folder, f"{name}.md"), "w") as f:
        f.write(markdown)
    if start["modified_files"]:
        with open(os.path.join(folder, f"{name}.diff"), "w") as f:
            f.write(start["diff"] + "\n")
    if folder != out:
        raise ModifiedTree(
            f"the code changed during the run (HEAD {start['commit'][:12]} -> {end['commit'][:12]}, modified "
            f"{', '.join(end['modified_files']) or 'nothing'}): its results are not published; they are in {folder}"
        )
    return folder
