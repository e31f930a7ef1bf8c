"""Layer 1, plain torch: the clock, staleness and the update rules (protocol), what the server counts (stats), the
optimizers it rebuilds, flat buffers, shards, the shared epoch's pool and the simulated learners' timing. No RPC,
no Lightning."""
