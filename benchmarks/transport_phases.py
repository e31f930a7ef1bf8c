"""The transport phases (``transport``, ``variants``, ``prototypes``): push+pull through the real server against a
gloo all-reduce, an RPC echo and a memcpy; TensorPipe settings for a bare round trip; prototype fixes of the push
path. The jobs themselves run in the workers (``benchmarks.transport``).
"""

from typing import Any, Optional

from benchmarks import stats
from benchmarks.config import M, PROTOTYPES, VARIANTS
from benchmarks.report import _size_label


def _iters(size: int) -> int:
    return 21 if size < 1 * M else 7 if size <= 1 * M else 5 if size <= 10 * M else 3


def _rounds(size: int, rounds: int) -> int:
    return min(rounds, 2) if size > 10 * M else rounds  # 50 M: a round takes ~15 s here


def _push_pull(suite: Any, size: int, **more: Any) -> Optional[list[Any]]:
    """The transport job for ``size`` float32 (``more``: its other arguments), both ranks' measurements."""
    return suite.job(
        "main",
        "benchmarks.transport:rudra_transport",
        120 + 60 * size / (10 * M),
        numel=size,
        port=suite.ports(),
        gloo_port=suite.ports(),
        rounds=_rounds(size, suite.cfg["transport_rounds"]),
        iters=_iters(size),
        **more,
    )


def transport(suite: Any) -> None:
    raw: dict[str, Any] = {}
    for size in suite.cfg["sizes"]:
        result = _push_pull(suite, size)
        if result is None:
            continue
        raw[str(size)] = result[0]
        raw[str(size)]["both_rank1"] = result[1]["both"]
        e = stats.summarize_transport({str(size): result[0]})[str(size)]
        suite.log(
            f"transport {_size_label(size)}: push+pull 2 learners {e['ms']['both']:.1f} ms, 1 learner "
            f"{e['ms']['solo']:.1f} ms, gloo {e['ms']['gloo']:.1f} ms, memcpy {e['ms']['memcpy']:.1f} ms"
        )
    suite.raw["transport"] = raw
    suite.summary.setdefault("transport", {})["rudra"] = stats.summarize_transport(
        {k: {m: v for m, v in r.items() if m != "both_rank1"} for k, r in raw.items()}
    )
    for servers in suite.cfg.get("transport_servers", []):  # each job with its own gloo and memcpy references
        sharded: dict[str, Any] = {}
        for size in suite.cfg["sizes"]:
            result = _push_pull(suite, size, num_servers=servers, measures=("both", "solo", "gloo", "memcpy"))
            if result is not None:
                sharded[str(size)] = {m: v for m, v in result[0].items() if m != "clone"}
                e = stats.summarize_transport({str(size): sharded[str(size)]})[str(size)]
                suite.log(
                    f"transport {_size_label(size)}, {servers} servers: push+pull 2 learners "
                    f"{e['ms']['both']:.1f} ms ({e['both_vs_gloo']:.2f}x gloo, {e['both_vs_memcpy']:.2f}x "
                    f"memcpy), 1 learner {e['ms']['solo']:.1f} ms"
                )
        suite.raw[f"transport_{servers}_servers"] = sharded
        suite.summary["transport"].setdefault("servers", {})[str(servers)] = stats.summarize_transport(sharded)


def variants(suite: Any) -> None:
    variants = [v for v in VARIANTS if v["label"] in suite.cfg["variants"]]
    sizes = suite.cfg["variant_sizes"]
    rounds = suite.cfg["variant_rounds"]
    result = suite.job(
        "main",
        "benchmarks.transport:tp_variants",
        120 + 40 * rounds * len(variants),
        variants=variants,
        sizes=sizes,
        ports=[suite.ports() for _ in range(rounds * len(variants))],
        rounds=rounds,
        iters=[_iters(x) if x > 1 * M else 5 for x in sizes],
    )
    if result is None:
        return
    suite.raw["variants"] = result[0]
    reference = variants[0]["label"]
    summary = stats.summarize_variants(result[0], reference)
    suite.summary.setdefault("transport", {})["variants"] = summary
    suite.summary["transport"]["variants_reference"] = reference
    for label, e in summary.items():
        suite.log(
            f"TensorPipe {label}: "
            + (
                e["error"]
                or ", ".join(f"{_size_label(s)} {v['ms']:.1f} ms" for s, v in e.items() if s != "error" and v["ms"])
            )
        )


def prototypes(suite: Any) -> None:
    configs = [p for p in PROTOTYPES if p[0] in suite.cfg["prototypes"]]
    rounds = []
    for r in range(suite.cfg["prototype_rounds"]):
        this_round = {}
        for label, pool, patches, server_env, learner_patches in configs:
            result = suite.job(
                pool,
                "benchmarks.transport:rudra_transport",
                180,
                numel=10 * M,
                port=suite.ports(),
                gloo_port=suite.ports(),
                rounds=1,
                iters=5,
                measures=["both", "solo", "memcpy", "breakdown"],
                server_patches=patches,
                server_env=server_env,
                learner_patches=learner_patches,
            )
            if result is not None:
                this_round[label] = {k: v[0] for k, v in result[0].items() if v}
                suite.log(
                    f"prototype round {r}: {label}: 2 learners {1e3 * this_round[label]['both']:.1f} ms, "
                    f"1 learner {1e3 * this_round[label]['solo']:.1f} ms"
                )
        rounds.append(this_round)
    suite.raw["prototypes"] = rounds
    suite.summary.setdefault("transport", {})["prototypes"] = stats.summarize_prototypes(rounds, configs[0][0])
    suite.summary["transport"]["prototypes_reference"] = configs[0][0]
    suite._close_extra_pools()
