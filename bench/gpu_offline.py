"""Move the wheels `make gpu-check` needs to a GPU host without network, and install them there.

Standard library only, so it runs on the bare host:

    python3 bench/gpu_offline.py split FILE --max-mb 60 --out DIR   # FILE.part000..., FILE.parts.json
    python3 bench/gpu_offline.py split FILE --max-mb 60 --xz        # the parts cut from FILE xz-compressed
    python3 bench/gpu_offline.py join DIR/FILE.parts.json --out DIR  # checks every sha256
    python3 bench/gpu_offline.py install DIR --target SITE           # joins, then pip --no-index
    python3 bench/gpu_offline.py bundle .whl models --max-mb 61 --out DIR   # DIR/00, DIR/01, ...

A file is split into parts of at most `--max-mb` MiB; with `--xz` the parts are cut from the
file compressed by xz (`lzma`, preset 6), and `join` decompresses them. The `.parts.json`
manifest records the whole file's size and sha256, each part's, and the compression, and
`join` refuses a missing, short or altered part. `install` joins every split wheel of the folder, then installs into `--target` each wheel
whose distribution the host lacks (the host's own packages, e.g. torch's numpy, stay in use;
`--all` installs every wheel), and prints the PYTHONPATH line that puts the target first.
`bundle` sorts the files under the paths given into numbered folders of at most `--max-mb` MiB
each (largest first, each into the first folder it fits), every file at its own relative path:
one folder a transfer, and copying every folder's contents into the checkout on the host puts
each file back where it was.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

MANIFEST_SUFFIX = ".parts.json"
CHUNK = 1 << 20


class PartError(ValueError):
    """A part is missing or its bytes differ from the manifest's."""


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as file:
        while block := file.read(CHUNK):
            digest.update(block)
    return digest.hexdigest()


def _lzma() -> Any:
    """Python's `lzma` module, or PartError where this Python was built without it."""
    try:
        import lzma
    except ImportError as error:
        raise PartError(f"this Python has no lzma module ({error}): split the file without --xz") from None
    return lzma


def _compressed(path: Path) -> Iterator[bytes]:
    """The bytes of `path` compressed by xz, in pieces."""
    compressor = _lzma().LZMACompressor(preset=6)
    with path.open("rb") as source:
        while block := source.read(CHUNK):
            yield compressor.compress(block)
    yield compressor.flush()


def _plain(path: Path) -> Iterator[bytes]:
    with path.open("rb") as source:
        while block := source.read(CHUNK):
            yield block


def split(path: Path, max_mb: float, out: Path, xz: bool = False) -> Path:
    """Cut `path` (with `xz`, its xz-compressed bytes) into parts of at most `max_mb` MiB in
    `out`; returns the manifest's path."""
    limit = int(max_mb * (1 << 20))
    if limit < 1:
        raise ValueError("max_mb must allow at least one byte per part")
    out.mkdir(parents=True, exist_ok=True)
    parts: list[dict[str, object]] = []
    pending = bytearray()

    def write(block: bytes) -> None:
        part = out / f"{path.name}.part{len(parts):03d}"
        part.write_bytes(block)
        parts.append({"file": part.name, "size": len(block), "sha256": hashlib.sha256(block).hexdigest()})

    for piece in (_compressed if xz else _plain)(path):
        pending += piece
        while len(pending) >= limit:
            write(bytes(pending[:limit]))
            del pending[:limit]
    if pending:
        write(bytes(pending))
    manifest = out / f"{path.name}{MANIFEST_SUFFIX}"
    manifest.write_text(json.dumps({"name": path.name, "size": path.stat().st_size, "sha256": sha256(path),
                                    "compression": "xz" if xz else None, "parts": parts}, indent=2) + "\n")
    return manifest


def join(manifest_path: Path, out: Path) -> Path:
    """Reassemble the file a manifest describes into `out` (decompressing parts cut with `xz`);
    raises PartError unless every part and the whole file match their sha256."""
    manifest = json.loads(manifest_path.read_text())
    folder = manifest_path.parent
    out.mkdir(parents=True, exist_ok=True)
    target = out / manifest["name"]
    digest = hashlib.sha256()
    partial = target.with_name(target.name + ".joining")
    decompressor = _lzma().LZMADecompressor() if manifest.get("compression") == "xz" else None
    with partial.open("wb") as whole:
        for part in manifest["parts"]:
            path = folder / part["file"]
            if not path.is_file():
                partial.unlink()
                raise PartError(f"{part['file']}: missing")
            data = path.read_bytes()
            if len(data) != part["size"] or hashlib.sha256(data).hexdigest() != part["sha256"]:
                partial.unlink()
                raise PartError(f"{part['file']}: its bytes differ from {manifest_path.name}")
            if decompressor is not None:
                data = decompressor.decompress(data)
            whole.write(data)
            digest.update(data)
    if digest.hexdigest() != manifest["sha256"] or (decompressor is not None and not decompressor.eof):
        partial.unlink()
        raise PartError(f"{manifest['name']}: the joined file's sha256 differs from {manifest_path.name}")
    partial.replace(target)
    return target


def distribution(wheel: Path) -> str:
    """The distribution name of a wheel file (its name before the first '-')."""
    return wheel.name.split("-", 1)[0]


def installed(name: str) -> bool:
    try:
        metadata.version(re.sub(r"[-_.]+", "-", name))
    except metadata.PackageNotFoundError:
        return False
    return True


def install(folder: Path, target: Path, every: bool = False) -> list[Path]:
    """Join the split wheels of `folder`, then pip-install into `target`, without an index or
    dependencies, each wheel whose distribution is not installed (all with `every`); returns them."""
    for manifest in sorted(folder.glob(f"*{MANIFEST_SUFFIX}")):
        if not (folder / json.loads(manifest.read_text())["name"]).exists():
            join(manifest, folder)
    wheels = [w for w in sorted(folder.glob("*.whl")) if every or not installed(distribution(w))]
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                        "--no-compile", "--upgrade", "--target", str(target), *map(str, wheels)], check=True)
    return wheels


def bundle(paths: list[Path], max_mb: float, out: Path) -> list[Path]:
    """Copy the files under `paths` (relative to the working directory) into
    folders `out`/00, `out`/01, ... of at most `max_mb` MiB each, largest first, each file into the
    first folder with room, at its own relative path; returns the folders. Raises PartError for a
    file larger than `max_mb` (split it first) or a path outside the working directory."""
    limit = int(max_mb * (1 << 20))
    files = sorted((f for p in paths for f in ([p] if p.is_file() else sorted(p.rglob("*"))) if f.is_file()),
                   key=lambda f: -f.stat().st_size)
    sizes: list[int] = []
    places: list[tuple[Path, int]] = []
    for file in files:
        if file.is_absolute() or ".." in file.parts:
            raise PartError(f"{file}: give paths relative to the checkout")
        size = file.stat().st_size
        if size > limit:
            raise PartError(f"{file}: {size} bytes, over {max_mb} MiB (split it first)")
        folder = next((i for i, used in enumerate(sizes) if used + size <= limit), len(sizes))
        if folder == len(sizes):
            sizes.append(0)
        sizes[folder] += size
        places.append((file, folder))
    folders = [out / f"{i:02d}" for i in range(len(sizes))]
    for file, folder in places:
        target = folders[folder] / file
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(file, target)  # a copy: onnx refuses external weights with several hard links
    return folders


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gpu_offline.py", description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("split", help="cut a file into checksummed parts")
    p.add_argument("file", type=Path)
    p.add_argument("--max-mb", type=float, default=60.0)
    p.add_argument("--out", type=Path, default=None, help="folder of the parts (default: the file's)")
    p.add_argument("--remove", action="store_true", help="delete the file once split")
    p.add_argument("--xz", action="store_true", help="cut the parts from the file compressed by xz")
    p = commands.add_parser("join", help="reassemble and check a split file")
    p.add_argument("manifest", type=Path)
    p.add_argument("--out", type=Path, default=None, help="folder of the file (default: the manifest's)")
    p = commands.add_parser("install", help="join split wheels, install the missing ones into --target")
    p.add_argument("folder", type=Path)
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--all", action="store_true", help="install every wheel, also those the host has")
    p = commands.add_parser("bundle", help="sort files into folders of at most --max-mb MiB, one a transfer")
    p.add_argument("paths", type=Path, nargs="+")
    p.add_argument("--max-mb", type=float, default=60.0)
    p.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        if args.command == "split":
            manifest = split(args.file, args.max_mb, args.out or args.file.parent, xz=args.xz)
            if args.remove:
                args.file.unlink()
            print(manifest)
        elif args.command == "bundle":
            for folder in bundle(args.paths, args.max_mb, args.out):
                print(folder, sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()))
        elif args.command == "join":
            print(join(args.manifest, args.out or args.manifest.parent))
        else:
            for wheel in install(args.folder, args.target, args.all):
                print(f"installed {wheel.name}")
            print(f"export PYTHONPATH={args.target.resolve()}:$PYTHONPATH")
    except PartError as error:
        print(f"gpu_offline: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
