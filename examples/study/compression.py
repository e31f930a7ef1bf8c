"""What compressed pushes (``RudraStrategy(compression="bf16")``) do to test error: simulated learners at λ = 4.

    python -m examples.study.compression --out docs/study/compression

The compensation study's runs (:mod:`examples.study.compensation`: MNIST-1D, the example CNN, μλ = 128, the
package's own server, pushes in the order ``Jittered(0.3)`` gives), at λ = 4, each twice: gradients in float32, and
rounded to bfloat16 with each learner's own error feedback (``lightning_rudra.core.compression``, what a learner does
for a server on another host), the server widening them as it does. Every push is compressed, as if each learner were
on another host than the server: the most a run can be. SGD with momentum 0.9 at rate 0.1 and Adam at 0.01 (the
rates the first compensation study chose on hardsync's test error, kept so that runs compare with the committed ones); hardsync, async and 1-softsync with the default compensation;
hardsync trains ``EPOCHS`` epochs, the others twice as many; 6 seeds. A pair of runs differs only in the
compression (same data order, same push order), so the report gives each pair's difference of test error: of the
final weights, and averaged over the last ``LAST`` epochs (less of one epoch's luck: any change to a run, however
small, moves its later epochs' errors by a point or two either way, as the seeds' spread shows).
One JSON line per run in ``<out>/runs.jsonl``; ``--resume`` skips runs already there.
"""

import statistics
from pathlib import Path
from typing import Any, Optional


from examples.study import compensation

LEARNERS = 4
SEEDS = (0, 1, 2, 3, 4, 5)
LAST = 5  # epochs the second comparison averages over
RATES = {"sgd": 0.1, "adam": 0.01}
PROTOCOLS = ("hardsync", "async", "softsync")
COMPRESSIONS = (None, "bf16")


def grid() -> list[dict[str, Any]]:
    return [
        dict(
            optimizer=optimizer,
            protocol=protocol,
            learners=LEARNERS,
            n=1,
            rule="none" if protocol == "hardsync" else compensation.DEFAULT,
            seed=seed,
            epochs=compensation.EPOCHS * (1 if protocol == "hardsync" else 2),
            lr=lr,
            compression=compression,
        )
        for seed in SEEDS
        for optimizer, lr in RATES.items()
        for protocol in PROTOCOLS
        for compression in COMPRESSIONS
    ]


def write_report(rows: list[dict[str, Any]], out: Path) -> None:
    lines = [
        "# Compressed pushes: test error with gradients in bfloat16 (simulated learners, MNIST-1D, λ = 4)",
        "",
        "Made by `python -m examples.study.compression --out docs/study/compression` (the method: the module's "
        "docstring). Final test error, mean ± standard deviation over the seeds; *bf16 − float32*: per seed, the "
        "compressed run's error minus that of the same run in float32, in points: their mean ± the standard error "
        f"of that mean, and the largest in size; of the final weights, and averaged over the last {LAST} epochs.",
        "",
        "| optimizer | protocol | epochs | float32 | bf16 | bf16 − float32, final | per seed | "
        f"bf16 − float32, last {LAST} epochs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for optimizer in RATES:
        for protocol in PROTOCOLS:
            at = {
                (r["seed"], r.get("compression")): r
                for r in rows
                if (r["optimizer"], r["protocol"], r["learners"]) == (optimizer, protocol, LEARNERS)
            }
            seeds = sorted({seed for seed, c in at if c == "bf16" and (seed, None) in at})
            if not seeds:
                continue
            full = [at[(s, None)]["errors"] for s in seeds]
            bf16 = [at[(s, "bf16")]["errors"] for s in seeds]
            diffs = [100 * (b[-1] - f[-1]) for b, f in zip(bf16, full)]
            late = [100 * (statistics.mean(b[-LAST:]) - statistics.mean(f[-LAST:])) for b, f in zip(bf16, full)]
            name = protocol if protocol != "softsync" else "1-softsync"
            lines.append(
                f"| {optimizer} | {name} | {at[(seeds[0], None)]['epochs']} | "
                f"{compensation._mean([f[-1] for f in full])} | {compensation._mean([b[-1] for b in bf16])} | "
                f"{_paired(diffs)} ({max(diffs, key=abs):+.2f}) | {', '.join(f'{d:+.2f}' for d in diffs)} | "
                f"{_paired(late)} ({max(late, key=abs):+.2f}) |"
            )
    (out / "results.md").write_text("\n".join(lines) + "\n")


def _paired(diffs: list[float]) -> str:
    """Mean ± standard error of the mean."""
    error = statistics.stdev(diffs) / len(diffs) ** 0.5 if len(diffs) > 1 else 0.0
    return f"{statistics.mean(diffs):+.2f} ± {error:.2f}"


def main(argv: Optional[list[str]] = None) -> None:
    rows, out, _ = compensation.study_rows("compression", __doc__, argv, grid())
    if rows:
        write_report(rows, out)


if __name__ == "__main__":
    main()
