"""Multi-head latent attention on CUDA: the Triton MLA decode kernel at DeepSeek's shapes against a
float32 torch reference of the absorbed form, captured in a CUDA graph and replayed with new
lengths; and a DeepSeek-V2-Lite-shaped tiny random model's greedy tokens on the Triton backend
(CUDA graphs on and off) equal to HF's and to the torch backend's.

Every cache slot no sequence owns holds NaN, so a kernel reading one fails loudly.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable

import pytest
import torch

if not torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1":
    pytest.skip("needs CUDA and compiled (not interpreted) Triton kernels", allow_module_level=True)
pytest.importorskip("triton", reason="the MLA decode kernel needs the triton package")

from transformers import DeepseekV2Config

from pagedllm import LLM, SamplingParams
from pagedllm.kernels.triton.mla_decode import mla_decode

pytestmark = pytest.mark.gpu

DEVICE = torch.device("cuda")
RANK, ROPE, BLOCK = 512, 64, 16
TOLERANCES = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}
# Below a partition, across partitions (1,024 tokens unsplit; >= 256 when split), a block edge.
SEQ_LENS = [1, 15, 16, 17, 255, 256, 257, 1000, 1024, 1025, 3000, 4097, 8000]


def _step(seq_lens: list[int], num_heads: int, dtype: torch.dtype, max_blocks: int) -> dict:
    gen = torch.Generator(device=DEVICE).manual_seed(len(seq_lens) + num_heads)
    pages = [-(-n // BLOCK) for n in seq_lens]
    num_blocks = sum(pages) + 16
    order = torch.randperm(num_blocks, generator=gen, device=DEVICE)
    cache = torch.full((num_blocks, BLOCK, RANK + ROPE), float("nan"), device=DEVICE, dtype=dtype)
    block_tables = torch.zeros(len(seq_lens), max_blocks, dtype=torch.int32, device=DEVICE)
    contexts, first = [], 0
    for i, (seq_len, n) in enumerate(zip(seq_lens, pages)):
        blocks = order[first : first + n]
        first += n
        block_tables[i, :n] = blocks.to(torch.int32)
        context = torch.randn(seq_len, RANK + ROPE, generator=gen, device=DEVICE).to(dtype)
        slots = (blocks[:, None] * BLOCK + torch.arange(BLOCK, device=DEVICE)).flatten()[:seq_len]
        cache.view(-1, RANK + ROPE)[slots] = context
        contexts.append(context)
    num_seqs = len(seq_lens)
    return {
        "q_latent": torch.randn(num_seqs, num_heads, RANK, generator=gen, device=DEVICE).to(dtype),
        "q_pe": torch.randn(num_seqs, num_heads, ROPE, generator=gen, device=DEVICE).to(dtype),
        "cache": cache,
        "block_tables": block_tables,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        "contexts": contexts,
    }


def _reference(step: dict, scale: float) -> torch.Tensor:
    """The absorbed form in float32, a sequence at a time over its gathered latents."""
    outputs = []
    for i, context in enumerate(step["contexts"]):
        query = torch.cat((step["q_latent"][i], step["q_pe"][i]), dim=-1).float()
        probs = torch.softmax(query @ context.float().T * scale, dim=-1)
        outputs.append(probs @ context[:, :RANK].float())
    return torch.stack(outputs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("num_heads", [16, 128, 20])  # V2-Lite, V3, not a multiple of the block
def test_kernel_matches_the_absorbed_form(dtype: torch.dtype, num_heads: int) -> None:
    step = _step(SEQ_LENS, num_heads, dtype, max_blocks=512)
    scale = 192**-0.5
    out = torch.empty_like(step["q_latent"])
    args = (step["q_latent"], step["q_pe"], step["cache"], step["block_tables"], step["seq_lens"])
    mla_decode(*args, scale, max(SEQ_LENS), out, min_seq_len=min(SEQ_LENS))
    rtol, atol = TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), _reference(step, scale), rtol=rtol, atol=atol)


def test_kernel_replays_from_a_cuda_graph_with_new_lengths() -> None:
    """Captured with max_seq_len pinned (as the engine's decode graphs, at max_model_len), replayed
    after the lengths, tables and latents change in place."""
    max_model_len = 8192
    max_blocks = max_model_len // BLOCK
    first = _step([5, 300, 2000, 40], 16, torch.bfloat16, max_blocks)
    second = _step([1000, 1, 8000, 4097], 16, torch.bfloat16, max_blocks)
    out = torch.empty_like(first["q_latent"])
    names = ("q_latent", "q_pe", "cache", "block_tables", "seq_lens")
    # One cache big enough for both steps: the second's blocks copied over the first's.
    cache = torch.full((max(s["cache"].shape[0] for s in (first, second)), BLOCK, RANK + ROPE), float("nan"))
    static = {name: first[name].clone() for name in names}
    static["cache"] = cache.to(DEVICE, torch.bfloat16)
    static["cache"][: first["cache"].shape[0]] = first["cache"]
    call = lambda: mla_decode(*(static[n] for n in names), 0.1, max_model_len, out)  # noqa: E731
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for step in (first, second):
        static["cache"].fill_(float("nan"))
        static["cache"][: step["cache"].shape[0]] = step["cache"]
        for name in ("q_latent", "q_pe", "block_tables", "seq_lens"):
            static[name].copy_(step[name])
        graph.replay()
        torch.testing.assert_close(out.float(), _reference(step, 0.1), rtol=2e-2, atol=2e-2)


# DeepSeek-V2-Lite's attention (16 heads, latent 512 + 64, nope 128, v 128, YaRN with its mscale)
# and its MoE's layout (a dense first layer, shared experts, greedy top-k), narrow and two layers.
V2_LITE_TINY = {
    "vocab_size": 512,
    "hidden_size": 256,
    "intermediate_size": 256,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "kv_lora_rank": RANK,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": ROPE,
    "v_head_dim": 128,
    "n_routed_experts": 8,
    "n_shared_experts": 2,
    "num_experts_per_tok": 2,
    "first_k_dense_replace": 1,
    "topk_method": "greedy",
    "max_position_embeddings": 1024,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 256,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "beta_fast": 32,
        "beta_slow": 1,
    },
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
MAX_TOKENS = 8


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_v2_lite_shaped_greedy_equals_hf_and_the_torch_backend(
    greedy_reference: Callable, enforce_eager: bool
) -> None:
    model, prompts, expected = greedy_reference(DeepseekV2Config, V2_LITE_TINY, MAX_TOKENS, "cpu", 0)
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    tokens = {}
    for backend in ("triton", "torch"):
        llm = LLM(
            model,
            device="cuda",
            dtype="float32",
            attention_backend=backend,
            enforce_eager=enforce_eager or backend == "torch",
            max_model_len=512,
            enable_prefix_caching=True,
            gpu_memory_utilization=0.3,  # the previous engine's cache may not be returned yet
        )
        outputs = llm.generate(prompt_token_ids=prompts, sampling_params=greedy, use_tqdm=False)
        tokens[backend] = [o.outputs[0].token_ids for o in outputs]
        llm.llm_engine.shutdown()
        del llm, outputs
        gc.collect()
        torch.cuda.empty_cache()
    assert tokens["triton"] == expected
    assert tokens["torch"] == expected
