"""TensorBoard logging (tensorboardX: no TensorFlow needed), a JSON-lines copy of the scalars,
and device-memory readings."""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from typing import Any, Mapping

import jax
import numpy as np


def device_memory_stats() -> dict[str, float]:
    """Bytes in use / peak on the first device, where the backend reports them (GPU; not CPU)."""
    stats = jax.local_devices()[0].memory_stats() or {}
    out = {}
    if "bytes_in_use" in stats:
        out["memory/bytes_in_use"] = float(stats["bytes_in_use"])
    if "peak_bytes_in_use" in stats:
        out["memory/peak_bytes_in_use"] = float(stats["peak_bytes_in_use"])
    return out


SCALARS_JSONL = "scalars.jsonl"


class MetricWriter:
    """Scalars and text to a TensorBoard event file under `logdir`, on disk when each call returns;
    the scalars also to `logdir/scalars.jsonl`, one {"step": ..., name: value} line per call
    (finite values only).

    Written synchronously (tensorboardX's record writer, without `SummaryWriter`'s background
    queue), so a run that stops on an error, or is killed, keeps every step it logged.

    `purge_step` (a resumed run: the step it continues from) drops what an earlier invocation
    logged at that step and after, so redone steps appear once: the rows of scalars.jsonl are
    rewritten without them, and the new event file starts with a session-start event at that step,
    on which TensorBoard discards the older files' events from that step on (event files cannot be
    truncated in place).
    """

    def __init__(self, logdir: str, purge_step: int | None = None):
        self._logdir = logdir
        with self._io():
            self._open(logdir, purge_step)

    @contextlib.contextmanager
    def _io(self):
        """A failed write (disk full, ...) as one `UserFacingError` naming the folder."""
        try:
            yield
        except OSError as e:
            from qerl_jax.errors import UserFacingError  # noqa: PLC0415 (only on failure)

            raise UserFacingError(f"cannot write the metrics to {self._logdir}: {e.strerror or e}") from None

    def _open(self, logdir: str, purge_step: int | None) -> None:
        from tensorboardX.event_file_writer import EventsWriter  # noqa: PLC0415
        from tensorboardX.proto import event_pb2  # noqa: PLC0415

        os.makedirs(logdir, exist_ok=True)
        jsonl = os.path.join(logdir, SCALARS_JSONL)
        if purge_step is not None and os.path.exists(jsonl):
            _drop_jsonl_rows_from(jsonl, purge_step)
        # The nanosecond suffix keeps two writers of one second apart, in the order TensorBoard reads them.
        self._events = EventsWriter(os.path.join(logdir, "events"), filename_suffix=f".{time.time_ns()}")
        if purge_step is not None:
            start = event_pb2.SessionLog(status=event_pb2.SessionLog.START)
            self._events.write_event(event_pb2.Event(wall_time=time.time(), step=int(purge_step), session_log=start))
            self._events.flush()
        self._jsonl = open(jsonl, "a")

    def _write(self, step: int, summaries: list) -> None:
        from tensorboardX.proto import event_pb2, summary_pb2  # noqa: PLC0415

        if summaries:
            value = [v for s in summaries for v in s.value]
            event = event_pb2.Event(wall_time=time.time(), step=int(step), summary=summary_pb2.Summary(value=value))
            self._events.write_event(event)
            self._events.flush()

    def scalars(self, step: int, metrics: Mapping[str, Any]) -> None:
        from tensorboardX import summary  # noqa: PLC0415

        out, row = [], {}
        for name, value in metrics.items():
            value = float(np.asarray(value))
            if math.isfinite(value):
                out.append(summary.scalar(name, value))
                row[name] = value
        with self._io():
            self._write(step, out)
            self._jsonl.write(json.dumps({"step": int(step), **row}) + "\n")
            self._jsonl.flush()

    def text(self, step: int, tag: str, text: str) -> None:
        from tensorboardX import summary  # noqa: PLC0415

        with self._io():
            self._write(step, [summary.text(tag, text)])

    def close(self) -> None:
        with self._io():
            self._events.close()
            self._jsonl.close()


class NullWriter:
    """A `MetricWriter` that writes nothing: the processes of a multi-process run but the first."""

    def scalars(self, step: int, metrics: Mapping[str, Any]) -> None:
        del step, metrics

    def text(self, step: int, tag: str, text: str) -> None:
        del step, tag, text

    def close(self) -> None:
        pass


def _drop_jsonl_rows_from(path: str, step: int) -> None:
    """Rewrites scalars.jsonl (atomically) without its rows at `step` and after, nor a row cut short by a kill."""
    with open(path) as f:
        lines = [line for line in f if line.strip()]
    kept = []
    for line in lines:
        try:
            if json.loads(line)["step"] < step:
                kept.append(line if line.endswith("\n") else line + "\n")
        except (ValueError, KeyError, TypeError):
            continue
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.writelines(kept)
    os.replace(tmp, path)


def read_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """All scalars of the event files under `logdir`: tag -> [(step, value)] (for tests/notebooks)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: PLC0415

    acc = EventAccumulator(logdir, size_guidance={"scalars": 0, "tensors": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_jsonl_scalars(logdir: str) -> dict[str, list[tuple[int, float]]]:
    """The scalars of `logdir/scalars.jsonl`: tag -> [(step, value)], the last value of a repeated
    step winning."""
    by_tag: dict[str, dict[int, float]] = {}
    with open(os.path.join(logdir, SCALARS_JSONL)) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                step = row.pop("step")
                for tag, value in row.items():
                    by_tag.setdefault(tag, {})[step] = value
    return {tag: sorted(values.items()) for tag, values in by_tag.items()}
