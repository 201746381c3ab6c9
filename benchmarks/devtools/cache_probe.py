"""Which programs a training run loads from JAX's persistent compilation cache and which it compiles.

Runs `qerl_jax.main` in this process with its usual flags, every program cached (no minimum
compile time), and counts the cache's hits, misses and skipped writes, printing each miss:

    python -m benchmarks.devtools.cache_probe --config=configs/gsm8k.py --config.model.path=q15.gguf \\
        --config.workdir=/tmp/w2 --config.compile_cache_dir=/tmp/cc --config.train.stop_after_steps=1

Run it twice with the same `compile_cache_dir` (new workdirs): a warm second run should only hit.
A miss there means a program's cache key changed between runs of one config (a constant baked into
the program, a path, a kernel variant); hits that still leave a slow first step mean loading, not
compiling, is what costs.
"""

from __future__ import annotations

import collections
import logging
import sys
import time

from qerl_jax import compile_cache

EVENTS = {"cache hit": "hit", "CACHE MISS": "miss", "Not writing": "not written"}


class _Counter(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter[str] = collections.Counter()

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        for needle, event in EVENTS.items():
            if needle in message:
                self.counts[event] += 1
                if event != "hit":
                    print(f"cache {event}: {message[:240]}", file=sys.stderr)


def main() -> None:
    enable = compile_cache.enable_compilation_cache
    compile_cache.enable_compilation_cache = lambda d, min_compile_seconds=1.0, max_bytes=compile_cache.MAX_BYTES: (
        enable(d, 0.0, max_bytes)
    )
    counter = _Counter()
    log = logging.getLogger("jax._src.compiler")
    log.setLevel(logging.DEBUG)
    log.addHandler(counter)
    from qerl_jax import main as train_main  # noqa: PLC0415 (after the patch above)

    t0 = time.perf_counter()
    try:
        train_main.run()
    finally:
        print(f"persistent cache: {dict(counter.counts)} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
