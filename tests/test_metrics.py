"""Tests for qerl_jax.metrics: a resumed run's writer logs its redone steps once, in TensorBoard and
in scalars.jsonl."""

import json
import os

from qerl_jax.metrics import SCALARS_JSONL, MetricWriter, read_jsonl_scalars, read_scalars


def test_resumed_writer_drops_the_redone_steps(tmp_path):
    logdir = str(tmp_path / "tb")
    first = MetricWriter(logdir)
    for step in range(5):  # an invocation that logged steps 0..4, then was stopped after checkpoint 3
        first.scalars(step, {"reward/mean": float(step)})
    first.close()
    with open(os.path.join(logdir, SCALARS_JSONL), "a") as f:
        f.write('{"step": 5, "reward/me')  # a row cut short by a kill

    resumed = MetricWriter(logdir, purge_step=3)
    for step in range(3, 6):
        resumed.scalars(step, {"reward/mean": 10.0 + step})
    resumed.close()

    expected = [(0, 0.0), (1, 1.0), (2, 2.0), (3, 13.0), (4, 14.0), (5, 15.0)]
    assert read_scalars(logdir)["reward/mean"] == expected
    with open(os.path.join(logdir, SCALARS_JSONL)) as f:
        steps = [json.loads(line)["step"] for line in f]
    assert steps == [0, 1, 2, 3, 4, 5]  # each step once, in order
    assert read_jsonl_scalars(logdir)["reward/mean"] == expected
    assert len([n for n in os.listdir(logdir) if n.startswith("events")]) == 2


def test_writer_without_purge_step_keeps_every_row(tmp_path):
    logdir = str(tmp_path / "tb")
    for _ in range(2):
        w = MetricWriter(logdir)
        w.scalars(0, {"x": 1.0})
        w.close()
    with open(os.path.join(logdir, SCALARS_JSONL)) as f:
        assert len(f.readlines()) == 2


def test_a_full_disk_is_one_user_facing_error(tmp_path, monkeypatch):
    import errno

    import pytest
    from tensorboardX.event_file_writer import EventsWriter

    from qerl_jax.errors import UserFacingError

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    logdir = str(tmp_path / "tb")
    w = MetricWriter(logdir)
    monkeypatch.setattr(EventsWriter, "flush", disk_full)
    with pytest.raises(UserFacingError, match=f"cannot write the metrics to {logdir}: No space left on device"):
        w.scalars(1, {"x": 1.0})
    monkeypatch.undo()

    class FullFile:
        write = flush = close = disk_full

    w._jsonl = FullFile()
    with pytest.raises(UserFacingError, match="No space left on device"):
        w.scalars(2, {"x": 1.0})
    with pytest.raises(UserFacingError, match="No space left on device"):
        w.close()
