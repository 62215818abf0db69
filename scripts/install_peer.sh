#!/usr/bin/env bash
# On the offline GPU machine: install the vLLM peer from the parts scripts/prepare_peer.py made
# and the device calls carried to PARTS (default /tmp/peer-parts), into TARGET (default
# /tmp/vllm-site) alone: `pip install --target`, so the image's own packages stay as they are and
# only a process given PYTHONPATH=TARGET sees vLLM (benchmarks/peers/vllm_peer.py does that for its
# vLLM subprocesses). Then checks what the lock leaves to the image, and that vllm imports: its
# CUDA 13 extension against the image's torch, FlashAttention 3 present (FA2 is slimmed out).
#
#   scripts/install_peer.sh [PARTS] [TARGET]
set -uo pipefail
cd "$(dirname "$0")/.."
PARTS=${1:-/tmp/peer-parts}
TARGET=${2:-/tmp/vllm-site}
WHEELS=/tmp/peer-wheels
PY=${PYTHON:-python3}

rm -rf "$WHEELS"
$PY scripts/prepare_peer.py unpack --parts "$PARTS" --dest "$WHEELS" || exit 1
$PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$TARGET" \
    "$WHEELS"/*.whl || { echo "pip install into $TARGET failed"; exit 1; }
rm -rf "$WHEELS"
# Each mismatch is one line; a required one fails this script after the import check below.
$PY scripts/prepare_peer.py check-image
image_ok=$?
PYTHONPATH="$TARGET" $PY - <<'PY' || exit 1
import torch
import vllm
import vllm._C_stable_libtorch  # noqa: F401  the CUDA 13 extensions, built against torch 2.11
import vllm._moe_C_stable_libtorch  # noqa: F401
from vllm.vllm_flash_attn.flash_attn_interface import FA2_AVAILABLE, FA3_AVAILABLE

print(f"vllm {vllm.__version__} from {vllm.__file__} on torch {torch.__version__}; "
      f"FlashAttention 3 available: {FA3_AVAILABLE}, 2: {FA2_AVAILABLE}")
if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9 and not FA3_AVAILABLE:
    raise SystemExit("FlashAttention 3 does not load on this Hopper GPU: vLLM would need FA2")
PY
exit $image_ok
