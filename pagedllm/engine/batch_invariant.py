"""What ``batch_invariant=True`` refuses: every piece of an engine without a batch-invariant path.

In this mode a request's tokens and logprobs must not depend on the batch it runs in
(docs/determinism.md). The worker then picks the invariant kernels (``layers/batch_invariant_linear``,
the ``triton_invariant`` attention backend, the sampler's per-row pass); what has none is refused
here, once the config is resolved and before any worker starts, naming the piece, rather than
left silently batch-dependent.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedllm.config import EngineConfig

# Keys of a Hugging Face config that make a model a mixture of experts.
_MOE_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# Attention backends with an invariant path on CUDA ("auto" picks it).
_CUDA_BACKENDS = ("auto", "triton")


def check_batch_invariant(config: EngineConfig) -> None:
    """ValueError naming the first piece of ``config`` that cannot run batch-invariant."""
    reason = _refusal(config)
    if reason is not None:
        raise ValueError(f"batch_invariant=True: {reason}")


def _refusal(config: EngineConfig) -> str | None:
    model_config = config.model_config
    if config.speculative_config is not None:
        return "speculative_config is not supported (a verification step scores drafts as a batch of its own)"
    if config.lora_config is not None:
        return "enable_lora is not supported (the punica LoRA kernels group rows by adapter across the batch)"
    if config.compile_cpu_decode:
        return (
            "cpu_compile is not supported (the compiled decode step fuses its reductions unlike the "
            "eager prefill)"
        )
    if model_config.has_recurrent_state:
        return (
            "models with linear-attention layers are not supported (their prefill kernels split a "
            "chunk into blocks from its start, which the chunk boundaries move)"
        )
    quantized = _quantized_weights(config)
    if quantized is not None:
        return f"{quantized} has no batch-invariant GEMM; load the model dense (quantization='none')"
    hf_config = model_config.hf_config
    on_cuda = config.device_config.device.type == "cuda"
    if any(getattr(hf_config, key, 0) for key in _MOE_KEYS) and not on_cuda:
        # On CUDA the fused MoE kernel has an invariant form (layers/batch_invariant_linear.py).
        return (
            "mixture-of-experts models are supported on CUDA only (the CPU's experts multiply each "
            "expert's tokens in a GEMM sized by their count)"
        )
    if config.parallel_config.context_parallel_size > 1:
        return (
            "context_parallel_size > 1 is not supported (the ranks' partial attentions merge by "
            "log-sum-exp, which the invariant attention kernels do not write)"
        )
    if config.parallel_config.tensor_parallel_size > 2:
        # Two ranks' partial sums add to the same bits whichever rank's comes first and whatever
        # the algorithm (one correctly rounded addition); three or more add in an order that NCCL
        # and the custom all-reduce choose by message size, which grows with the batch.
        return (
            "tensor_parallel_size > 2 is not supported (the all-reduce's summation order is "
            "chosen by message size, which grows with the batch)"
        )
    if not on_cuda:
        return None  # the CPU's kernels reduce each row alone (tests/engine/test_batch_invariant.py)
    return _cuda_refusal(config)


def _cuda_refusal(config: EngineConfig) -> str | None:
    if config.attention_backend not in _CUDA_BACKENDS:
        return (
            f"attention_backend={config.attention_backend!r} has no batch-invariant path on CUDA; "
            f"use one of {_CUDA_BACKENDS}"
        )
    if config.model_config.is_mla:
        return "multi-head latent attention (MLA) has no batch-invariant kernel"
    return None


def _quantized_weights(config: EngineConfig) -> str | None:
    """What quantizes the model's weights, or None for a dense model."""
    from pagedllm.layers.quantization import keeps_gguf_quantized
    from pagedllm.model_loader.quantized import resolve_quantization

    model_config = config.model_config
    quant_config = resolve_quantization(model_config)
    if quant_config is not None:
        return f"quantization {quant_config.name!r}"
    is_gguf = model_config.gguf_file is not None or model_config.model.endswith(".gguf")
    device = config.device_config.device
    if keeps_gguf_quantized(model_config.quantization, is_gguf, device, model_config.dtype):
        return "a GGUF model kept quantized"
    return None
