from pagedllm.attention.backends import get_attn_backend
from pagedllm.attention.layer import Attention
from pagedllm.attention.metadata import AttentionMetadata

__all__ = ["Attention", "AttentionMetadata", "get_attn_backend"]
