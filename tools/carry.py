"""Carry an experiment directory's resumable state to another GPU machine, in parts that fit a call.

For a GPU machine reached only by copying files (tools/README.md): each call sends the working tree
and brings back the files its command writes to $OUT, with a limit on how many files come back, on
each one's size and on their total. The state travels as one tar split into parts, a few per call:

    python -m tools.carry pack --src <out> --dest $OUT --batch k    # k = 0 .. B-1, one call each
    python -m tools.carry unpack --parts <dir> --dest <out>         # on the next machine

`--files`, `--part-mib` and `--batch-mib` are the per-call limits (defaults: 8 files, parts of
15 MiB, 64 MiB a call). The tar (built once, cached in `<out>/.carry/` with its manifest, rebuilt
if `<out>` changed) holds everything under `<out>` a later call needs to continue every run:
- each `checkpoints/` directory with only its latest finished step (orbax writes `<step>` when a
  step is complete; `<step>.orbax-checkpoint-tmp-*` are unfinished, `<step>.unreadable` damaged),
  and none of a run evaluated at that step (`eval/step_<step>/summary.json`: finished, nothing to continue);
- everything else (scalars, logs, evaluations, experiment.json, commands.txt, calls.jsonl, base/),
  the compilation cache included (about 70 MB for three arms of the 1.5B: it saves the next machine
  of the same kind minutes of compiling), except the launcher's other `LIGHT_SKIP` directories: the
  tiny test model and the exported adapters (a run resumed at its last step exports its adapter again).
Batch k holds parts k*P .. k*P+P-1 (P: as many as fit `--files` - 1 files and `--batch-mib`) and
the manifest (part names, sizes and sha256, the tar's sha256). `unpack` extracts nothing unless
every part and the whole tar match the manifest.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import shutil
import sys
import tarfile

from experiments.launcher import LIGHT_SKIP

MIB = 1 << 20
CACHE = ".carry"
TAR = "carry.tar"
MANIFEST = "carry.manifest.json"
PART = "carry.part{:04d}"
NAME_OK = re.compile(r"^[A-Za-z0-9._-]+$")  # plain names: every copy step keeps them as they are
SKIP_DIRS = LIGHT_SKIP - {"checkpoints", "jax_cache"}
MANIFEST_RESERVE = MIB  # room kept in a batch for the manifest


class CarryError(Exception):
    """Bad input or a missing or damaged part: one line for the user, exit status 2."""


# ----------------------------------------------------------------------------- pack


def latest_step(checkpoint_dir: str) -> int | None:
    """The newest finished step of an orbax checkpoint directory (`qerl_jax.checkpoint.saved_steps`'s rule:
    only directories named by a bare step number are finished; that module needs orbax, this one not)."""
    steps = [
        int(n) for n in os.listdir(checkpoint_dir) if n.isdigit() and os.path.isdir(os.path.join(checkpoint_dir, n))
    ]
    return max(steps) if steps else None


def evaluated(run_dir: str, step: int) -> bool:
    """Whether the launcher evaluated the run at `step` (its final evaluation's summary exists):
    the run is finished and its checkpoint is not needed to continue."""
    return os.path.isfile(os.path.join(run_dir, "eval", f"step_{step}", "summary.json"))


def select(src: str) -> list[str]:
    """Paths (relative to `src`, sorted, directories before their contents) that the tar holds."""
    chosen = []
    for root, dirs, files in os.walk(src):
        rel_root = os.path.relpath(root, src)
        if rel_root == ".":
            dirs[:] = [d for d in dirs if d != CACHE]
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not os.path.islink(os.path.join(root, d)))
        if os.path.basename(root) == "checkpoints":
            step = latest_step(root)
            dirs[:] = [] if step is None or evaluated(os.path.dirname(root), step) else [str(step)]
        for name in dirs:
            chosen.append(os.path.normpath(os.path.join(rel_root, name)))
        for name in sorted(files):
            if os.path.isfile(os.path.join(root, name)) and not os.path.islink(os.path.join(root, name)):
                chosen.append(os.path.normpath(os.path.join(rel_root, name)))
    return sorted(chosen)


def fingerprint(src: str, paths: list[str]) -> str:
    """sha256 of the selection's names, sizes and modification times (a changed source rebuilds the tar)."""
    h = hashlib.sha256()
    for rel in paths:
        st = os.stat(os.path.join(src, rel))
        h.update(f"{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def parts_per_batch(part_bytes: int, files: int, batch_mib: float) -> int:
    return min(files - 1, int((batch_mib * MIB - MANIFEST_RESERVE) // part_bytes))


def _sha256_range(path: str, start: int, length: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        while length > 0:
            block = f.read(min(length, 16 * MIB))
            if not block:
                break
            h.update(block)
            length -= len(block)
    return h.hexdigest()


def build(src: str, part_bytes: int, per_batch: int) -> dict:
    """The cached tar and manifest of `src` (built unless the cache matches the source and part size)."""
    cache = os.path.join(src, CACHE)
    paths = select(src)
    fp = fingerprint(src, paths)
    manifest_path = os.path.join(cache, MANIFEST)
    if os.path.isfile(manifest_path):
        manifest = json.load(open(manifest_path))
        wanted = {"fingerprint": fp, "part_bytes": part_bytes, "parts_per_batch": per_batch}
        if {k: manifest.get(k) for k in wanted} == wanted and os.path.isfile(os.path.join(cache, TAR)):
            return manifest
        print(f"{src} or the part size changed since the cached tar: rebuilding it (fetch every batch again)")
    os.makedirs(cache, exist_ok=True)
    tar_path = os.path.join(cache, TAR)
    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
        for rel in paths:
            tar.add(os.path.join(src, rel), arcname=rel, recursive=False)
    size = os.path.getsize(tar_path)
    parts = [
        {
            "name": PART.format(i),
            "bytes": min(part_bytes, size - start),
            "sha256": _sha256_range(tar_path, start, part_bytes),
        }
        for i, start in enumerate(range(0, max(size, 1), part_bytes))
    ]
    manifest = {
        "tar_bytes": size,
        "tar_sha256": _sha256_range(tar_path, 0, size),
        "part_bytes": part_bytes,
        "parts_per_batch": per_batch,
        "batches": -(-len(parts) // per_batch),
        "parts": parts,
        "checkpoints": [
            p for p in paths if os.path.basename(os.path.dirname(p)) == "checkpoints" and os.path.basename(p).isdigit()
        ],
        "fingerprint": fp,
    }
    with open(manifest_path + ".tmp", "w") as f:
        json.dump(manifest, f, indent=1)
    os.replace(manifest_path + ".tmp", manifest_path)
    return manifest


def pack(src: str, dest: str, batch: int, part_mib: float, files: int, batch_mib: float) -> None:
    """Copies batch `batch`'s parts and the manifest into `dest`; prints the number of batches."""
    part_bytes = round(part_mib * MIB)
    if not os.path.isdir(src):
        raise CarryError(f"--src {src}: no such directory")
    if files < 2:
        raise CarryError(f"--files {files}: expected at least 2 (a part and the manifest)")
    if part_bytes <= 0:
        raise CarryError(f"--part-mib {part_mib}: expected more than 0")
    per_batch = parts_per_batch(part_bytes, files, batch_mib)
    if per_batch < 1:
        raise CarryError(f"--batch-mib {batch_mib}: no room for one part of {part_mib} MiB and the manifest")
    if batch < 0:
        raise CarryError(f"--batch {batch}: expected >= 0")
    manifest = build(src, part_bytes, per_batch)
    if batch >= manifest["batches"]:
        raise CarryError(f"--batch {batch}: there are {manifest['batches']} batches (0..{manifest['batches'] - 1})")
    os.makedirs(dest, exist_ok=True)
    tar_path = os.path.join(src, CACHE, TAR)
    chosen = manifest["parts"][batch * per_batch : (batch + 1) * per_batch]
    with open(tar_path, "rb") as f:
        for part in chosen:
            f.seek(int(part["name"].rsplit("part", 1)[1]) * manifest["part_bytes"])
            with open(os.path.join(dest, part["name"]), "wb") as out:
                out.write(f.read(part["bytes"]))
    shutil.copyfile(os.path.join(src, CACHE, MANIFEST), os.path.join(dest, MANIFEST))
    print(
        f"batch {batch}: {', '.join(p['name'] for p in chosen)} and {MANIFEST} -> {dest}; "
        f"{manifest['batches']} batches in all ({len(manifest['parts'])} parts, {manifest['tar_bytes'] / MIB:.1f} MiB; "
        f"checkpoints: {' '.join(manifest['checkpoints']) or 'none'})"
    )


# ----------------------------------------------------------------------------- unpack


def _check_member(member: tarfile.TarInfo) -> None:
    """Only relative regular files and directories inside the destination."""
    name = member.name
    if os.path.isabs(name) or ".." in name.split("/") or not (member.isfile() or member.isdir()):
        raise CarryError(f"the tar holds {name!r}, not a file or directory inside the destination: refusing to extract")


def unpack(parts_dir: str, dest: str) -> None:
    """Checks every part and the joined tar against the manifest, then extracts into `dest` (new or empty)."""
    manifest_path = os.path.join(parts_dir, MANIFEST)
    if not os.path.isfile(manifest_path):
        raise CarryError(f"--parts {parts_dir}: no {MANIFEST} there")
    try:
        manifest = json.load(open(manifest_path))
        parts = [(p["name"], int(p["bytes"]), p["sha256"]) for p in manifest["parts"]]
        tar_sha = manifest["tar_sha256"]
    except (ValueError, KeyError, TypeError) as e:
        raise CarryError(f"{manifest_path}: not a carry manifest ({type(e).__name__}: {e})") from None
    if os.path.isdir(dest) and os.listdir(dest):
        raise CarryError(f"--dest {dest}: not empty (unpack into a new directory)")
    for name, _, _ in parts:
        if not NAME_OK.match(name) or not os.path.isfile(os.path.join(parts_dir, name)):
            raise CarryError(f"part {name} is missing from {parts_dir} (of {len(parts)} parts)")
    joined = os.path.join(parts_dir, TAR)
    whole = hashlib.sha256()
    try:
        with open(joined, "wb") as out:
            for name, size, sha in parts:
                data = open(os.path.join(parts_dir, name), "rb").read()
                if len(data) != size or hashlib.sha256(data).hexdigest() != sha:
                    raise CarryError(
                        f"part {name} in {parts_dir} is damaged or from another pack ({len(data)} of {size} bytes or its sha256 differs)"
                    )
                whole.update(data)
                out.write(data)
        if whole.hexdigest() != tar_sha:
            raise CarryError(f"the parts in {parts_dir} join into a tar whose sha256 differs from the manifest's")
        with tarfile.open(joined, "r:") as tar:
            members = tar.getmembers()
            for member in members:
                _check_member(member)
            os.makedirs(dest, exist_ok=True)
            if hasattr(tarfile, "data_filter"):
                tar.extractall(dest, members=members, filter="data")
            else:
                tar.extractall(dest, members=members)
    finally:
        if os.path.exists(joined):
            os.remove(joined)
    steps = manifest.get("checkpoints", [])
    print(f"unpacked {len(parts)} parts into {dest}; checkpoints: {' '.join(steps) or 'none'}")


# ----------------------------------------------------------------------------- command line


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    pk = sub.add_parser("pack", help="write batch --batch of the parts (and the manifest) into --dest")
    pk.add_argument("--src", required=True, help="the experiment directory (the launcher's --out)")
    pk.add_argument("--dest", required=True, help="where the batch's files go ($OUT)")
    pk.add_argument("--batch", type=int, required=True)
    pk.add_argument("--part-mib", type=float, default=15.0, help="part size (at most a call's per-file limit)")
    pk.add_argument("--files", type=int, default=8, help="files a call brings back (parts + the manifest)")
    pk.add_argument("--batch-mib", type=float, default=64.0, help="MiB a call brings back in all")
    up = sub.add_parser("unpack", help="check the parts against the manifest and extract them")
    up.add_argument("--parts", required=True, help="folder with the parts and the manifest")
    up.add_argument("--dest", required=True, help="the experiment directory to create (the launcher's --out)")
    args = p.parse_args(argv)
    try:
        if args.command == "pack":
            pack(os.path.abspath(args.src), args.dest, args.batch, args.part_mib, args.files, args.batch_mib)
        else:
            unpack(args.parts, os.path.abspath(args.dest))
    except CarryError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
