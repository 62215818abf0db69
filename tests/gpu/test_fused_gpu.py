"""The fused Triton kernels on CUDA, reached the way the model reaches them: through the layers.

On a CUDA tensor ``RMSNorm``, ``RotaryEmbedding`` (whole heads and part of each), ``SiluAndMul`` and
``SigmoidGate`` dispatch to their Triton kernels; each is compared with the layer's torch path on
the same device, in float32, float16 and bfloat16, at the CPU tests' shapes and at model sizes
(Llama-3.1-8B's hidden 4096 and MLP 14336, an 8192-token prefill; Qwen3-Next's attention at a
16,384-token step). Then the contracts the model relies on: the residual variant and rotary write
in place, the layers capture in a CUDA graph, and a Qwen3 model (per-head norms on strided views,
residual stream across layers) still matches Hugging Face.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

# Skip before importing the kernels: triton decides compiled vs interpreted when a kernel is
# decorated, and tests/kernels needs them interpreted on a machine without CUDA.
if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA and compiled (not interpreted) Triton kernels", allow_module_level=True)
pytest.importorskip("triton", reason="the fused kernels need the triton package")

from transformers import MixtralConfig, Qwen3Config, Qwen3MoeConfig

from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.layers.activation import SigmoidGate, SiluAndMul
from pagedllm.layers.layernorm import RMSNorm
from pagedllm.layers.logits_processor import LogitsProcessor
from pagedllm.layers.rotary_embedding import RotaryEmbedding
from pagedllm.layers.vocab_parallel_embedding import VocabParallelEmbedding
from pagedllm.model_loader import get_model

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-3, 2e-3), torch.bfloat16: (1.6e-2, 1e-2)}
# The CPU tests' sizes, then a long prefill at Llama-3.1-8B's width.
SHAPES = [(n, h) for h in (64, 576, 4096) for n in (1, 7, 33)] + [(8192, 4096)]


def _assert_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    assert not out.isnan().any(), f"{int(out.isnan().sum())} NaN outputs"
    atol, rtol = TOLERANCES[out.dtype]
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)


def _norm(hidden_size: int, dtype: torch.dtype) -> RMSNorm:
    norm = RMSNorm(hidden_size, eps=1e-5).to(DEVICE, dtype)
    norm.weight.copy_(1.0 + 0.2 * torch.randn(hidden_size, device=DEVICE))
    return norm


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, hidden_size", SHAPES)
def test_rms_norm(num_tokens: int, hidden_size: int, dtype: torch.dtype) -> None:
    torch.manual_seed(num_tokens + hidden_size)
    norm = _norm(hidden_size, dtype)
    x = torch.randn(num_tokens, hidden_size, device=DEVICE, dtype=dtype)
    _assert_close(norm(x), norm.forward_torch(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, hidden_size", SHAPES)
def test_fused_add_rms_norm_in_place(num_tokens: int, hidden_size: int, dtype: torch.dtype) -> None:
    torch.manual_seed(num_tokens * hidden_size)
    norm = _norm(hidden_size, dtype)
    x = torch.randn(num_tokens, hidden_size, device=DEVICE, dtype=dtype)
    residual = torch.randn_like(x)
    ref_out, ref_residual = norm.forward_torch(x, residual)
    out, new_residual = norm(x, residual)
    assert out.data_ptr() == x.data_ptr() and new_residual.data_ptr() == residual.data_ptr()
    assert torch.equal(new_residual, ref_residual)
    _assert_close(out, ref_out)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_rms_norm_over_heads_of_a_fused_qkv_view(head_size: int, dtype: torch.dtype) -> None:
    torch.manual_seed(head_size)
    num_tokens, num_heads, num_kv_heads = 33, 16, 8
    norm = _norm(head_size, dtype)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_size, device=DEVICE, dtype=dtype)
    q = qkv[:, : num_heads * head_size].view(num_tokens, num_heads, head_size)
    _assert_close(norm(q), norm.forward_torch(q))


# (head_size, num_heads, num_kv_heads): the CPU tests' shapes and Llama-3.1-8B's 32/8 of 128.
ROTARY_SHAPES = [(64, 8, 2), (80, 8, 2), (96, 12, 4), (128, 8, 1), (256, 4, 2), (128, 32, 8)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 7, 33, 8192])
@pytest.mark.parametrize("head_size, num_heads, num_kv_heads", ROTARY_SHAPES)
def test_rotary_in_place(
    head_size: int, num_heads: int, num_kv_heads: int, num_tokens: int, dtype: torch.dtype
) -> None:
    torch.manual_seed(head_size * num_tokens)
    max_position = 16384
    rope = RotaryEmbedding(head_size, max_position, {"rope_type": "default", "rope_theta": 500000.0}, dtype)
    rope = rope.to(DEVICE)
    q_size, kv_size = num_heads * head_size, num_kv_heads * head_size
    qkv = torch.randn(num_tokens, q_size + 2 * kv_size, device=DEVICE, dtype=dtype)
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    v_before = v.clone()
    positions = torch.randint(0, max_position, (2 * num_tokens,), device=DEVICE)[::2]
    ref_q, ref_k = rope.forward_torch(positions, q.clone(), k.clone())
    out_q, out_k = rope(positions, q, k)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    assert torch.equal(v, v_before)
    # Compiled for the GPU, the kernel may fuse a product into its sum (one rounding instead of
    # two): within an ulp of the torch path, not always equal to it.
    _assert_close(out_q, ref_q)
    _assert_close(out_k, ref_k)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 33, 16384])
def test_partial_rotary_in_place(num_tokens: int, dtype: torch.dtype) -> None:
    """Qwen3-Next's rotation of the first 64 of each 256-wide head (16 q heads, 2 kv heads), in
    place through the layer's dispatch: within an ulp of the torch path, the rest of each head and
    v untouched."""
    torch.manual_seed(num_tokens)
    params = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}
    rope = RotaryEmbedding(256, 32768, params, dtype).to(DEVICE)
    qkv = torch.randn(num_tokens, 20 * 256, device=DEVICE, dtype=dtype)
    before = qkv.clone()
    q, k, _ = qkv.split([16 * 256, 2 * 256, 2 * 256], dim=-1)
    positions = torch.randint(0, 32768, (num_tokens,), device=DEVICE)
    ref_q, ref_k = rope.forward_torch(positions, q.clone(), k.clone())
    out_q, out_k = rope(positions, q, k)
    assert out_q.data_ptr() == q.data_ptr() and out_k.data_ptr() == k.data_ptr()
    _assert_close(out_q, ref_q)
    _assert_close(out_k, ref_k)
    rotated = torch.zeros(20, 256, dtype=torch.bool, device=DEVICE)
    rotated[:18, :64] = True  # q's and k's heads; v's are past them
    assert torch.equal(
        qkv.view(num_tokens, 20, 256)[:, ~rotated], before.view(num_tokens, 20, 256)[:, ~rotated]
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens, d", [(n, d) for d in (64, 576, 4096, 14336) for n in (1, 33, 2048)])
def test_silu_and_mul(num_tokens: int, d: int, dtype: torch.dtype) -> None:
    torch.manual_seed(num_tokens + d)
    x = torch.randn(num_tokens, 2 * d, device=DEVICE, dtype=dtype)
    act = SiluAndMul().to(DEVICE)
    _assert_close(act(x), act.forward_torch(x))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 33, 16384])
def test_sigmoid_gate_within_an_ulp(num_tokens: int, dtype: torch.dtype) -> None:
    """Qwen3-Next's output gate (16 heads of 256, the gate a view of the q projection's output)
    through the layer's dispatch: Hugging Face's roundings but for the exponential's last float32
    bits, so in 16 bits at most one ulp apart and nearly always equal; in float32, where nothing
    rounds that error away, a few ulps (2.8 at most, measured on an H200)."""
    torch.manual_seed(num_tokens)
    q_gate = torch.randn(num_tokens, 16, 2 * 256, device=DEVICE, dtype=dtype)
    x, gate = torch.randn(num_tokens, 16, 256, device=DEVICE, dtype=dtype), q_gate[..., 256:]
    layer = SigmoidGate().to(DEVICE)
    out, expected = layer(x, gate), layer.forward_torch(x, gate)
    finfo = torch.finfo(dtype)
    ulps = 4 if dtype == torch.float32 else 1
    torch.testing.assert_close(out, expected, atol=finfo.eps * finfo.tiny, rtol=ulps * finfo.eps)
    if dtype != torch.float32:
        assert (out != expected).float().mean() < 1e-2


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_logits_are_written_in_float32_by_the_matmul(dtype: torch.dtype) -> None:
    """On one CUDA rank in 16 bits the LM head's product writes float32 (``forward_cuda``): as
    close to the float32 product as the widened model-dtype logits, or closer, at W6's vocabulary."""
    torch.manual_seed(0)
    vocab, hidden_size = 151_936, 2048
    head = VocabParallelEmbedding(vocab, hidden_size).to(DEVICE, dtype)
    head.weight.data.normal_()
    processor = LogitsProcessor(vocab).to(DEVICE, dtype)
    assert processor.forward_method == processor.forward_cuda
    hidden = torch.randn(256, hidden_size, device=DEVICE, dtype=dtype) / hidden_size**0.5
    exact = hidden.float() @ head.weight.float().T
    logits = processor(head, hidden)
    assert logits.dtype == torch.float32 and logits.shape == (256, vocab)
    widened = processor.forward_torch(head, hidden)
    assert (logits - exact).abs().max() <= (widened - exact).abs().max()
    torch.testing.assert_close(logits, exact, atol=1e-2, rtol=1e-2)


def test_layers_replay_in_a_cuda_graph() -> None:
    """No host syncs and no allocation outside the graph's pool: norm, rotary and the activation
    capture once and replay on new inputs written into the same buffers."""
    torch.manual_seed(0)
    num_tokens, hidden_size, head_size = 64, 1024, 128
    norm = _norm(hidden_size, torch.bfloat16)
    rope = RotaryEmbedding(head_size, 4096, {"rope_type": "default", "rope_theta": 10000.0}, torch.bfloat16)
    rope = rope.to(DEVICE)
    act = SiluAndMul().to(DEVICE)
    x = torch.empty(num_tokens, hidden_size, device=DEVICE, dtype=torch.bfloat16)
    residual, positions = torch.empty_like(x), torch.empty(num_tokens, dtype=torch.int64, device=DEVICE)

    def step() -> tuple[torch.Tensor, ...]:
        hidden, new_residual = norm(x, residual)
        gated = act(hidden)  # before rotary rotates parts of hidden in place
        q, k = rope(positions, hidden[:, :512], hidden[:, 512:768])
        return gated, new_residual, q, k

    def fill() -> dict[str, torch.Tensor]:
        inputs = {"x": torch.randn_like(x), "residual": torch.randn_like(x)}
        inputs["positions"] = torch.randint(0, 4096, (num_tokens,), device=DEVICE)
        x.copy_(inputs["x"])
        residual.copy_(inputs["residual"])
        positions.copy_(inputs["positions"])
        return inputs

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fill()
        step()  # compiles the kernels outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graph_outputs = step()

    inputs = fill()
    graph.replay()
    hidden, new_residual = norm.forward_torch(inputs["x"], inputs["residual"])
    q, k = rope.forward_torch(inputs["positions"], hidden[:, :512], hidden[:, 512:768])
    expected = (act.forward_torch(hidden), new_residual, q, k)
    for out, ref in zip(graph_outputs, expected, strict=True):
        _assert_close(out, ref)


# Qwen3, and the mixtures of experts on the same layers (their experts on the fused MoE kernel).
CUDA_MODELS = {
    "qwen3": (Qwen3Config, {}),
    "qwen3moe-mlp-only-layer": (
        Qwen3MoeConfig,
        dict(
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            norm_topk_prob=True,
            mlp_only_layers=[0],
        ),
    ),
    "mixtral": (MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2)),
}


@pytest.mark.parametrize("case", list(CUDA_MODELS))
def test_model_on_cuda_matches_hugging_face(
    case: str, make_tiny_model: Callable, paged_runner: type, reference_logits: Callable
) -> None:
    """The model's use of the in-place results: per-head q/k norms on strided views, the residual
    stream carried through every layer's fused norms, rotary on views of the QKV output."""
    config_class, overrides = CUDA_MODELS[case]
    hf_model, model_config = make_tiny_model(
        config_class, num_attention_heads=4, num_key_value_heads=2, **overrides
    )
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(model_config.vocab_size, (n,), generator=generator).tolist() for n in (9, 1, 17)]
    # The runner builds its cache and metadata with factory functions: this makes them CUDA tensors.
    with torch.device(DEVICE):
        model = get_model(model_config, "auto", DEVICE, TorchAttentionBackend)
        runner = paged_runner(model, model_config)
        logits = runner.step(dict(enumerate(prompts)))
        decode_logits = runner.step({i: [3] for i in range(len(prompts))})
    for seq_id, prompt in enumerate(prompts):
        # float32 end to end; the tolerance of tests/models, whose CPU runs match HF to ~1e-6.
        expected = reference_logits(hf_model, prompt)
        torch.testing.assert_close(logits[seq_id].cpu(), expected, atol=1e-4, rtol=0)
        expected = reference_logits(hf_model, [*prompt, 3])[-1:]
        torch.testing.assert_close(decode_logits[seq_id].cpu(), expected, atol=1e-4, rtol=0)
