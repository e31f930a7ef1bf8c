"""lightning_rudra benchmark suite: one command, a table on stdout, the numbers as JSON.

    python -m benchmarks.run [--quick] [--only PHASES] [--out benchmarks/results] [--name latest] [--allow-modified]

1. Transport: a push+pull round trip through the real server (async) for 10 k, 1 M, 10 M and 50 M float32, against
   a gloo all-reduce of the same buffer between the same 2 processes and a memcpy; TensorPipe settings for a
   bare RPC round trip; prototype fixes for the push path.
2. End to end, no straggler: samples/s of the MNIST-1D example module under every Rudra protocol and DDP.
3. One learner 3x slower: async and 2-softsync against DDP.
4. Time to a fixed test accuracy on MNIST-1D, from the same runs as 2.
5. Epochs with one straggler (3x, 8x slower), 2 and 4 learners: time per epoch and time to accuracy of async
   (the shared epoch) against DDP.
6. Real model sizes: MLPs of 10 M and 50 M parameters on synthetic data, 2 and 4 learners: samples/s over whole
   epochs of hardsync, async and async without shared memory against DDP, and of async with one 3x straggler.
7. Time to DDP's accuracy (``benchmarks.accuracy``): momentum SGD at DDP's rate, 2 and 4 learners, one 3x
   straggler and none: the time async with its default options (or the strategies ``--accuracy-strategies``
   names) takes to reach DDP's final test accuracy.
8. Across hosts (``benchmarks.network``, needs root): two hosts as network namespaces, the link shaped to 1 and
   10 Gbit/s, the 10 M MLP with 1 and 2 learners per host: samples/s and bytes on the link per step of DDP, Rudra
   hardsync and async, with and without compressed pushes.

Results go to ``benchmarks/results`` only from a commit's code (``benchmarks.provenance``); the README's table is made
from them by ``python -m benchmarks.readme``.

Everything runs in long-lived worker processes (``benchmarks.pool``) so that process start-up is paid once;
each comparison is measured in the same run, repeated, and reported as the median of per-round ratios.
See ``benchmarks/README.md``.
"""

import argparse
import os
import time
import traceback
from typing import Any, Optional

from benchmarks import network, provenance, report, targets
from benchmarks.config import DEFAULT, PHASES, QUICK, STRATEGIES, TRAINING
from benchmarks.suite import Suite


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer sizes, settings and repeats: about 2 minutes")
    parser.add_argument(
        "--out",
        default=os.path.join(provenance.ROOT, provenance.RESULTS),
        help="folder for NAME.json and NAME.md (default: benchmarks/results, where only a commit's code may write)",
    )
    parser.add_argument("--name", default="latest", help="the results files' name (default: latest)")
    parser.add_argument(
        "--allow-modified",
        action="store_true",
        help="write into benchmarks/results even if the code differs from HEAD: the results say modified, and "
        "`git diff HEAD` goes beside them (NAME.diff)",
    )
    parser.add_argument(
        "--only",
        default=",".join(PHASES),
        help="comma-separated phases to run (straggler needs e2e for its calibration; epochs, "
        "models and accuracy calibrate themselves)",
    )
    parser.add_argument(
        "--network",
        help="the network phase's configurations instead of the mode's, comma-separated: "
        "RATE:LEARNERS_PER_HOST:REPS[:STRATEGY/STRATEGY...][:PARAMS][:bμ], e.g. 1gbit:2:2:ddp/hardsync/hardsync+no_aggregation "
        "or 1gbit:1:1:ddp/hardsync:50M:b256 (PARAMS: the MLP's size, 10M without it; μ: the batch per learner, 32 "
        "without it); LEARNERS_PER_HOST 1+s: DDP with 1 "
        "learner per host and +server_node strategies with both on host 0 and a server node on host 1 "
        "(1gbit:1:2:ddp/hardsync,1gbit:1+s:2:ddp/hardsync+server_node)",
    )
    # the accuracy phase's configurations, so that a run of other ones needs no edit of config.py (its report's
    # command, which names them, reruns it)
    parser.add_argument(
        "--accuracy-strategies",
        help="the Rudra strategies the accuracy phase times against DDP, comma-separated keys of "
        "benchmarks.config.STRATEGIES (default: async), e.g. async,batchsync,hardsync+backup1",
    )
    parser.add_argument("--accuracy-learners", help="its λ, comma-separated (default: 2,4)")
    parser.add_argument(
        "--accuracy-stragglers",
        help="its stragglers, comma-separated K:HOW (K: how many times slower, 1 for none; HOW: sleep or busy), "
        "e.g. 3:sleep,1:sleep; every λ gets each of them (default: 3:sleep,3:busy,1:sleep, busy with 4 learners only)",
    )
    parser.add_argument("--accuracy-reps", type=int, help="its runs of each Rudra strategy per row (default: 5)")
    parser.add_argument(
        "--accuracy-rudra-epochs",
        type=int,
        help="the epochs each Rudra strategy may train, at least DDP's (default: 30 against DDP's 20; --quick: 6 against 4)",
    )
    args = parser.parse_args(argv)
    cfg = dict(QUICK if args.quick else DEFAULT)
    try:
        if args.network:
            cfg["network"] = [network.parse_spec(spec) for spec in args.network.split(",")]
        cfg.update(accuracy_options(args, cfg))
    except ValueError as error:
        parser.error(str(error))
    phases = [p for p in args.only.split(",") if p]
    try:  # before hours of running, not after
        tree = provenance.check_tree(args.out, args.allow_modified)
    except provenance.ModifiedTree as error:
        parser.exit(2, f"benchmarks.run: refused: {error}\n")
    meta = provenance.meta("quick" if args.quick else "default", tree, "benchmarks.run", argv)
    suite = Suite(cfg, args.quick)
    suite.log(f"lightning_rudra benchmark, {meta['mode']} mode, phases: {', '.join(phases)}")
    try:
        suite.start_pools(phases)
        for phase in PHASES:
            if phase in phases:
                try:
                    suite.run(phase)
                except Exception as error:  # keep what the other phases measured
                    suite.failures.append(f"{phase}: {type(error).__name__}: {error}")
                    suite.log(f"phase {phase} failed:\n{traceback.format_exc()}")
    finally:
        suite.close()
    meta["duration_s"] = time.monotonic() - suite.t0
    meta["loadavg_end"] = os.getloadavg()
    meta["config"] = {**cfg, "training": TRAINING}
    suite.summary["targets"] = targets.check_targets(suite.summary)
    result = {"meta": meta, "summary": suite.summary, "raw": suite.raw, "failures": suite.failures}
    markdown = report.render_markdown(result)
    print(markdown)
    try:
        provenance.write(args.out, args.name, result, markdown, tree)
    except provenance.ModifiedTree as error:
        parser.exit(2, f"benchmarks.run: refused: {error}\n")
    suite.log(f"wrote {os.path.join(args.out, args.name)}.json and .md")
    return result


def accuracy_options(args: argparse.Namespace, cfg: dict[str, Any]) -> dict[str, Any]:
    """The accuracy phase's settings that ``args`` names (the ``--accuracy-*`` flags), over the mode's (``cfg``);
    ``ValueError`` saying what is wrong with one."""
    out: dict[str, Any] = {}
    if args.accuracy_strategies is not None:
        keys = [k for k in args.accuracy_strategies.split(",") if k]
        wrong = [k for k in keys if k not in STRATEGIES or STRATEGIES[k][0] == "ddp"]
        if wrong or not keys:
            raise ValueError(
                f"--accuracy-strategies {args.accuracy_strategies!r}: {', '.join(wrong) or 'none named'} is not a "
                f"Rudra strategy of benchmarks.config.STRATEGIES: expected some of "
                f"{', '.join(k for k, s in STRATEGIES.items() if s[0] != 'ddp')}"
            )
        if "hivemind" in keys:  # before the DDP runs, not after them
            from benchmarks.peers import require_hivemind

            try:
                require_hivemind()
            except ImportError as error:
                raise ValueError(f"--accuracy-strategies {args.accuracy_strategies!r}: {error}") from None
        out["accuracy_strategies"] = keys
    if args.accuracy_learners is not None:
        try:
            out["accuracy_learners"] = [int(n) for n in args.accuracy_learners.split(",") if n]
        except ValueError:
            raise ValueError(
                f"--accuracy-learners {args.accuracy_learners!r}: expected numbers, e.g. 4 or 2,4"
            ) from None
        if not out["accuracy_learners"] or min(out["accuracy_learners"]) < 2:
            raise ValueError(f"--accuracy-learners {args.accuracy_learners!r}: expected λ of 2 or more")
    if args.accuracy_stragglers is not None:
        stragglers = []
        for spec in (s for s in args.accuracy_stragglers.split(",") if s):
            k, _, how = spec.partition(":")
            try:
                slowdown = float(k)
            except ValueError:
                slowdown = 0.0
            if slowdown < 1 or how not in ("sleep", "busy"):
                raise ValueError(
                    f"--accuracy-stragglers: {spec!r} is not K:HOW (K >= 1, how many times slower; HOW: sleep or busy)"
                )
            stragglers.append((int(slowdown) if slowdown.is_integer() else slowdown, how))
        out["accuracy_stragglers"] = stragglers
        # the stragglers named are run with every λ, busy-waiting ones too
        out["accuracy_busy_learners"] = out.get("accuracy_learners", cfg["accuracy_learners"])
    if args.accuracy_reps is not None:
        if args.accuracy_reps < 1:
            raise ValueError(f"--accuracy-reps {args.accuracy_reps}: expected 1 or more")
        out["accuracy_reps"] = args.accuracy_reps
    if args.accuracy_rudra_epochs is not None:
        if args.accuracy_rudra_epochs < cfg["accuracy_epochs"]:
            raise ValueError(
                f"--accuracy-rudra-epochs {args.accuracy_rudra_epochs}: expected at least DDP's "
                f"{cfg['accuracy_epochs']} epochs (the target is DDP's accuracy after them)"
            )
        out["accuracy_rudra_epochs"] = args.accuracy_rudra_epochs
    return out


if __name__ == "__main__":
    main()
