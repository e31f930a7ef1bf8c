"""The suite's configuration: the phases, the modes' settings (``DEFAULT``, ``QUICK``), the strategies a run can
name and their labels in the report, the training settings and the TensorPipe and prototype configurations."""

M = 1_000_000

VARIANTS = [  # TensorPipe settings for a bare round trip; the first is the one lightning_rudra pins
    {"label": "uv (lightning_rudra)", "transports": ["uv"], "channels": None},
    {"label": "uv + basic", "transports": ["uv"], "channels": ["basic"]},
    {"label": "uv + cma", "transports": ["uv"], "channels": ["cma"]},
    {"label": "uv + mpt_uv", "transports": ["uv"], "channels": ["mpt_uv"]},
    {"label": "shm", "transports": ["shm"], "channels": None},
    {"label": "shm + basic", "transports": ["shm"], "channels": ["basic"]},
    {"label": "torch default", "transports": None, "channels": None},
]

THP = {"THP_MEM_ALLOC_ENABLE": "1"}
PROTOTYPES = [  # label, pool, server patches, server-only environment, learner patches
    ("package as is", "main", [], {}, []),
    ("THP on the server", "main", [], THP, []),
    ("pack into reused buffers", "main", [], {}, ["pack_reuse"]),
    ("THP everywhere", "thp", [], {}, []),
]

STRATEGIES = {  # key -> (strategy, n, prototype changes, more RudraStrategy options)
    "ddp": ("ddp", 1, [], {}),
    # DDP's own compression, beside Rudra's bf16 rows: torch refuses its bf16_compress_hook without CUDA/NCCL (or
    # XPU), so the fp16 one, which puts the same 2 bytes per parameter on the link
    "ddp+fp16": ("ddp", 1, [], {"ddp_comm_hook": "fp16_compress_hook"}),
    "hardsync": ("hardsync", 1, [], {}),
    "softsync1": ("softsync", 1, [], {}),
    "softsync2": ("softsync", 2, [], {}),
    "async": ("async", 1, [], {}),
    "async+overlap": ("async", 1, [], {"overlap": True}),
    "async+rpc": ("async", 1, [], {"shared_memory": False}),
    "hardsync+rpc": ("hardsync", 1, [], {"shared_memory": False}),
    "hardsync+2servers": ("hardsync", 1, [], {"num_servers": 2}),
    "async+2servers": ("async", 1, [], {"num_servers": 2}),
    "async+quiet_log": ("async", 1, ["quiet_log"], {}),
    "async+overlap+quiet_log": ("async", 1, ["quiet_log"], {"overlap": True}),
    "hardsync+quiet_log": ("hardsync", 1, ["quiet_log"], {}),
    "hardsync+bf16": ("hardsync", 1, [], {"compression": "bf16"}),
    "async+bf16": ("async", 1, [], {"compression": "bf16"}),
    "async+overlap+bf16": ("async", 1, [], {"overlap": True, "compression": "bf16"}),
    # issue 34: the gradient in buckets of 4 MiB (BytePS's size) during the backward pass
    "hardsync+buckets": ("hardsync", 1, [], {"bucket_cap_mb": 4}),
    "async+buckets": ("async", 1, [], {"bucket_cap_mb": 4}),
    "async+overlap+buckets": ("async", 1, [], {"overlap": True, "bucket_cap_mb": 4}),
    "hardsync+buckets+bf16": ("hardsync", 1, [], {"bucket_cap_mb": 4, "compression": "bf16"}),
    "async+overlap+buckets+bf16": ("async", 1, [], {"overlap": True, "bucket_cap_mb": 4, "compression": "bf16"}),
    # issue 34: 4 servers per host (server s on host s mod 2): every server's round and reply its own, so the replies
    # of the first ones come back while the pushes to the others still go
    "hardsync+buckets+8servers": ("hardsync", 1, [], {"bucket_cap_mb": 4, "num_servers": 8}),
    "hardsync+8servers": ("hardsync", 1, [], {"num_servers": 8}),
    "hardsync+buckets+4servers": ("hardsync", 1, [], {"bucket_cap_mb": 4, "num_servers": 4}),
    "async+buckets+8servers": ("async", 1, [], {"bucket_cap_mb": 4, "num_servers": 8}),
    "async+overlap+buckets+8servers": ("async", 1, [], {"overlap": True, "bucket_cap_mb": 4, "num_servers": 8}),
    "hardsync+no_aggregation": ("hardsync", 1, [], {"node_aggregation": False}),
    # the network phase's "1+s" layout: both learners on host 0, the servers on host 1, a server node
    "hardsync+server_node": ("hardsync", 1, [], {"server_nodes": 1}),
    "async+server_node": ("async", 1, [], {"server_nodes": 1}),
    "hardsync+buckets+server_node": ("hardsync", 1, [], {"server_nodes": 1, "bucket_cap_mb": 4}),
    # issue 35's rounds that do not wait for the slowest learner (k, backup: lightning_rudra.core.rounds)
    "batchsync": ("batchsync", 1, [], {}),
    "hardsync+backup1": ("hardsync", 1, [], {"backup": 1}),
    # SSP at the smallest bound async can keep with 4 learners (min_blocking_staleness: λ - 1)
    "async+ssp3": ("async", 1, [], {"max_staleness": 3, "on_stale": "block"}),
    # issue 33: stale gradients clipped to the median norm of the recent ones
    "async+clip": ("async", 1, [], {"compensation": "momentum+clip"}),
    "async+syncnorm": ("async", 1, [], {"compensation": "momentum+clip+syncnorm"}),
    # issue 33: hivemind.Optimizer's peers beside them (benchmarks.peers; pip install -e ".[peers]")
    "hivemind": ("hivemind", 1, [], {}),
}
STRATEGY_LABELS = {  # key -> how the report names it
    "ddp": "DDP (gloo)",
    "ddp+fp16": "DDP (gloo), fp16_compress_hook",
    "hardsync": "Rudra hardsync",
    "softsync1": "Rudra 1-softsync",
    "softsync2": "Rudra 2-softsync",
    "async": "Rudra async",
    "async+overlap": "Rudra async, overlap=True",
    "async+rpc": "Rudra async, RPC, no shared memory (shared_memory=False)",
    "hardsync+rpc": "Rudra hardsync, RPC, no shared memory (shared_memory=False)",
    "hardsync+2servers": "Rudra hardsync, num_servers=2",
    "async+2servers": "Rudra async, num_servers=2",
    "async+quiet_log": "Rudra async, staleness logged every 50 steps (prototype)",
    "async+overlap+quiet_log": "Rudra async, overlap=True, staleness logged every 50 steps (prototype)",
    "hardsync+quiet_log": "Rudra hardsync, staleness logged every 50 steps (prototype)",
    "hardsync+bf16": 'Rudra hardsync, compression="bf16"',
    "async+bf16": 'Rudra async, compression="bf16"',
    "async+overlap+bf16": 'Rudra async, overlap=True, compression="bf16"',
    "hardsync+buckets": "Rudra hardsync, bucket_cap_mb=4",
    "async+buckets": "Rudra async, bucket_cap_mb=4",
    "async+overlap+buckets": "Rudra async, overlap=True, bucket_cap_mb=4",
    "hardsync+buckets+bf16": 'Rudra hardsync, bucket_cap_mb=4, compression="bf16"',
    "async+overlap+buckets+bf16": 'Rudra async, overlap=True, bucket_cap_mb=4, compression="bf16"',
    "hardsync+no_aggregation": "Rudra hardsync, node_aggregation=False",
    "hardsync+server_node": "Rudra hardsync, 2 learners on host 0, server_nodes=1 (host 1)",
    "async+server_node": "Rudra async, 2 learners on host 0, server_nodes=1 (host 1)",
    "hardsync+buckets+8servers": "Rudra hardsync, bucket_cap_mb=4, num_servers=8",
    "hardsync+8servers": "Rudra hardsync, num_servers=8",
    "hardsync+buckets+4servers": "Rudra hardsync, bucket_cap_mb=4, num_servers=4",
    "async+buckets+8servers": "Rudra async, bucket_cap_mb=4, num_servers=8",
    "async+overlap+buckets+8servers": "Rudra async, overlap=True, bucket_cap_mb=4, num_servers=8",
    "hardsync+buckets+server_node": "Rudra hardsync, bucket_cap_mb=4, 2 learners on host 0, server_nodes=1 (host 1)",
    "batchsync": "Rudra K-batch-sync (K = λ)",
    "hardsync+backup1": "Rudra hardsync, backup=1",
    "async+ssp3": 'Rudra async, SSP (max_staleness=3, on_stale="block")',
    "async+clip": 'Rudra async, compensation="momentum+clip"',
    "async+syncnorm": 'Rudra async, compensation="momentum+clip+syncnorm" (the default before dana)',
    "hivemind": "hivemind.Optimizer 1.1.12 (peers in a torch loop, gradients averaged every μ·λ samples)",
}

DEFAULT = {
    "sizes": [10_000, 1 * M, 10 * M, 50 * M],
    "transport_rounds": 3,
    "transport_servers": [2],
    "variant_sizes": [10_000, 1 * M, 10 * M, 50 * M],
    "variant_rounds": 2,
    "variants": [v["label"] for v in VARIANTS],
    "prototype_rounds": 2,
    "prototypes": [p[0] for p in PROTOTYPES],
    "e2e_reps": 3,
    "e2e_steps": 600,
    "target_accuracy": 0.6,
    "snapshot_every": 5,
    "ddp_every": 3,
    "e2e_strategies": [
        "ddp",
        "hardsync",
        "softsync1",
        "softsync2",
        "async",
        "async+overlap",
        "async+overlap+quiet_log",
        "async+rpc",
    ],
    "straggler_reps": 3,
    "straggler_window_s": 2.5,
    "straggler_strategies": ["ddp", "async", "softsync2", "async+overlap", "async+rpc"],
    "epoch_learners": [2, 4],
    # (k, how the straggler spends its delay): a sleeping one frees its core, a busy-waiting one holds it
    "epoch_stragglers": [(3, "sleep"), (3, "busy"), (8, "sleep")],
    "epochs_per_run": 4,
    "epoch_reps": 2,
    "epoch_samples": 6000,
    "epoch_calibration_steps": 80,
    "epoch_target_accuracy": 0.4,
    "models": [
        {"params": 10 * M, "learners": 2, "samples": 384, "epochs": 4, "reps": 3},
        {"params": 50 * M, "learners": 2, "samples": 192, "epochs": 3, "reps": 1},
        {"params": 10 * M, "learners": 4, "samples": 768, "epochs": 3, "reps": 1},
    ],
    "accuracy_learners": [2, 4],
    # the Rudra strategies each timed against DDP (keys of STRATEGIES), each between two DDP runs
    "accuracy_strategies": ["async"],
    "accuracy_stragglers": [(3, "sleep"), (3, "busy"), (1, "sleep")],  # k = 1: no straggler
    # the λ that get the busy-waiting straggler's row: not λ = 2, to keep the phase near 20 minutes on 2 cores
    "accuracy_busy_learners": [4],
    "accuracy_epochs": 20,  # DDP's: to its plateau
    # the Rudra strategies': the target is time, so one whose epochs cost less may spend more of them
    "accuracy_rudra_epochs": 30,
    "accuracy_reps": 5,
    "accuracy_samples": 6000,
    "accuracy_rates": [0.025, 0.05, 0.1, 0.2, 0.4],  # DDP's rate sweep, extended past an edge winner
    "accuracy_sweep_orders": 3,
    "network": [
        {"rate": "1gbit", "learners_per_host": 1, "reps": 2},
        # hardsync there aggregates on the node by default: against the same without it
        {
            "rate": "1gbit",
            "learners_per_host": 2,
            "reps": 2,
            "strategies": [
                "ddp",
                "hardsync",
                "hardsync+no_aggregation",
                "async",
                "hardsync+bf16",
                "async+bf16",
                "ddp+fp16",
            ],
        },
        {"rate": "10gbit", "learners_per_host": 1, "reps": 1},
        # a configuration's own model size ("params"; network_params without it)
        {
            "rate": "1gbit",
            "learners_per_host": 1,
            "reps": 1,
            "params": 50 * M,
            "strategies": ["ddp", "hardsync", "async"],
        },
    ],
    "network_params": 10 * M,
    "network_steps": 6,
    "network_epochs": 3,
    "network_strategies": ["ddp", "hardsync", "async", "hardsync+bf16", "async+bf16", "ddp+fp16"],
}
QUICK = {
    "sizes": [10 * M],
    "transport_rounds": 2,
    "transport_servers": [2],
    "variant_sizes": [10_000, 10 * M],
    "variant_rounds": 1,
    "variants": ["uv (lightning_rudra)", "uv + basic", "shm", "torch default"],
    "prototype_rounds": 1,
    "prototypes": ["package as is", "pack into reused buffers"],
    "e2e_reps": 2,
    "e2e_steps": 250,
    "target_accuracy": 0.4,
    "snapshot_every": 5,
    "ddp_every": 3,
    "e2e_strategies": ["ddp", "hardsync", "softsync1", "softsync2", "async", "async+rpc"],
    "straggler_reps": 2,
    "straggler_window_s": 1.0,
    "straggler_strategies": ["ddp", "async", "softsync2", "async+rpc"],
    "epoch_learners": [2, 4],
    "epoch_stragglers": [(3, "sleep"), (3, "busy")],
    "epochs_per_run": 3,
    "epoch_reps": 1,
    "epoch_samples": 3000,
    "epoch_calibration_steps": 50,
    "epoch_target_accuracy": 0.3,
    "models": [{"params": 10 * M, "learners": 2, "samples": 384, "epochs": 3, "reps": 1}],
    "accuracy_learners": [2, 4],
    "accuracy_strategies": ["async"],
    "accuracy_stragglers": [(3, "sleep"), (3, "busy"), (1, "sleep")],
    "accuracy_busy_learners": [4],
    "accuracy_epochs": 4,
    "accuracy_rudra_epochs": 6,
    "accuracy_reps": 1,
    "accuracy_samples": 3000,
    "accuracy_rates": [0.025, 0.05, 0.1, 0.2, 0.4],
    "accuracy_sweep_orders": 1,
    "network": [{"rate": "1gbit", "learners_per_host": 1, "reps": 1}],
    "network_params": 10 * M,
    "network_steps": 4,
    "network_epochs": 2,
    "network_strategies": ["ddp", "hardsync", "async+bf16", "ddp+fp16"],
}
PHASES = ("transport", "variants", "prototypes", "e2e", "straggler", "epochs", "models", "accuracy", "network")
TRAINING = {"batch_size": 32, "lr": 0.1, "momentum": 0.5, "seed": 42, "num_samples": 4000, "warmup": 10}
# models phase: μ per learner, whatever λ; samples/s and step times after 2 warm-up batches (the first
# allocations, DDP's buckets, the server's first reply), as the runs are short
MODEL_TRAINING = {"batch_size": 32, "warmup": 2}
# no straggler; every single-host Rudra default beside the same without shared memory (RPC over loopback, as gloo)
MODEL_STRATEGIES = ["ddp", "hardsync", "async", "async+rpc", "hardsync+rpc", "hardsync+2servers", "async+2servers"]
MODEL_STRAGGLER_STRATEGIES = ["ddp", "async", "async+rpc", "async+2servers"]
MODEL_SLOWDOWN = 3
EPOCH_BATCH = 64  # μ·λ in the epochs phase, the same for every λ (the paper's rule): μ = 32 at λ = 2, 16 at 4
TRAINING_PRELOAD = (
    "pytorch_lightning",
    "lightning_rudra",
    "examples.mnist1d",
    "benchmarks.synthetic",
    "benchmarks.training",
)
