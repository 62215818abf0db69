"""MLA decode, expanded against absorbed (pagedllm.models.deepseek_v2), one query over contexts of
latents, DeepSeek-V2-Lite's attention shape (16 heads, kv_lora_rank 512, rope 64), float32 on the
CPU: the per-sequence attention only, no cache gather.

    PYTHONPATH=$PWD OMP_NUM_THREADS=1 python benchmarks/mla_decode_forms.py
"""

from __future__ import annotations

import time
from pathlib import Path

import torch
from transformers import AutoConfig

from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.layers.rotary_embedding import RotaryEmbedding, get_rope_parameters
from pagedllm.models.deepseek_v2 import MLAAttention

CONFIG = Path(__file__).parent / "configs" / "deepseek-v2-lite"


def main() -> None:
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(CONFIG)
    rope = RotaryEmbedding(
        config.qk_rope_head_dim, 8192, get_rope_parameters(config), torch.float32
    )  # built but unused: the forms differ only after the rotation
    attention = MLAAttention(config, rope, TorchAttentionBackend, None)
    with torch.no_grad():
        for param in attention.parameters():
            param.normal_(0, 0.02)
        attention.process_weights_after_loading()
        for seq_len in (512, 4096):
            query = torch.randn(1, attention.num_heads, attention.qk_head_dim)
            context = torch.randn(seq_len, attention.kv_lora_rank + attention.qk_rope_head_dim)
            for name, attend in (("expanded", attention._attend), ("absorbed", attention._attend_absorbed)):
                attend(query, context)
                start = time.perf_counter()
                for _ in range(5):
                    attend(query, context)
                print(f"context {seq_len:5d} {name}: {(time.perf_counter() - start) / 5 * 1e3:7.2f} ms")
            diff = (
                (attention._attend(query, context) - attention._attend_absorbed(query, context)).abs().max()
            )
            print(f"context {seq_len:5d} max |expanded - absorbed|: {diff.item():.1e}")


if __name__ == "__main__":
    main()
