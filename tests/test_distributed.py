"""Multi-process runs on localhost CPU devices (`qerl_jax.distributed`, jax.distributed + gloo).

The reference is one process with two forced host devices and mesh.data = 2 (the suite's
`two_device_tiny_run`, itself equal to one device: the per-shard rollouts draw one call's tokens).
A two-process run (one device each) of the same command must give the same rewards, losses and
adapter. One of its processes is killed after the
first checkpoint: the other stops (no hang), and both resumed finish the run. A run that succeeds
ends cleanly: no gRPC error on stderr, process 0 (the coordination service's host) last.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import REPO, TWO_DEVICE_RUN_FLAGS, forced_devices_xla_flags

STEPS = tuple(f for f in TWO_DEVICE_RUN_FLAGS if f.startswith(("--config.train.", "--config.eval.")))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# Put first on PYTHONPATH, it gives jax.distributed.initialize a heartbeat timeout of HEARTBEAT_S
# instead of jax's 100 s: a process whose peer was killed outside a collective is stopped by the
# coordination service once the peer's heartbeats are missed, and the suite need not wait 100 s.
HEARTBEAT_S = 15
SHORT_HEARTBEAT_SITECUSTOMIZE = f"""
import functools, jax
_initialize = jax.distributed.initialize
@functools.wraps(_initialize)
def initialize(*args, **kwargs):
    kwargs.setdefault("heartbeat_timeout_seconds", {HEARTBEAT_S})
    return _initialize(*args, **kwargs)
jax.distributed.initialize = initialize
"""


def _short_heartbeat_dir() -> str:
    from conftest import once_per_test_run

    def write(directory: str) -> str:
        with open(os.path.join(directory, "sitecustomize.py"), "w") as f:
            f.write(SHORT_HEARTBEAT_SITECUSTOMIZE)
        return directory

    return once_per_test_run("short_heartbeat", write)


def _env(devices: int = 1, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("QERL_", "JAX_COORDINATOR", "JAX_NUM_PROC"))}
    env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=forced_devices_xla_flags(devices))
    env.update(PYTHONPATH=os.pathsep.join([_short_heartbeat_dir(), REPO]))
    env.update(extra)
    return env


def _main(workdir: str, *flags: str) -> list[str]:
    return [sys.executable, "-m", "qerl_jax.main", "--config=configs/tiny.py", f"--config.workdir={workdir}", *flags]


def _launch_pair(workdir: str, *flags: str, mesh: str = "--config.mesh.data=2", devices: int = 1) -> list[subprocess.Popen]:
    """Two processes of one run, each with `devices` local devices (2: as two hosts of two GPUs)."""
    port = _port()
    procs = []
    for pid in range(2):
        env = _env(devices, QERL_NUM_PROCESSES="2", QERL_PROCESS_ID=str(pid), JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}")
        procs.append(
            subprocess.Popen(
                _main(workdir, mesh, *flags), cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    return procs


def _finish(procs, timeout=400, ended: list[float] | None = None) -> list[tuple[int, str]]:
    """(exit code, stderr) of each process. Their pipes are drained at once, each by its own thread: read
    one after the other, a process whose pipe filled meanwhile would stall the run. `ended`, if given,
    gets each process's end (time.monotonic(), in process order)."""

    def finish(p: subprocess.Popen) -> tuple[int, str, bool, float]:
        try:
            _, err = p.communicate(timeout=timeout)
            return p.returncode, err, False, time.monotonic()
        except subprocess.TimeoutExpired:
            p.kill()
            _, err = p.communicate()
            return p.returncode, err, True, time.monotonic()

    with concurrent.futures.ThreadPoolExecutor(len(procs)) as pool:
        results = list(pool.map(finish, procs))
    for _, err, hung, _ in results:
        if hung:
            pytest.fail(f"a process of the run hung:\n{err[-3000:]}")
    if ended is not None:
        ended.extend(t for *_, t in results)
    return [(code, err) for code, err, _, _ in results]


# What jax's coordination service and gRPC print when a process polls a service that has gone (seen
# on GPUs after runs that succeeded: "WatchTasksAsync failed for task 1: UNAVAILABLE: failed to
# connect to all addresses ... Connection refused"), and absl's C++ error lines ("E1128 15:06:18...").
GRPC_ERROR = re.compile(r"WatchTasks|UNAVAILABLE|failed to connect|Connection refused|Shutdown barrier|^E\d{4} ")


def _grpc_errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if GRPC_ERROR.search(line)]


def test_grpc_errors_are_recognised():
    seen = (
        "E1127 10:00:01.000000  812 coordination_service_agent.cc:700] WatchTasksAsync failed for task 1: "
        "UNAVAILABLE: failed to connect to all addresses; last error: UNKNOWN: ipv4:127.0.0.1:12355: Connection refused"
    )
    other = "E1127 10:00:02.5 x.cc:1] other"
    assert _grpc_errors(f"qerl: 100%\n{seen}\n{other}\n") == [seen, other]
    assert _grpc_errors("I1127 10:00:01.0 client.cc:153] Distributed task shutdown result: OK\nERROR_RATE 0\n") == []


def _scalars(workdir: str) -> dict[int, dict]:
    rows = {}
    with open(os.path.join(workdir, "tensorboard", "scalars.jsonl")) as f:
        for line in f:
            row = json.loads(line)
            rows[row["step"]] = row
    return rows


def _adapter(workdir: str) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    return load_file(os.path.join(workdir, "adapter", "adapter_model.safetensors"))


@pytest.fixture(scope="module")
def runs(two_device_tiny_run):
    """The one-process mesh run (`two_device_tiny_run`), and the two-process run with one process
    killed after the first checkpoint, then resumed (once in the test run: `once_per_test_run`,
    whichever worker its tests go to)."""
    from conftest import once_per_test_run

    result = once_per_test_run("distributed_runs", _distributed_runs)
    return {**result, "single": str(two_device_tiny_run[0])}


def _distributed_runs(root: str) -> dict:
    multi = os.path.join(root, "multi")
    procs = _launch_pair(multi, *STEPS)
    first = os.path.join(multi, "checkpoints", "1")
    deadline = time.monotonic() + 300
    while not os.path.isdir(first) and time.monotonic() < deadline and procs[1].poll() is None:
        time.sleep(0.1)
    assert os.path.isdir(first), "the two-process run wrote no first checkpoint"
    procs[1].send_signal(signal.SIGKILL)
    t_kill = time.monotonic()
    killed = _finish(procs, timeout=240)
    survivor_seconds = time.monotonic() - t_kill

    ended: list[float] = []
    resumed = _finish(_launch_pair(multi, *STEPS, "--config.resume=True"), ended=ended)
    return dict(multi=multi, killed=killed, survivor_seconds=survivor_seconds, resumed=resumed, ended=ended)


def test_a_killed_process_stops_the_other_without_a_hang(runs):
    """The survivor ends, naming the lost peer: with our one line where a collective fails at once
    (gloo on a live connection), else by jax's coordination service once the peer's heartbeats
    stop (it terminates the process: "another task died")."""
    (code0, err0), (code1, _) = runs["killed"]
    assert code1 == -signal.SIGKILL
    if code0 == 0:  # process 0 had finished the whole run before the kill reached its peer
        pytest.skip("the run ended before the kill")
    assert code0 != 0 and runs["survivor_seconds"] < 200, err0[-2000:]
    ours = [line for line in err0.splitlines() if line.startswith("error:")]
    if code0 == 2:
        assert len(ours) == 1 and "another process of this run stopped" in ours[0], err0[-2000:]
    else:
        assert "another task died" in err0, err0[-2000:]


def test_resumed_two_process_run_equals_the_one_process_mesh_run(runs):
    assert [code for code, _ in runs["resumed"]] == [0, 0], runs["resumed"][0][1][-3000:]
    single, multi = _scalars(runs["single"]), _scalars(runs["multi"])
    assert sorted(single) == sorted(multi) == [0, 1, 2]
    for step in single:
        for name in ("reward/mean", "reward/mean_sampled", "train/loss", "train/grad_norm", "rollout/response_length_mean"):
            assert multi[step][name] == pytest.approx(single[step][name], rel=1e-4, abs=1e-6), (step, name)
    a, b = _adapter(runs["single"]), _adapter(runs["multi"])
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_two_hosts_of_two_devices_equal_the_one_process_mesh_run(two_device_tiny_run, tmp_path):
    """The several-hosts layout: each process feeds and scores two of the mesh's four devices. The
    per-shard rollouts draw one call's tokens whatever the shard count, so the rewards equal the
    2-device run's exactly; losses and gradient norms differ only by the order of float sums, and
    the adapter by what Adam makes of that (far below one step of lr 1e-2)."""
    multi = str(tmp_path / "hosts")
    results = _finish(_launch_pair(multi, *STEPS, mesh="--config.mesh.data=4", devices=2))
    assert [code for code, _ in results] == [0, 0], results[0][1][-3000:] + results[1][1][-3000:]
    assert not _grpc_errors(results[0][1] + results[1][1]), results[0][1][-3000:] + results[1][1][-3000:]
    single, hosts = _scalars(str(two_device_tiny_run[0])), _scalars(multi)
    assert sorted(hosts) == sorted(single) == [0, 1, 2]
    for step in single:
        for name in ("reward/mean", "reward/mean_sampled", "rollout/response_length_mean"):
            assert hosts[step][name] == single[step][name], (step, name)
        for name in ("train/loss", "train/grad_norm"):
            assert hosts[step][name] == pytest.approx(single[step][name], rel=1e-4, abs=1e-6), (step, name)
    a, b = _adapter(str(two_device_tiny_run[0])), _adapter(multi)
    assert sorted(a) == sorted(b)
    for name in a:
        np.testing.assert_allclose(b[name], a[name], rtol=0, atol=1e-3, err_msg=name)


def test_a_run_that_succeeds_ends_cleanly_with_process_0_last(runs):
    """`distributed.leave`: no gRPC error on either process's stderr, no traceback, and process 0, which
    hosts the coordination service, ends after the other (by about LEAVE_GRACE_S)."""
    from qerl_jax.distributed import LEAVE_GRACE_S

    for code, err in runs["resumed"]:
        assert code == 0 and not _grpc_errors(err) and "Traceback" not in err, err[-3000:]
    primary_end, other_end = runs["ended"]
    assert primary_end - other_end > LEAVE_GRACE_S / 2, runs["ended"]


def test_leave_returns_in_one_process():
    from qerl_jax import distributed

    assert distributed.leave() is None  # the interpreter ends as usual (the suite goes on here)


def test_only_the_first_process_writes_logs_and_holds_the_lock(runs):
    multi = runs["multi"]
    assert os.path.isfile(os.path.join(multi, "adapter", "adapter_model.safetensors"))
    event_files = [n for n in os.listdir(os.path.join(multi, "tensorboard")) if n.startswith("events")]
    assert len(event_files) == 2  # one per invocation of the primary (the killed one and the resumed one)


def test_a_held_workdir_stops_every_process_with_one_line(tmp_path):
    from qerl_jax import workdir

    with workdir.lock(str(tmp_path)):
        results = _finish(_launch_pair(str(tmp_path), *STEPS), timeout=120)
    for code, err in results:
        assert code == 2, err[-2000:]
        assert [line for line in err.splitlines() if line.startswith("error:")] == [
            next(line for line in err.splitlines() if line.startswith("error:"))
        ]
        assert "is in use by another run" in err and "Traceback" not in err
    assert not os.path.exists(tmp_path / "tiny_model")


@pytest.mark.parametrize(
    "env, flags, expected",
    [
        (dict(QERL_NUM_PROCESSES="2", QERL_PROCESS_ID="5", JAX_COORDINATOR_ADDRESS="127.0.0.1:1"), (), "QERL_PROCESS_ID=5"),
        (dict(QERL_NUM_PROCESSES="2", QERL_PROCESS_ID="0"), (), "JAX_COORDINATOR_ADDRESS"),
        ({}, ("--config.mesh.data=4",), "mesh.data x mesh.model = 4 devices, but only 1 is available"),
        ({}, ("--config.mesh.data=-1", "--config.rollout.prompts_per_step=3", "--config.rl.micro_batch_size=4"), "prompts_per_step = 3"),
    ],
)
def test_bad_multi_process_settings_are_one_line_before_anything_is_written(tmp_path, env, flags, expected):
    devices = 2 if "--config.mesh.data=-1" in flags else 1
    proc = subprocess.run(
        _main(str(tmp_path / "run"), *flags), cwd=REPO, env=_env(devices=devices, **env), capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and expected in errors[0], proc.stderr[-2000:]
    assert not os.path.exists(tmp_path / "run")
