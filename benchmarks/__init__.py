"""Benchmarks for lightning_rudra: transport, end-to-end throughput, stragglers, time to accuracy.

Run ``python -m benchmarks.run [--quick] [--out benchmarks/results]`` from the repository root; see
``benchmarks/README.md``. This package imports nothing heavy on purpose: the parameter-server process
imports ``benchmarks._echo`` when a learner asks it to echo a tensor.
"""
