"""What an attention backend provides: its KV cache layout and its forward pass."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, Protocol

import torch

from pagedllm.attention.metadata import AttentionMetadata

if TYPE_CHECKING:
    from pagedllm.config import ModelConfig

# One layer's cache: (key_cache, value_cache). Every backend's layout puts the block number
# first, so swapping and copying blocks is the same indexing for all of them.
KVCache = tuple[torch.Tensor, torch.Tensor]


class Rotary(Protocol):
    """A rotary embedding as a backend applies it (``layers.rotary_embedding.RotaryEmbedding``)."""

    def __call__(
        self, positions: torch.Tensor, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """query, key: [num_tokens, heads * head_size], rotated (possibly in place) to positions."""

    def cos_sin_rows(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(table, index): the ``[cos | sin]`` rows of ``positions`` are ``table[index]``."""


class AttentionBackend(ABC):
    """One attention layer's compute over a paged cache in this backend's layout."""

    name: ClassVar[str]
    # Whether forward() is free of host syncs and data-dependent shapes on decode-only batches,
    # so that a decode step can be captured in a CUDA graph.
    supports_cuda_graphs: ClassVar[bool] = False
    # Whether the kernels read a float8_e4m3fn cache (kv_cache_dtype="fp8", attention/kv_quant.py).
    supports_fp8_kv_cache: ClassVar[bool] = False
    # Whether forward_partial attends over a cache striped over context-parallel ranks.
    supports_context_parallel: ClassVar[bool] = False

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int,
        *,
        sliding_window: int | None = None,
        alibi_slopes: torch.Tensor | None = None,
        logits_soft_cap: float | None = None,
        attention_sinks: int = 0,
        rotary: Rotary | None = None,
        sinks: torch.Tensor | None = None,
        cp_rank: int = 0,
        cp_world_size: int = 1,
    ) -> None:
        """Per-layer attention variants (None, or 0 for attention_sinks: off):

        sliding_window: a query at position p attends to keys at positions > p - sliding_window
            (Hugging Face's ``sliding_window_overlay``: the window holds the query and the
            sliding_window - 1 keys before it).
        alibi_slopes: [num_heads] float32, this rank's heads: score(p, n) += slope * (n - p)
            (Press et al. 2022; softmax is shift-invariant, so BLOOM's slope * n is the same).
        logits_soft_cap: scores become cap * tanh(scores / cap) before ALiBi and masking (Gemma 2).
        attention_sinks: S > 0 keeps the context's first S tokens visible to every later query on
            top of its sliding window (StreamingLLM, Xiao et al. 2023, "Efficient Streaming
            Language Models with Attention Sinks"): key k is visible to query position q iff
            ``k <= q and (k > q - sliding_window or k < S)``. A sink the window has passed
            (``k <= q - sliding_window``) is scored with ``forward``'s ``sink_query``, the same
            query rotated at another rotary position (the model computes it: the positions a
            sink should see are the model's choice, not the kernel's); every other visible key
            with ``query``. Scale, soft cap, ALiBi (distance k - q) and one softmax over all
            visible keys apply as for any key. Needs a sliding_window.
        sinks: [num_heads], this rank's heads: a learned sink logit per head (gpt-oss; vLLM's
            ``sinks``), one more term in every row's softmax denominator, attending to nothing:
            ``p_k = exp(s_k) / (exp(sink_h) + sum_j exp(s_j))``, so a row may give less than all
            its weight to the keys. Not StreamingLLM's ``attention_sinks`` (kept tokens). Kept
            by reference (the model loads it after construction); read in float32.
        rotary: the rotary embedding (neox style) that turns ``forward``'s query and key to their
            ``positions``. The backend applies it, or fuses it into its cache write where its
            kernels can (Triton's), so that models call every backend alike.
        cp_rank, cp_world_size: context parallelism (``forward_partial``): this rank's cache
            holds the tokens at positions ``t % cp_world_size == cp_rank`` of every sequence.
        """
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1 or None, got {sliding_window}")
        if logits_soft_cap is not None and not logits_soft_cap > 0:
            raise ValueError(f"logits_soft_cap must be > 0 or None, got {logits_soft_cap}")
        if alibi_slopes is not None and tuple(alibi_slopes.shape) != (num_heads,):
            raise ValueError(f"alibi_slopes must have shape [{num_heads}], got {tuple(alibi_slopes.shape)}")
        if sinks is not None and tuple(sinks.shape) != (num_heads,):
            raise ValueError(f"sinks must have shape [{num_heads}], got {tuple(sinks.shape)}")
        if isinstance(attention_sinks, bool) or not isinstance(attention_sinks, int) or attention_sinks < 0:
            raise ValueError(f"attention_sinks must be an int >= 0, got {attention_sinks!r}")
        if attention_sinks > 0 and sliding_window is None:
            raise ValueError(
                f"attention_sinks ({attention_sinks}) needs a sliding_window: without one every key "
                "is visible already"
            )
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = scale
        self.num_kv_heads = num_kv_heads
        self.num_queries_per_kv = num_heads // num_kv_heads
        self.sliding_window = sliding_window
        self.alibi_slopes = None if alibi_slopes is None else alibi_slopes.float().contiguous()
        self.logits_soft_cap = logits_soft_cap
        self.attention_sinks = attention_sinks
        self.sinks = sinks
        self.rotary = rotary
        self.cp_rank = cp_rank
        self.cp_world_size = cp_world_size
        # The FP8 cache's per-tensor scales (attention/kv_quant.py): float32 device scalars, 1.0
        # unless the checkpoint has them (filled in place by models/kv_scales.py, so a captured
        # CUDA graph reads the loaded values); unread with a cache in the model dtype.
        self.k_scale = torch.ones((), dtype=torch.float32)
        self.v_scale = torch.ones((), dtype=torch.float32)

    @staticmethod
    @abstractmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, dtype: torch.dtype
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """Shapes of one layer's (key_cache, value_cache); dimension 0 is the block number."""

    @classmethod
    @abstractmethod
    def check_supported(
        cls, head_size: int, block_size: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        """Raise ValueError naming what this backend cannot run."""

    @classmethod
    def check_model_supported(cls, model_config: ModelConfig, block_size: int, device: torch.device) -> None:
        """``check_supported`` for ``model_config``'s attention layers, target's or draft's. MLA's
        layers attend themselves (models/deepseek_v2.py: its own kernels and the checks of the
        backends they run on): its cache "head" of kv_lora_rank + rope dims is no backend's head size."""
        if not model_config.is_mla:
            cls.check_supported(model_config.head_size, block_size, model_config.dtype, device)

    @abstractmethod
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: KVCache,
        attn_metadata: AttentionMetadata,
        sink_query: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """query: [num_tokens, num_heads, head_size]; key, value: [num_tokens, num_kv_heads,
        head_size]. Writes key/value into ``kv_cache`` at ``attn_metadata.slot_mapping``, then
        returns attention over each sequence's context: [num_tokens, num_heads, head_size].

        sink_query: [num_tokens, num_heads, head_size], the query that scores the sinks its
        window has passed; required with attention_sinks > 0, ignored otherwise
        (``_check_sink_query``). positions: [num_tokens] int64, the tokens' positions: the
        layer's ``rotary`` turns query and key (they come unrotated) to them; None where query and
        key come rotated already (``rotate``), or without a rotary embedding."""

    def forward_partial(
        self, query: torch.Tensor, *inputs: Any, **options: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Context parallelism, for backends that ``supports_context_parallel`` (whose ``forward``
        then takes an ``lse`` to write): ``forward``'s arguments, this rank holding the keys at
        positions ``j * cp_world_size + cp_rank`` (its cache's local index ``j`` of the sequence)
        and getting every query of the step. Writes the step's K/V as ``forward`` does
        (``slot_mapping`` is -1 where another rank stores the token), then attends every query to
        the keys it sees here. The metadata stays global: ``seq_lens`` are whole contexts, and
        a sequence's local key count is ``ceil((seq_len - cp_rank) / cp_world_size)``.

        Returns (out [num_tokens, num_heads, head_size] in the query dtype, lse [num_tokens,
        num_heads] float32): the softmax-weighted values over this rank's visible keys, and the
        natural log of that softmax's denominator (of the scaled, soft-capped, ALiBi'd scores);
        -inf, with out 0, where a query sees no key here; padding tokens' rows unwritten.
        ``attention/context_parallel.py`` merges the ranks' partials."""
        if not self.supports_context_parallel:
            raise NotImplementedError(f"the {self.name!r} attention backend does not read a striped cache")
        lse = torch.empty(query.shape[:2], dtype=torch.float32, device=query.device)
        return self.forward(query, *inputs, **options, lse=lse), lse

    def rotate(
        self, positions: torch.Tensor | None, query: torch.Tensor, key: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """query and key ([num_tokens, heads, head_size]) turned to their positions by the
        layer's rotary embedding, same shapes (possibly rotated in place); as they are without one
        or without positions. A compiled step rotates in its graph, where inductor fuses the
        rotation, and passes the rotated query and key to ``forward`` without positions."""
        if self.rotary is None or positions is None:
            return query, key
        rotated_query, rotated_key = self.rotary(positions, query.flatten(1), key.flatten(1))
        return rotated_query.view(query.shape), rotated_key.view(key.shape)

    def _check_sink_query(self, query: torch.Tensor, sink_query: torch.Tensor | None) -> torch.Tensor | None:
        """``sink_query`` after checking its shape (host metadata only: no device sync); forward
        calls it only with sinks (without, whatever was passed is dropped)."""
        if sink_query is None:
            raise ValueError(f"sink_query is required with attention_sinks={self.attention_sinks}")
        if sink_query.shape != query.shape:
            raise ValueError(
                f"sink_query must have the query's shape {tuple(query.shape)}, got {tuple(sink_query.shape)}"
            )
        return sink_query
