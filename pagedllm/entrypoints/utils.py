"""What the entry points log about the engine they started."""

from __future__ import annotations

import os

from pagedllm.attention.backends import get_attn_backend
from pagedllm.config import EngineConfig
from pagedllm.layers.quantization import keeps_gguf_quantized
from pagedllm.model_loader.quantized import resolve_quantization


def engine_summary(config: EngineConfig, num_gpu_blocks: int, load_seconds: float) -> str:
    """One line on the engine just built: what runs where, and how much KV cache it has.

    ``num_gpu_blocks``: the KV cache blocks the engine sized (``LLMEngine.num_gpu_blocks``, or
    ``EngineStats.num_gpu_blocks`` across the engine process's pipe); ``load_seconds``: the time
    the caller waited for the engine.
    """
    model_config = config.model_config
    device = config.device_config.device
    num_threads = config.device_config.num_threads
    device_text = f"{device} ({num_threads} threads)" if device.type == "cpu" and num_threads else str(device)
    parallel_config = config.parallel_config
    if parallel_config.world_size > 1:
        device_text += f" x {parallel_config.world_size} ranks"
        if parallel_config.pipeline_parallel_size > 1:
            device_text += f" ({parallel_config.pipeline_parallel_size} pipeline stages)"
        if parallel_config.context_parallel_size > 1:
            cp = parallel_config.context_parallel_size
            device_text += f" (KV striped over {cp} context-parallel ranks)"
    attention = get_attn_backend(
        config.attention_backend,
        device,
        config.batch_invariant,
        context_parallel=config.parallel_config.context_parallel_size > 1,
    ).name
    quantized = model_config.gguf_file is not None and keeps_gguf_quantized(
        model_config.quantization, True, device, model_config.dtype
    )
    quant_config = resolve_quantization(model_config)
    quantization = "gguf" if quantized else quant_config.name if quant_config is not None else "none"
    block_size = config.scheduler_block_size
    dtype = str(model_config.dtype).removeprefix("torch.")
    model = os.path.basename(os.path.normpath(model_config.model))  # its path is the one given
    return (
        f"engine ready in {load_seconds:.1f} s: model {model}, "
        f"dtype {dtype}, device {device_text}, attention {attention}, "
        f"quantization {quantization}, "
        f"KV cache {num_gpu_blocks:,} blocks x {block_size} = {num_gpu_blocks * block_size:,} tokens "
        f"(max_model_len {model_config.max_model_len:,})"
    )
