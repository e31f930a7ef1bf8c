"""The report's sections of the transport phases (``benchmarks.transport_phases``): push+pull against the references,
with several servers and where one push goes; the TensorPipe settings; the prototype fixes."""

from typing import Any

from benchmarks.report import _f, _row, _size_label, _table


def transport_tables(tr: dict[str, Any]) -> list[str]:
    """Section 1: push+pull against the references, with several servers, and where one push goes."""
    ms_cell = lambda ms, k: _f(ms.get(k), "{:.1f}")  # noqa: E731
    lines = _table(
        [
            "## 1. Transport: one synchronisation of N float32 between 2 processes",
            "Medians in ms. *push+pull, 2 learners*: both learners step at once (`Learner.push`: pack, RPC "
            "to the server, async update, weights back, load), the time one learner waits; *1 learner*: "
            "learner 1 idle. *RPC echo*: the same bytes to the same server process and back, no work. "
            "Ratios are per round, then the median.",
        ],
        (
            "N | push+pull, 2 learners | push+pull, 1 learner | RPC echo | gloo all-reduce | memcpy | "
            "copy to new memory | 2 learners / gloo | 2 learners / memcpy | 1 learner / gloo | 1 learner / memcpy"
        ),
        [
            [_size_label(size)]
            + [ms_cell(e["ms"], k) for k in ("both", "solo", "echo", "gloo", "memcpy", "clone")]
            + [_f(e.get(k)) for k in ("both_vs_gloo", "both_vs_memcpy", "solo_vs_gloo", "solo_vs_memcpy")]
            for size, e in tr["rudra"].items()
        ],
    )
    for servers, sizes in tr.get("servers", {}).items():
        lines += _table(
            [
                f"With `num_servers={servers}` (each server process owns a contiguous part of the "
                "parameter), in jobs of their own, after the one above, each with its own gloo and memcpy "
                "references:"
            ],
            (
                "N | push+pull, 2 learners | push+pull, 1 learner | gloo all-reduce | memcpy | 2 learners / gloo | "
                "2 learners / memcpy | 1 learner / memcpy"
            ),
            [
                [_size_label(size)]
                + [ms_cell(e["ms"], k) for k in ("both", "solo", "gloo", "memcpy")]
                + [_f(e.get(k)) for k in ("both_vs_gloo", "both_vs_memcpy", "solo_vs_memcpy")]
                for size, e in sizes.items()
            ],
        )
    rows = []
    for size, e in tr["rudra"].items():
        parts = [e["ms"].get(k) for k in ("pack", "server_update", "load", "echo")]
        total = sum(parts) if all(p is not None for p in parts) else None
        rows.append(
            [_size_label(size)]
            + [_f(p, "{:.1f}") for p in parts]
            + [_f(total, "{:.1f}"), ms_cell(e["ms"], "solo"), ms_cell(e["ms"], "pack_reuse")]
        )
    return lines + _table(
        [
            "Where one push goes, measured in-process on learner 0 (ms): *pack* the gradient into one "
            "flat buffer; *server update* = `Server.push` (checks, async SGD step) + `Server.pull` (copy of "
            "the weights for the reply); *load* the reply into the parameters. The rest of a 1-learner "
            "push is the RPC (compare *RPC echo*)."
        ],
        "N | pack | server update | load | RPC echo | sum | push+pull, 1 learner | pack into a reused buffer",
        rows,
    )


def variants_table(tr: dict[str, Any]) -> list[str]:
    ref = tr.get("variants_reference")
    sizes = [k for k in next(iter(tr["variants"].values())) if k != "error"]
    lines = _table(
        [
            "## TensorPipe settings: bare RPC round trip between the two workers (prototype)",
            f"Median ms (ratio to `{ref}`, the setting lightning_rudra pins). `shm` busy-polls: it "
            "burns a core per process while idle.",
        ],
        " | ".join(["setting"] + [_size_label(x) for x in sizes]),
        [],
    )
    for label, e in tr["variants"].items():
        if e.get("error"):
            lines.append(_row([label] + ["failed"] * len(sizes)) + f"  <!-- {e['error']} -->")
        else:
            lines.append(_row([label] + [f"{_f(e[x]['ms'], '{:.1f}')} ({_f(e[x]['vs_reference'])}x)" for x in sizes]))
    return lines


def prototypes_table(tr: dict[str, Any]) -> list[str]:
    def cell(e: dict[str, Any], m: str) -> str:
        return f"{_f(e[m]['ms'], '{:.1f}')} ({_f(e[m]['vs_reference'])}x)" if m in e else "–"

    return _table(
        [
            "## Prototype fixes, 10 M push+pull (ms, and ratio to the package as it is)",
            "See `benchmarks/proto.py`. *THP*: `THP_MEM_ALLOC_ENABLE=1` (torch then asks for transparent huge "
            "pages for large tensors) in the server process's environment, or in every process's. *pack into "
            "reused buffers*: the learner packs its gradient into two buffers it keeps (alternating) instead of "
            "new memory. *pack*, *server update* and *copy to new memory* are the in-process measurements on "
            "learner 0 (its environment).",
        ],
        "configuration | 2 learners | 1 learner | 2 learners / memcpy | pack | server update | copy to new memory",
        [
            [label, cell(e, "both"), cell(e, "solo"), _f(e.get("both_vs_memcpy"))]
            + [cell(e, m) for m in ("pack", "server_update", "clone")]
            for label, e in tr["prototypes"].items()
        ],
    )
