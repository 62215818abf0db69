"""scripts/prepare_peer.py: the lock's format and hashes, the vllm wheel's slimming, and the split
parts coming back together byte for byte (here with ``cat``, there with ``unpack``)."""

from __future__ import annotations

import hashlib
import importlib.util
import random
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("prepare_peer", REPO / "scripts" / "prepare_peer.py")
prepare_peer = sys.modules["prepare_peer"] = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(prepare_peer)


def test_the_lock_pins_vllm_0_26_with_a_sha256_per_wheel_and_leaves_torch_to_the_image():
    lock = prepare_peer.parse_lock(prepare_peer.LOCK.read_text())
    carried = {prepare_peer.normalize(w.name): w for w in lock.wheels}
    assert carried["vllm"].version == "0.26.0"
    assert all(len(w.sha256) == 64 for w in lock.wheels)
    image = {r.name: r for r in lock.image}
    # The GPU image's torch stack, pinned exactly by the vllm wheel, is never carried.
    assert image["torch"].specifier.split(",")[0] == "==2.11.0"
    assert image["torchvision"].specifier == "==0.26.0"
    assert not {"torch", "torchvision", "torchaudio", "triton"} & set(carried)
    # vLLM 0.26.0's pins: numba 0.65.0 (left to the image, optional), setuptools below 81 (carried).
    assert image["numba"].specifier == "==0.65.0" and image["numba"].optional
    assert int(carried["setuptools"].version.split(".")[0]) < 81
    left_out = {pin.split("==")[0].lower() for pin in lock.left_out}
    assert {"torchcodec", "pynvvideocodec", "tilelang", "tokenspeed-mla", "humming-kernels"} <= left_out
    assert not left_out & set(carried)
    assert "nvidia-cutlass-dsl" in {w.name for w in lock.optional["cutedsl"]}


@pytest.mark.parametrize(
    "text, message",
    [
        ("vllm==0.26.0\n", "lock line 1"),
        ("vllm==0.26.0 --hash=sha256:abc\n", "64 hex"),
        (f"a==1 --hash=sha256:{'0' * 64}\nA==2 --hash=sha256:{'1' * 64}\n", "more than once: a"),
        (f"numpy==2 --hash=sha256:{'0' * 64}\n#image: numpy >=1\n", "carries and leaves to the image"),
    ],
)
def test_a_malformed_lock_is_refused_naming_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        prepare_peer.parse_lock(text)


def _write_wheel(path: Path, members: dict[str, bytes]) -> Path:
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for name, data in members.items():
            z.writestr(name, data)
    return path


def test_downloaded_wheels_are_checked_against_the_lock(tmp_path):
    wheel = _write_wheel(tmp_path / "demo_pkg-1.0-py3-none-any.whl", {"demo_pkg/__init__.py": b"x = 1\n"})
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    good = prepare_peer.LockedWheel("demo-pkg", "1.0", digest)
    assert prepare_peer.wheel_files([good], tmp_path) == {"demo-pkg": wheel}
    with pytest.raises(ValueError, match=r"demo_pkg-1\.0-py3-none-any\.whl: sha256"):
        prepare_peer.wheel_files([prepare_peer.LockedWheel("demo-pkg", "1.0", "0" * 64)], tmp_path)
    with pytest.raises(ValueError, match="other==2: no wheel"):
        prepare_peer.wheel_files([prepare_peer.LockedWheel("other", "2", digest)], tmp_path)


def test_slimming_drops_the_matching_members_and_their_record_lines(tmp_path):
    record = (
        "vllm/__init__.py,sha256=a,6\n"
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so,sha256=b,4\n"
        "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so,sha256=c,4\n"
        "vllm-0.26.0.dist-info/RECORD,,\n"
    )
    members = {
        "vllm/__init__.py": b"x = 1\n",
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"fa2!",
        "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": b"fa3!",
        "vllm-0.26.0.dist-info/RECORD": record.encode(),
    }
    src = _write_wheel(tmp_path / "in.whl", members)
    dropped = prepare_peer.slim_wheel(src, tmp_path / "out.whl", prepare_peer.SLIM_VLLM)
    assert dropped == ["vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"]
    with zipfile.ZipFile(tmp_path / "out.whl") as z:
        assert sorted(z.namelist()) == sorted(set(members) - set(dropped))
        assert z.read("vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so") == b"fa3!"
        assert "_vllm_fa2_C" not in z.read("vllm-0.26.0.dist-info/RECORD").decode()
        assert "_vllm_fa3_C" in z.read("vllm-0.26.0.dist-info/RECORD").decode()


def _wheels(directory: Path, sizes: list[int]) -> list[Path]:
    directory.mkdir()
    rng = random.Random(0)
    names = [directory / f"p{i}-1.0-py3-none-any.whl" for i in range(len(sizes))]
    return [_write_wheel(name, {"f": rng.randbytes(n)}) for name, n in zip(names, sizes)]


def test_split_parts_cat_back_to_the_same_bytes(tmp_path):
    wheels = _wheels(tmp_path / "w", [5000, 12000, 300])
    tar = tmp_path / prepare_peer.TAR_NAME
    prepare_peer.pack(wheels, tar)
    parts = prepare_peer.split(tar, 4096, tmp_path / "parts")
    assert len(parts) == -(-tar.stat().st_size // 4096)
    assert all(p.stat().st_size <= 4096 for p in parts)
    joined = subprocess.run(["cat", *map(str, parts)], capture_output=True, check=True).stdout
    assert joined == tar.read_bytes()


def test_unpack_restores_every_wheel_and_refuses_a_broken_or_missing_part(tmp_path):
    wheels = _wheels(tmp_path / "w", [7000, 9000])
    tar = tmp_path / prepare_peer.TAR_NAME
    prepare_peer.pack(wheels, tar)
    parts = prepare_peer.split(tar, 4096, tmp_path / "parts")
    prepare_peer.write_manifest(tmp_path / "parts", parts, wheels)
    restored = prepare_peer.unpack(tmp_path / "parts", tmp_path / "dest")
    assert [w.read_bytes() for w in restored] == [w.read_bytes() for w in wheels]

    broken = bytearray(parts[1].read_bytes())
    broken[10] ^= 0xFF
    parts[1].write_bytes(bytes(broken))
    with pytest.raises(ValueError, match=r"vllm-peer.tar.01: sha256 differs"):
        prepare_peer.unpack(tmp_path / "parts", tmp_path / "dest2")
    parts[2].unlink()
    with pytest.raises(ValueError, match=r"missing parts .*vllm-peer.tar.02"):
        prepare_peer.unpack(tmp_path / "parts", tmp_path / "dest3")


def test_the_image_check_names_each_missing_or_mismatched_package():
    import packaging

    Req = prepare_peer.ImageRequirement
    problems = prepare_peer.check_image(
        [
            Req("packaging", f"=={packaging.__version__}", False),
            Req("packaging", "<0.1", False),
            Req("surely-not-installed-pkg", "", True, "only for video"),
        ]
    )
    assert problems == [
        f"packaging {packaging.__version__} is not <0.1",
        "surely-not-installed-pkg: not installed, the lock needs any version (optional: only for video)",
    ]


def test_the_last_device_call_carries_the_manifest_and_installs(tmp_path):
    parts = [prepare_peer.PEER_DIR / "parts" / f"{prepare_peer.TAR_NAME}.{i:02d}" for i in range(3)]
    calls = prepare_peer.device_calls(parts)
    assert [carry for carry, _ in calls[:2]] == [[f".peer/parts/vllm-peer.tar.0{i}"] for i in range(2)]
    assert calls[2][0] == [".peer/parts/vllm-peer.tar.02", ".peer/parts/MANIFEST"]
    assert calls[2][1].endswith("scripts/install_peer.sh /tmp/peer-parts /tmp/vllm-site")
