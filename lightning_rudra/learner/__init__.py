"""Layer 2, a learner's side without Lightning: the RPC client, the learner that pushes and pulls through it, the
shared epoch's sampler and the simulated learners."""
