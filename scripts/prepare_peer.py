"""Carry vLLM 0.26.0 to the offline GPU machine: download, check, slim, split; and there, unpack.

Here (a network):

    python scripts/prepare_peer.py [--with cutedsl] [--part-mib 48]

downloads the wheels of benchmarks/peers/vllm-0.26.0.lock into .peer/wheels (pip, hash-checked,
then checked again against the lock), rewrites the vllm wheel without what Hopper never loads
(SLIM_VLLM), packs every wheel into one tar, splits it into .peer/parts/vllm-peer.tar.NN of at most
--part-mib MiB (``cat`` puts them back together) beside a MANIFEST of sha256 sums, and prints the
device calls that carry the parts one by one and install them on the last.

There (no network; scripts/install_peer.sh runs these):

    python3 scripts/prepare_peer.py unpack --parts /tmp/peer-parts --dest /tmp/peer-wheels
    python3 scripts/prepare_peer.py check-image

``unpack`` checks every part and wheel against the MANIFEST; ``check-image`` checks the packages the
lock leaves to the image (``#image:`` lines) against the versions installed there. Standard library
and ``packaging`` only: the image has both.
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOCK = REPO / "benchmarks" / "peers" / "vllm-0.26.0.lock"
PEER_DIR = REPO / ".peer"
TAR_NAME = "vllm-peer.tar"
MANIFEST = "MANIFEST"
MiB = 1 << 20
# What pip may pick for the GPU image's CPython 3.12 on x86_64 (its glibc takes manylinux_2_35).
PLATFORMS = [
    "manylinux_2_35_x86_64", "manylinux_2_34_x86_64", "manylinux_2_31_x86_64", "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
    "manylinux2014_x86_64", "manylinux_2_12_x86_64", "manylinux2010_x86_64", "manylinux_2_5_x86_64",
    "manylinux1_x86_64",
]  # fmt: skip
# Members of the vllm wheel that W1-W5 on a Hopper GPU never load, with why:
SLIM_VLLM = {
    # FlashAttention 2 (130 MB compressed): Hopper runs FA3 (vllm/v1/attention/backends/fa_utils.py
    # picks 3 on SM 9.x); FA2 only for ALiBi. Its import is guarded (FA2_AVAILABLE = False).
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    # The Rust frontend binary, used only with VLLM_USE_RUST_FRONTEND=1.
    "vllm/vllm-rs",
    # DeepGEMM's extension built for the other Pythons (the image runs 3.12).
    "vllm/third_party/deep_gemm/_C.cpython-310-*.so",
    "vllm/third_party/deep_gemm/_C.cpython-311-*.so",
    "vllm/third_party/deep_gemm/_C.cpython-313-*.so",
    "vllm/third_party/deep_gemm/_C.cpython-314-*.so",
    # Blackwell (SM100) sparse attention for MiniMax-M3, imported only inside its functions.
    "vllm/third_party/fmha_sm100/*",
}


def normalize(name: str) -> str:
    """PEP 503's normalized project name."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclasses.dataclass(frozen=True)
class LockedWheel:
    name: str
    version: str
    sha256: str

    def requirement(self) -> str:
        return f"{self.name}=={self.version} --hash=sha256:{self.sha256}"


@dataclasses.dataclass(frozen=True)
class ImageRequirement:
    name: str
    specifier: str  # "" for any version
    optional: bool  # a mismatch only warns
    why: str = ""


@dataclasses.dataclass
class Lock:
    wheels: list[LockedWheel]
    image: list[ImageRequirement]
    optional: dict[str, list[LockedWheel]]
    left_out: dict[str, str]  # name==version -> why


_WHEEL_LINE = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+) --hash=sha256:([0-9a-f]{64})$")


def _locked_wheel(text: str, where: str) -> LockedWheel:
    match = _WHEEL_LINE.match(text.strip())
    if not match:
        raise ValueError(f"{where}: expected 'NAME==VERSION --hash=sha256:<64 hex>', got {text.strip()!r}")
    return LockedWheel(*match.groups())


def parse_lock(text: str) -> Lock:
    """The lock's groups (see the file's header). Raises ValueError naming the line at fault."""
    lock = Lock([], [], {}, {})
    for number, raw in enumerate(text.splitlines(), 1):
        line, where = raw.strip(), f"lock line {number}"
        if not line:
            continue
        if not line.startswith("#"):
            lock.wheels.append(_locked_wheel(line, where))
        elif line.startswith(("#image:", "#image-optional:")):
            tag, _, rest = line.partition(":")
            name, _, spec_why = rest.strip().partition(" ")
            spec, _, why = spec_why.strip().partition("  ")
            lock.image.append(ImageRequirement(name, spec.strip(), tag == "#image-optional", why.strip()))
        elif line.startswith("#optional["):
            group, _, rest = line[len("#optional[") :].partition("]:")
            lock.optional.setdefault(group, []).append(_locked_wheel(rest, where))
        elif line.startswith("#left-out:"):
            pin, _, why = line[len("#left-out:") :].strip().partition("  ")
            lock.left_out[pin] = why.strip()
    names = [normalize(w.name) for w in lock.wheels]
    duplicates = sorted({n for n in names if names.count(n) > 1})
    if duplicates:
        raise ValueError(f"the lock carries these more than once: {', '.join(duplicates)}")
    both = sorted(set(names) & {normalize(r.name) for r in lock.image})
    if both:
        raise ValueError(f"the lock both carries and leaves to the image: {', '.join(both)}")
    return lock


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(MiB), b""):
            digest.update(block)
    return digest.hexdigest()


# --- here: download, check, slim, split ----------------------------------------------------------------


def download(wheels: list[LockedWheel], dest: Path) -> None:
    """pip download of exactly these wheels (hash-checking mode) for the GPU image's Python."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write("\n".join(w.requirement() for w in wheels) + "\n")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--require-hashes"]
    cmd += ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "-d", str(dest)]
    cmd += [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    try:
        subprocess.run([*cmd, "-r", f.name], check=True)
    finally:
        os.unlink(f.name)


def wheel_files(wheels: list[LockedWheel], directory: Path) -> dict[str, Path]:
    """Each locked wheel's file in ``directory``, its sha256 checked. Raises naming what is off."""
    by_name: dict[tuple[str, str], Path] = {}
    for path in directory.glob("*.whl"):
        name, version = path.name.split("-")[:2]
        by_name[(normalize(name), version)] = path
    found, problems = {}, []
    for wheel in wheels:
        path = by_name.get((normalize(wheel.name), wheel.version))
        if path is None:
            problems.append(f"{wheel.name}=={wheel.version}: no wheel in {directory}")
        elif (digest := sha256_of(path)) != wheel.sha256:
            problems.append(f"{path.name}: sha256 {digest}, the lock says {wheel.sha256}")
        else:
            found[wheel.name] = path
    if problems:
        raise ValueError("wheels do not match the lock:\n  " + "\n  ".join(problems))
    return found


def slim_wheel(src: Path, dst: Path, drop: Iterable[str]) -> list[str]:
    """Copy the wheel ``src`` to ``dst`` without the members matching ``drop`` (fnmatch patterns),
    and without their RECORD lines; returns the members dropped."""
    patterns = list(drop)
    dropped = []
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if any(fnmatch.fnmatchcase(info.filename, p) for p in patterns):
                dropped.append(info.filename)
                continue
            data = zin.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = data.decode().splitlines(keepends=True)
                data = "".join(line for line in lines if line.split(",")[0] not in dropped).encode()
            zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED)
    return dropped


def pack(paths: list[Path], tar_path: Path) -> None:
    """One uncompressed tar of ``paths`` (wheels are compressed already), by file name, in order."""
    with tarfile.open(tar_path, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(paths, key=lambda p: p.name):
            info = tar.gettarinfo(str(path), arcname=path.name)
            info.mtime, info.uid, info.gid, info.uname, info.gname = 0, 0, 0, "", ""
            with open(path, "rb") as f:
                tar.addfile(info, f)


def split(path: Path, part_bytes: int, out_dir: Path) -> list[Path]:
    """``path`` cut into ``out_dir/<name>.00, .01, ...`` of at most ``part_bytes`` each."""
    if part_bytes < 1:
        raise ValueError(f"part size must be positive, got {part_bytes}")
    out_dir.mkdir(parents=True, exist_ok=True)
    parts = []
    with open(path, "rb") as f:
        while block := f.read(part_bytes):
            part = out_dir / f"{path.name}.{len(parts):02d}"
            part.write_bytes(block)
            parts.append(part)
    return parts


def write_manifest(out_dir: Path, parts: list[Path], wheels: list[Path]) -> Path:
    """sha256 of every part and every wheel in the tar, as ``sha256sum`` prints them."""
    lines = [f"{sha256_of(p)}  {p.name}" for p in parts] + [f"{sha256_of(w)}  {w.name}" for w in wheels]
    manifest = out_dir / MANIFEST
    manifest.write_text("\n".join(lines) + "\n")
    return manifest


def device_calls(parts: list[Path]) -> list[tuple[list[str], str]]:
    """(carry, command) of each device call: a part each, copied out of the tree so the next
    call's tree cannot take it away; the last call also carries the MANIFEST and installs."""
    calls = []
    for i, part in enumerate(parts):
        rel = part.relative_to(REPO)
        carry, copy = [str(rel)], f"mkdir -p /tmp/peer-parts && cp {rel} /tmp/peer-parts/"
        if i == len(parts) - 1:
            manifest = rel.parent / MANIFEST
            carry.append(str(manifest))
            copy = f"mkdir -p /tmp/peer-parts && cp {rel} {manifest} /tmp/peer-parts/"
            copy += " && scripts/install_peer.sh /tmp/peer-parts /tmp/vllm-site"
        calls.append((carry, copy))
    return calls


def prepare(args: argparse.Namespace) -> None:
    lock = parse_lock(LOCK.read_text())
    wheels = lock.wheels + [w for group in args.with_groups for w in lock.optional[group]]
    download_dir, wheel_dir, part_dir = PEER_DIR / "download", PEER_DIR / "wheels", PEER_DIR / "parts"
    download(wheels, download_dir)
    found = wheel_files(wheels, download_dir)
    for directory in (wheel_dir, part_dir):
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
    for name, path in found.items():
        if normalize(name) == "vllm":
            dropped = slim_wheel(path, wheel_dir / path.name, SLIM_VLLM)
            print(f"{path.name}: {len(dropped)} members dropped ({', '.join(sorted(dropped)[:3])}, ...)")
        else:
            os.link(path, wheel_dir / path.name)
    carried = sorted(wheel_dir.glob("*.whl"))
    tar_path = PEER_DIR / TAR_NAME
    pack(carried, tar_path)
    parts = split(tar_path, args.part_mib * MiB, part_dir)
    write_manifest(part_dir, parts, carried)
    total = sum(p.stat().st_size for p in carried)
    print(f"{len(carried)} wheels, {total / 1e6:.1f} MB, in {len(parts)} parts of <= {args.part_mib} MiB:")
    for part in parts:
        print(f"  {part}  {part.stat().st_size / 1e6:.1f} MB")
    print("\nDevice calls, back to back on one warm machine (each carries nothing else):")
    for i, (carry, command) in enumerate(device_calls(parts), 1):
        print(f"  {i}. carry={carry}\n     command: {command}")


# --- there: unpack, check the image --------------------------------------------------------------------


def read_manifest(path: Path) -> dict[str, str]:
    sums = {}
    for line in path.read_text().splitlines():
        digest, _, name = line.partition("  ")
        sums[name] = digest
    return sums


def unpack(parts_dir: Path, dest: Path) -> list[Path]:
    """Check the parts, put them together, extract the wheels into ``dest``, check each."""
    sums = read_manifest(parts_dir / MANIFEST)
    part_names = sorted(n for n in sums if n.startswith(TAR_NAME + "."))
    missing = [n for n in part_names if not (parts_dir / n).is_file()]
    if missing:
        raise ValueError(f"missing parts in {parts_dir}: {', '.join(missing)} (carry them first)")
    for name in part_names:
        if sha256_of(parts_dir / name) != sums[name]:
            raise ValueError(f"{name}: sha256 differs from the MANIFEST (a broken transfer?)")
    dest.mkdir(parents=True, exist_ok=True)
    tar_path = dest / TAR_NAME
    with open(tar_path, "wb") as out:
        for name in part_names:
            with open(parts_dir / name, "rb") as f:
                shutil.copyfileobj(f, out)
    with tarfile.open(tar_path) as tar:
        tar.extractall(dest, filter="data")
    tar_path.unlink()
    wheels = sorted(dest.glob("*.whl"))
    bad = [w.name for w in wheels if sums.get(w.name) != sha256_of(w)]
    if bad or len(wheels) != len(sums) - len(part_names):
        raise ValueError(f"wheels differ from the MANIFEST: {bad or 'a wheel is missing'}")
    return wheels


def check_image(requirements: list[ImageRequirement]) -> list[str]:
    """One line per image package missing or at a version outside its specifier (optional ones
    say so); empty when the image has everything."""
    from importlib import metadata

    from packaging.specifiers import SpecifierSet

    problems = []
    for req in requirements:
        note = f" (optional: {req.why})" if req.optional else ""
        try:
            version = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            wanted = req.specifier or "any version"
            problems.append(f"{req.name}: not installed, the lock needs {wanted}{note}")
            continue
        if req.specifier and not SpecifierSet(req.specifier).contains(version, prereleases=True):
            problems.append(f"{req.name} {version} is not {req.specifier}{note}")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command")
    unpack_cmd = sub.add_parser("unpack", help="(GPU machine) check and extract the carried parts")
    unpack_cmd.add_argument("--parts", default="/tmp/peer-parts")
    unpack_cmd.add_argument("--dest", default="/tmp/peer-wheels")
    sub.add_parser("check-image", help="(GPU machine) the image's packages against the lock")
    parser.add_argument("--with", dest="with_groups", nargs="*", default=[], help="optional lock groups")
    # A call carries 64 MiB with the working tree (about 10 MB) counted in: 48 leaves it room.
    parser.add_argument("--part-mib", type=int, default=48, help="largest part, MiB (64 MiB travel a call)")
    args = parser.parse_args(argv)
    if args.command == "unpack":
        wheels = unpack(Path(args.parts), Path(args.dest))
        print(f"{len(wheels)} wheels checked in {args.dest}")
        return 0
    lock = parse_lock(LOCK.read_text())
    if args.command == "check-image":
        problems = check_image(lock.image)
        for line in problems:
            print(f"image: {line}")
        required = [p for p in problems if "(optional:" not in p]
        print(f"image: {len(lock.image) - len(problems)}/{len(lock.image)} packages as the lock expects")
        return 1 if required else 0
    unknown = sorted(set(args.with_groups) - set(lock.optional))
    if unknown:
        parser.error(f"--with: no such group {unknown}; the lock has {sorted(lock.optional)}")
    if not 1 <= args.part_mib <= 60:
        parser.error(f"--part-mib must be in [1, 60] (64 MiB travel in a call), got {args.part_mib}")
    prepare(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
