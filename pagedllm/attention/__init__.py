from pagedllm.attention.backends import get_attn_backend
from pagedllm.attention.forward_context import get_forward_context, set_forward_context
from pagedllm.attention.layer import Attention, AttentionLayerBase, bind_kv_caches
from pagedllm.attention.metadata import AttentionMetadata

__all__ = [
    "Attention",
    "AttentionLayerBase",
    "AttentionMetadata",
    "bind_kv_caches",
    "get_attn_backend",
    "get_forward_context",
    "set_forward_context",
]
