"""GPU benchmarks of qerl-jax, each runnable as `python -m benchmarks.<name>` from the repository
root; `benchmarks.common` holds what they share (random models, the transformers peer, rollout
timing)."""
