"""TensorBoard logging (tensorboardX: no TensorFlow needed) and device-memory readings."""

from __future__ import annotations

import math
from typing import Any, Mapping

import jax
import numpy as np


def device_memory_bytes() -> dict[str, float]:
    """Bytes in use / peak on the first device, where the backend reports them (GPU; not CPU)."""
    stats = jax.devices()[0].memory_stats() or {}
    out = {}
    if "bytes_in_use" in stats:
        out["memory/bytes_in_use"] = float(stats["bytes_in_use"])
    if "peak_bytes_in_use" in stats:
        out["memory/peak_bytes_in_use"] = float(stats["peak_bytes_in_use"])
    return out


class MetricWriter:
    """Scalars and text to a TensorBoard event file under `logdir`."""

    def __init__(self, logdir: str):
        from tensorboardX import SummaryWriter  # noqa: PLC0415

        self._writer = SummaryWriter(logdir)

    def scalars(self, step: int, metrics: Mapping[str, Any]) -> None:
        for name, value in metrics.items():
            value = float(np.asarray(value))
            if math.isfinite(value):
                self._writer.add_scalar(name, value, step)
        self._writer.flush()

    def text(self, step: int, tag: str, text: str) -> None:
        self._writer.add_text(tag, text, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """All scalars of the event files under `logdir`: tag -> [(step, value)] (for tests/notebooks)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: PLC0415

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
