"""The command line."""

import argparse
import json
import os
import time
from typing import Any, Optional, Sequence

import benchmarks.predict as package
from benchmarks.predict.codec import measure_codec
from benchmarks.predict.compute import load_compute, measure_and_store
from benchmarks.predict.inputs import RESULTS, Inputs
from benchmarks.predict.report import report
from benchmarks.predict.server import measure_server
from benchmarks.predict.validate import COMPUTE_SOURCES, validation_markdown, validation_rows
from lightning_rudra.core.runtime import MEASURED_BF16, MEASURED_SERVER


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.predict", description=(package.__doc__ or "").strip().split("\n")[0]
    )
    parser.add_argument("--validate", action="store_true", help="predicted vs measured: results/predict.md, .json")
    parser.add_argument("--report", action="store_true", help="the prediction at scale (Markdown to stdout)")
    parser.add_argument("--learners", default="64,256,1000", help="λ list of the report")
    parser.add_argument("--measure-server", action="store_true", help="measure the server's time per push, update")
    parser.add_argument(
        "--measure-compute", action="store_true", help="measure one learner's compute alone: measured_compute.json"
    )
    parser.add_argument("--measure-codec", action="store_true", help="measure bf16's CPU time per parameter")
    parser.add_argument(
        "--compute",
        choices=COMPUTE_SOURCES,
        default="ddp",
        help="--validate's learner compute: from the DDP runs beside each row, or measured alone (--measure-compute)",
    )
    parser.add_argument("--out", default=RESULTS, help="where predict.md and predict.json go")
    args = parser.parse_args(argv)
    if not (args.validate or args.report or args.measure_server or args.measure_codec or args.measure_compute):
        parser.error("give --validate, --report, --measure-server, --measure-codec or --measure-compute")
    server = {"command": "python -m benchmarks.predict --measure-server", "coefficients": vars(MEASURED_SERVER)}
    if args.measure_server:
        measured = measure_server()
        print(json.dumps(measured, indent=1))
    if args.measure_codec:
        print(json.dumps(measure_codec(), indent=1))
    if args.measure_compute:
        print(json.dumps(measure_and_store(), indent=1))
    codec = {
        "command": "python -m benchmarks.predict --measure-codec",
        "coefficients": dict(zip(("learner_codec", "server_codec"), MEASURED_BF16)),
    }
    out: dict[str, Any] = {"server": server, "codec": codec, "compute": load_compute()}
    text = ""
    if args.validate:
        rows = validation_rows(Inputs(MEASURED_SERVER), args.compute)
        out["validation"] = rows
        how = (
            "from the DDP runs beside it (`--compute ddp`)"
            if args.compute == "ddp"
            else f"measured alone by `{out['compute']['command']}` (`--compute alone`)"
        )
        out["compute_from"] = args.compute
        text += validation_markdown(rows, server, how)
    if args.report:
        learners = [int(x) for x in args.learners.split(",")]
        began = time.perf_counter()
        md, rows = report(learners)
        seconds = time.perf_counter() - began
        out["report"] = rows
        out["report_seconds"] = seconds
        text += ("\n" if text else "") + md + f"\nThe report took {seconds:.0f} s to compute here.\n"
    if text:
        print(text)
    if args.validate:
        os.makedirs(args.out, exist_ok=True)
        with open(os.path.join(args.out, "predict.json"), "w") as f:
            json.dump(out, f, indent=1, default=str)
        with open(os.path.join(args.out, "predict.md"), "w") as f:
            f.write(text)
    return 0
