"""The runtime model (lightning_rudra.core.runtime) against what the benchmarks measured, and its prediction at
a thousand learners.

    python -m benchmarks.predict --validate          # predicted vs measured: results/predict.md and .json
    python -m benchmarks.predict --report --learners 64,256,1000   # 100 M parameters, 10 and 100 Gbit/s
    python -m benchmarks.predict --measure-server    # the server's time per push and update (core/runtime/server_cost.py)
    python -m benchmarks.predict --measure-codec     # bf16's CPU time per parameter (core/runtime/payload.py)

Every input of a validated configuration comes from the results file it is checked against (see docs/prediction.md
for how each is read), plus the server's coefficients measured here.
"""
