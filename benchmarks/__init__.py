"""GPU benchmarks of qerl-jax, each runnable as `python -m benchmarks.<name>` from the repository
root; `benchmarks.common` holds what they share (random models, the transformers peer, rollout
timing)."""

import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def with_repo_on_path(env: dict[str, str]) -> dict[str, str]:
    """`env` with the repository first on PYTHONPATH, for a benchmark's worker subprocesses (no jax
    import here: a parent sets the workers' environment before anything imports jax)."""
    return {**env, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, env.get("PYTHONPATH")]))}
