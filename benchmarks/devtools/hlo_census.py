"""Kernel launches per rollout decode step, counted in the program XLA compiles for an H100, on a
machine without a GPU.

    pip install "jax-cuda12-plugin==$JAXV" "jax-cuda12-pjrt==$JAXV"   # XLA's GPU compiler; no GPU needed
    JAX_PLATFORMS=cpu python -m benchmarks.devtools.hlo_census --out /tmp/census.json
    JAX_PLATFORMS=cpu python -m benchmarks.devtools.hlo_census --formats nvfp4 --batches 1 --list

XLA's GPU compiler runs without a device when it is given the device's description
(deviceless AOT compilation: `jax.experimental.topologies.get_topology_desc` with a
`target_config`; the H100 SXM's is in benchmarks/devtools/gpu_specs/h100_sxm.txtpb). For each
(format, batch), `generate`'s decode program is lowered with shape-only Qwen2.5 params
(benchmarks/common.py under `jax.eval_shape`, so a 7B model needs no memory), with the
weight copies `generate` makes on a Hopper GPU (`decode_weight_names`; the wgmma kernel is
taken as available) and its decode attention there (the Pallas kernel; Pallas kernels lowered as
kernels, not for the CPU's interpreter), compiled for the H100, and the while loop's body (one decode step) of
the optimized HLO is walked: every instruction that launches a kernel is counted, by kind.

What it is for: in a decode step each launch costs ~2 us with its gap (KERNEL_NOTES.md, "The 7B
decode step"), so launches are a cost a CPU machine can measure. What it cannot do: time anything, and
autotune. GEMM configurations (split-K, so an extra reduce fusion) are XLA's untuned defaults
and may differ on the device; fusion decisions do not depend on autotuning.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import importlib
import json
import os
import re
import time
from typing import Any

SPEC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_specs", "h100_sxm.txtpb")
# Instructions that launch nothing: buffer plumbing and constants.
NO_LAUNCH = frozenset(
    "parameter get-tuple-element tuple bitcast constant after-all partition-id replica-id "
    "opt-barrier add-dependency".split()
)
_COMPUTATION = re.compile(r"^(ENTRY )?%(\S+) .*\{$")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT )?%(\S+) = (.+?) ([a-z][a-z0-9\-]*)\((.*)$")


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel-launching instruction of a step: its kind (see `launch_kind`), name, result shape."""

    kind: str
    name: str
    shape: str


# ----------------------------------------------------------------------------- optimized HLO


def parse_hlo(text: str) -> tuple[dict[str, list[dict[str, str]]], str]:
    """Optimized HLO text -> ({computation: [instruction {name, shape, op, rest}]}, entry name)."""
    computations: dict[str, list[dict[str, str]]] = {}
    current, entry = None, None
    for line in text.splitlines():
        header = _COMPUTATION.match(line)
        if header:
            current = header.group(2)
            computations[current] = []
            entry = current if header.group(1) else entry
        elif line.startswith("}"):
            current = None
        elif current is not None and (ins := _INSTRUCTION.match(line)):
            name, shape, op, rest = ins.groups()
            computations[current].append(dict(name=name, shape=shape, op=op, rest=rest))
    if entry is None:
        raise ValueError("no ENTRY computation in the HLO text")
    return computations, entry


def _attribute(ins: dict[str, str], key: str) -> str | None:
    found = re.search(rf"{key}=%?([^,\s}}]+)", ins["rest"])
    return found.group(1) if found else None


def launch_kind(ins: dict[str, str]) -> str:
    """'wgmma' (Mosaic GPU kernel), 'triton' (Pallas Triton kernel), 'gemm' (XLA GEMM fusion or
    cuBLAS), 'fusion' (other XLA fusions), or the opcode (copy, while, ...)."""
    op = ins["op"]
    if op == "custom-call":
        target = re.search(r'custom_call_target="([^"]+)"', ins["rest"])
        target = target.group(1) if target else ""
        if "mosaic_gpu" in target:
            return "wgmma"
        if "triton" in target:
            return "triton"
        if "gemm" in target or "cublas" in target:
            return "gemm"
        return f"custom-call:{target}"
    if op == "fusion":
        if "gemm" in ins["name"] or "__triton_gemm" in ins["rest"] or "__cublas" in ins["rest"]:
            return "gemm"
        return "fusion"
    return op


def launches(computations: dict[str, list[dict[str, str]]], computation: str) -> list[Launch]:
    """The kernel-launching instructions of `computation`, in order, through `call`s."""
    out = []
    for ins in computations[computation]:
        if ins["op"] in NO_LAUNCH:
            continue
        if ins["op"] == "call":
            out += launches(computations, _attribute(ins, "to_apply"))
            continue
        out.append(Launch(launch_kind(ins), ins["name"], ins["shape"]))
    return out


def loop_body_launches(hlo_text: str) -> list[Launch]:
    """The launches of one iteration of the entry computation's (only) while loop."""
    computations, entry = parse_hlo(hlo_text)
    loops = [ins for ins in computations[entry] if ins["op"] == "while"]
    if len(loops) != 1:
        raise ValueError(f"expected one while loop in the entry computation; found {len(loops)}")
    return launches(computations, _attribute(loops[0], "body"))


# ----------------------------------------------------------------------------- the decode program


def h100_device(spec_path: str = SPEC):
    """A compile-only H100 device (needs jax's CUDA plugin installed, no GPU)."""
    from jax.experimental import topologies  # noqa: PLC0415

    with open(spec_path) as f:
        spec = f.read()
    try:
        topology = topologies.get_topology_desc(platform="cuda", topology="1x1x1", target_config=spec)
    except Exception as e:  # the plugin's absence surfaces as a RuntimeError or a KeyError by version
        raise RuntimeError(
            f"cannot make a compile-only CUDA device ({e}); install jax-cuda12-plugin and jax-cuda12-pjrt "
            "of this jax's version (no GPU needed)"
        ) from e
    return topology.devices[0]


@contextlib.contextmanager
def as_if_hopper():
    """While tracing, the programs are those of the H100 they are compiled for: `wgmma_nvfp4.available()`
    is true and the Pallas Triton kernels are lowered as kernels, not for the CPU's interpreter, for
    compute capability 9.0 (jax 0.10 assumes it without a GPU; jax >= 0.11 asks its `gpu_info` for
    the GPU, which fails without one)."""
    from pallas_kernels import wgmma_nvfp4  # noqa: PLC0415

    # the modules (the package exports functions of the same names)
    triton_modules = [importlib.import_module(f"pallas_kernels.{m}") for m in ("quant_matmul", "decode_attention")]
    available, resolves = wgmma_nvfp4.available, [m._resolve_interpret for m in triton_modules]
    wgmma_nvfp4.available = lambda: True
    for module in triton_modules:
        module._resolve_interpret = lambda interpret: False if interpret is None else bool(interpret)
    try:
        gpu_info = importlib.import_module("jax._src.pallas.triton.gpu_info")
    except ImportError:
        gpu_info = None
    if gpu_info is not None:
        get_gpu_info, h100 = gpu_info.get_gpu_info, gpu_info.get_gpu_info_from_version(gpu_info.GpuVersion.H100)
        gpu_info.get_gpu_info = lambda: h100
    try:
        yield
    finally:
        wgmma_nvfp4.available = available
        for module, resolve in zip(triton_modules, resolves):
            module._resolve_interpret = resolve
        if gpu_info is not None:
            gpu_info.get_gpu_info = get_gpu_info


def add_rollout_args(parser: argparse.ArgumentParser, *, size: str, rows: int, new_slots: int) -> None:
    """The rollout's shape flags that `rollout_setup` takes (and --formats, --out), with the
    tool's defaults for the size, the first row bucket and the new-token slots."""
    parser.add_argument("--size", default=size, help="Qwen2.5 size (benchmarks/common.py) or tiny")
    parser.add_argument("--formats", default="bf16,nvfp4")
    parser.add_argument("--rows", type=int, default=rows, help="sequences decoded at once (the first row bucket)")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-slots", type=int, default=new_slots, help="cache slots for new tokens")
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--out", default="", help="JSON path")


def rollout_setup(
    size: str, fmt: str, rows: int, *, prompt_len: int, new_slots: int, lora_rank: int, device, group_size: int = 8
) -> dict[str, Any]:
    """What `generate` would run for `rows` sequences on a Hopper GPU, in shapes only: the plan
    (`plan_rollout`, the wgmma kernel taken as available, no memory limit), the `programs.Static`,
    the prepared weights and the arguments of its admission program, as ShapeDtypeStructs placed
    on `device`; and `bucket_args(b)`, the cache and row state of a bucket of b rows."""
    import jax  # noqa: PLC0415
    import jax.numpy as jnp  # noqa: PLC0415

    from benchmarks import common
    from qerl_jax import lora  # noqa: PLC0415
    from qerl_jax.models.qwen2 import ForwardOptions  # noqa: PLC0415
    from qerl_jax.rollout import RolloutOptions, SamplingConfig, plan_rollout, programs, weights  # noqa: PLC0415

    config = common.model_config(size)
    backend = "xla" if fmt in common.DENSE else "pallas"
    sharding = jax.sharding.SingleDeviceSharding(device)
    on_device = lambda tree: jax.tree.map(  # noqa: E731
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding), tree
    )
    spec = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)  # noqa: E731
    with as_if_hopper():
        params = jax.eval_shape(lambda: common.random_params(config, quant=fmt))
        if lora_rank:
            cfg = lora.LoraConfig(rank=lora_rank, alpha=2 * lora_rank)
            params["lora"] = jax.eval_shape(lambda: lora.init_lora(jax.random.key(0), config, cfg))
        plan = plan_rollout(
            config, params, rows, prompt_len, new_slots, group_size=group_size, max_batch=rows,
            options=RolloutOptions(backend=backend),
        )
        dense, wgmma = plan.dense_names, plan.wgmma_names
        run_params = jax.eval_shape(
            lambda p: weights.split_layers(p, backend if dense else None, dense or None, wgmma), params
        )
    static = programs.Static(
        config=config,
        sampling=SamplingConfig(temperature=1.0),
        # generate's default decode attention on a GPU (`decode_attention_backend`): the Pallas kernel
        options=ForwardOptions(lora_scale=1.0, backend=backend, decode_attention="pallas"),
        new_slots=new_slots,
        cache_dtype="bfloat16",
    )

    def bucket_args(bucket: int):
        return on_device(jax.eval_shape(lambda: programs.new_rows(static, bucket, prompt_len, 0)))

    key = on_device(jax.eval_shape(lambda: jax.random.key(0)))
    k, bp = plan.admit_rows, plan.admit_prompts
    admit_inputs = (
        spec((bp, prompt_len), jnp.int32),  # prompt ids
        spec((bp, prompt_len), jnp.int32),  # prompt mask
        spec((k,), jnp.int32),  # src: each admitted sequence's prompt
        spec((k,), jnp.int32),  # dest: its row
        spec((k,), jnp.uint32),  # its sequence id
        spec((k,), jnp.int32),  # its token limit
        key,
        spec((config.vocab_size,), jnp.bool_),  # stop ids
        spec((), jnp.int32),  # pad id
    )
    return dict(
        config=config,
        plan=plan,
        static=static,
        run_params=on_device(run_params),
        bucket_args=bucket_args,
        admit_inputs=admit_inputs,
        key=key,
        stop=spec((config.vocab_size,), jnp.bool_),
        scalar=spec((), jnp.int32),
    )


def rollout_programs(setup: dict[str, Any], device) -> list[tuple[str, int, Any, tuple]]:
    """The programs a call of `setup` (`rollout_setup`) runs besides its weight preparation, as
    (name, rows, jitted function, shape-only arguments after the static one): the admission of
    the first bucket, every bucket's decode, each compaction into the next bucket."""
    import jax  # noqa: PLC0415

    from qerl_jax.rollout import programs  # noqa: PLC0415

    plan, run_params = setup["plan"], setup["run_params"]
    cache, state = setup["bucket_args"](plan.rows)
    jobs = [("admit", plan.rows, programs.admit, (run_params, cache, state, *setup["admit_inputs"]))]
    for bucket in plan.buckets:
        cache, state = setup["bucket_args"](bucket)
        step_args = (setup["key"], setup["stop"], setup["scalar"], setup["scalar"])
        jobs.append(("decode", bucket, programs.decode, (run_params, cache, state, *step_args)))
    sharding = jax.sharding.SingleDeviceSharding(device)
    for big, small in zip(plan.buckets, plan.buckets[1:]):
        cache, state = setup["bucket_args"](big)
        keep = jax.ShapeDtypeStruct((small,), "int32", sharding=sharding)
        valid = jax.ShapeDtypeStruct((small,), "bool", sharding=sharding)
        jobs.append(("compact", big, programs.compact, (cache, state, keep, valid)))
    return jobs


def decode_step_hlo(
    size: str, fmt: str, rows: int, *, prompt_len: int, new_slots: int, lora_rank: int, device
) -> tuple[str, dict[str, Any]]:
    """Optimized HLO text of `generate`'s decode program for a bucket of `rows` rows (all of them
    in it: no smaller bucket below), compiled for `device`, and what went into it (the weight
    copies, the compile time)."""
    from qerl_jax.rollout import programs, rows_bucket  # noqa: PLC0415

    bucket = rows_bucket(rows)
    setup = rollout_setup(
        size, fmt, bucket, prompt_len=prompt_len, new_slots=new_slots, lora_rank=lora_rank, device=device
    )
    cache, state = setup["bucket_args"](bucket)
    t0 = time.perf_counter()
    with as_if_hopper():
        args = (setup["run_params"], cache, state, setup["key"], setup["stop"], setup["scalar"], setup["scalar"])
        compiled = programs.decode.trace(setup["static"], *args).lower().compile()
    plan = setup["plan"]
    info = dict(rows_bucket=bucket, dense_copies=list(plan.dense_names), wgmma_copies=list(plan.wgmma_names))
    info["compile_s"] = round(time.perf_counter() - t0, 1)
    return compiled.as_text(), info


def census(steps: list[Launch], num_layers: int) -> dict[str, Any]:
    """Launch counts of one decode step: total, per layer (the step's total over the layers), by kind."""
    kinds = collections.Counter(s.kind for s in steps)
    return dict(launches=len(steps), per_layer=round(len(steps) / num_layers, 2), by_kind=dict(sorted(kinds.items())))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="7B", help="Qwen2.5 size (benchmarks/common.py) or tiny")
    parser.add_argument("--formats", default="bf16,nvfp4")
    parser.add_argument("--batches", default="1,16,64", help="decode rows")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--new-slots", type=int, default=512, help="cache slots for new tokens")
    parser.add_argument("--lora-rank", type=int, default=0, help="with a LoRA adapter of this rank on every projection")
    parser.add_argument("--list", action="store_true", help="print every launch of the step")
    parser.add_argument("--out", default="", help="JSON path")
    args = parser.parse_args(argv)

    import jax  # noqa: PLC0415

    from benchmarks import common

    device = h100_device()
    num_layers = common.model_config(args.size).num_hidden_layers
    rows_out = []
    print(f"jax {jax.__version__}, compiled for {device.device_kind}")
    print(f"{'format':>7} {'rows':>5} {'launches':>9} {'/layer':>7}  by kind")
    for fmt in args.formats.split(","):
        for rows in map(int, args.batches.split(",")):
            hlo, info = decode_step_hlo(
                args.size,
                fmt,
                rows,
                prompt_len=args.prompt_len,
                new_slots=args.new_slots,
                lora_rank=args.lora_rank,
                device=device,
            )
            steps = loop_body_launches(hlo)
            row = dict(
                size=args.size, format=fmt, rows=rows, lora_rank=args.lora_rank, **info, **census(steps, num_layers)
            )
            rows_out.append(row)
            kinds = " ".join(f"{k}={v}" for k, v in row["by_kind"].items())
            print(f"{fmt:>7} {rows:>5} {row['launches']:>9} {row['per_layer']:>7}  {kinds}")
            if args.list:
                for s in steps:
                    print(f"    {s.kind:>8} {s.name:<45} {s.shape[:70]}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(dict(jax=jax.__version__, spec=os.path.basename(SPEC), rows=rows_out), f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
