"""Moving wheels to an offline GPU host: checksummed parts, and installing the missing ones."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from bench import gpu_offline


def _file(path: Path, size: int) -> Path:
    path.write_bytes(os.urandom(size))
    return path


def test_split_and_join_give_back_the_same_bytes(tmp_path: Path) -> None:
    original = _file(tmp_path / "big.whl", 5 * (1 << 20) + 123)
    manifest = gpu_offline.split(original, 2, tmp_path / "parts")
    recorded = json.loads(manifest.read_text())
    assert [p["size"] for p in recorded["parts"]] == [2 << 20, 2 << 20, (1 << 20) + 123]
    assert recorded["sha256"] == hashlib.sha256(original.read_bytes()).hexdigest()
    joined = gpu_offline.join(manifest, tmp_path / "out")
    assert joined.read_bytes() == original.read_bytes()


def test_xz_parts_are_cut_from_the_compressed_file_and_joined_back(tmp_path: Path) -> None:
    """With `xz` the parts hold the file's xz-compressed bytes (fewer of them for a compressible
    file); `join` gives back the file itself, and an altered part is refused as without it."""
    original = tmp_path / "big.whl"
    original.write_bytes(os.urandom(1 << 20) + bytes(4 << 20))  # 1 MiB of noise, 4 MiB of zeros
    manifest = gpu_offline.split(original, 0.5, tmp_path / "parts", xz=True)
    recorded = json.loads(manifest.read_text())
    assert recorded["compression"] == "xz" and recorded["size"] == 5 << 20
    assert 2 <= len(recorded["parts"]) <= 3  # about 1 MiB compressed, against 10 parts uncompressed
    assert all(p["size"] == 1 << 19 for p in recorded["parts"][:-1])
    joined = gpu_offline.join(manifest, tmp_path / "out")
    assert joined.read_bytes() == original.read_bytes()
    assert json.loads(gpu_offline.split(original, 0.5, tmp_path / "plain").read_text())["compression"] is None
    first = tmp_path / "parts" / recorded["parts"][0]["file"]
    data = bytearray(first.read_bytes())
    data[-1] ^= 1
    first.write_bytes(bytes(data))
    joined.unlink()
    with pytest.raises(gpu_offline.PartError, match="big.whl.part000: its bytes differ"):
        gpu_offline.join(manifest, tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []  # nothing half-joined left behind


def test_a_missing_or_altered_part_is_refused(tmp_path: Path) -> None:
    manifest = gpu_offline.split(_file(tmp_path / "x.whl", 3000), 0.001, tmp_path / "parts")
    parts = sorted((tmp_path / "parts").glob("x.whl.part*"))
    data = bytearray(parts[1].read_bytes())
    data[0] ^= 1
    parts[1].write_bytes(bytes(data))
    with pytest.raises(gpu_offline.PartError, match="x.whl.part001: its bytes differ"):
        gpu_offline.join(manifest, tmp_path / "out")
    data[0] ^= 1  # the part restored, the next one gone
    parts[1].write_bytes(bytes(data))
    parts[2].unlink()
    with pytest.raises(gpu_offline.PartError, match="x.whl.part002: missing"):
        gpu_offline.join(manifest, tmp_path / "out")
    assert not (tmp_path / "out" / "x.whl").exists()


def _wheel(folder: Path, name: str) -> Path:
    """A minimal pure-Python wheel of package `name` (module `name` with VALUE = 42)."""
    dist = f"{name}-1.0.dist-info"
    files = {f"{name}/__init__.py": b"VALUE = 42\n",
             f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n".encode(),
             f"{dist}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b'=').decode()},"
                     f"{len(data)}\n" for path, data in files.items()) + f"{dist}/RECORD,,\n"
    path = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        for file, data in {**files, f"{dist}/RECORD": record.encode()}.items():
            wheel.writestr(file, data)
    return path


def test_install_joins_split_wheels_and_installs_what_the_host_lacks(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    split_one = _wheel(wheels, "offline_probe_a")
    gpu_offline.split(split_one, 0.0005, wheels)
    split_one.unlink()
    _wheel(wheels, "offline_probe_b")
    _wheel(wheels, "pytest")  # the host has it: left to the host's own
    target = tmp_path / "site"
    done = gpu_offline.install(wheels, target)
    assert sorted(w.name for w in done) == ["offline_probe_a-1.0-py3-none-any.whl", "offline_probe_b-1.0-py3-none-any.whl"]
    probe = "import offline_probe_a, offline_probe_b; print(offline_probe_a.VALUE + offline_probe_b.VALUE)"
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "PYTHONPATH": str(target)},
                         capture_output=True, text=True, check=True).stdout
    assert out.strip() == "84"
    assert not (target / "pytest").exists()


def test_bundle_sorts_files_into_folders_that_give_them_back(tmp_path: Path, monkeypatch) -> None:
    """Each folder holds at most --max-mb MiB; copying every folder's contents into one place
    puts each file back at its relative path, the same bytes; a file over the limit is refused."""
    monkeypatch.chdir(tmp_path)
    for name, size in (("wheels/a.part000", 3 << 20), ("wheels/b.whl", 1 << 20), ("models/m/weights.bin", 2 << 20),
                       ("models/m/config.json", 100)):
        Path(name).parent.mkdir(parents=True, exist_ok=True)
        _file(Path(name), size)
    folders = gpu_offline.bundle([Path("wheels"), Path("models")], 3.5, Path("out"))
    sizes = [sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) for folder in folders]
    assert len(folders) == 2 and max(sizes) <= 3.5 * (1 << 20) and sum(sizes) == (6 << 20) + 100
    host = tmp_path / "host"
    for folder in folders:
        for file in folder.rglob("*"):
            if file.is_file():
                (host / file.relative_to(folder)).parent.mkdir(parents=True, exist_ok=True)
                (host / file.relative_to(folder)).write_bytes(file.read_bytes())
    for name in ("wheels/a.part000", "wheels/b.whl", "models/m/weights.bin", "models/m/config.json"):
        assert (host / name).read_bytes() == Path(name).read_bytes()
    with pytest.raises(gpu_offline.PartError, match="over 2 MiB"):
        gpu_offline.bundle([Path("wheels")], 2, Path("again"))
    assert gpu_offline.main(["bundle", "models", "--max-mb", "4", "--out", "cli"]) == 0
    assert (tmp_path / "cli" / "00" / "models" / "m" / "weights.bin").exists()
