"""The engine on a GPU: HF-exact greedy output in float32, bf16 close to HF, CUDA graphs equal to
eager execution, memory profiling, swapping through pinned memory, and start-up errors."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from transformers import LlamaConfig, Qwen3Config

from pagedllm import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def prompts_for(vocab_size: int, n: int, seed: int, lo: int = 2, hi: int = 60) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab_size) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def hf_greedy(hf_model, prompts: list[list[int]], max_tokens: int, device: str = "cuda") -> list[list[int]]:
    hf_model = hf_model.to(device)
    hf_model.generation_config.eos_token_id = None
    outputs = []
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        out = hf_model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        outputs.append(out[0, len(prompt) :].tolist())
    return outputs


@pytest.fixture
def tiny_gpu_model(make_tiny_model):
    # Head size 64: a size the Triton and CUDA kernels support.
    return make_tiny_model(LlamaConfig, num_attention_heads=4, num_key_value_heads=2, head_dim=64)


@pytest.mark.parametrize("enforce_eager", [True, False])
def test_float32_greedy_equals_hf_on_the_gpu(tiny_gpu_model, enforce_eager):
    hf_model, model_config = tiny_gpu_model
    prompts = prompts_for(model_config.vocab_size, 6, seed=0)
    llm = LLM(
        model_config.model, device="cuda", dtype="float32", enforce_eager=enforce_eager, num_kv_blocks=256
    )
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == hf_greedy(hf_model, prompts, GREEDY.max_tokens)


def test_bf16_is_close_to_hf(make_tiny_model):
    hf_model, model_config = make_tiny_model(
        Qwen3Config, num_attention_heads=4, num_key_value_heads=2, head_dim=64
    )
    prompts = prompts_for(model_config.vocab_size, 4, seed=1, lo=20, hi=40)
    llm = LLM(model_config.model, device="cuda", dtype="bfloat16")
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outputs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    hf_model = hf_model.to("cuda", torch.float32)
    for prompt, output in zip(prompts, outputs):
        with torch.no_grad():
            reference = torch.log_softmax(hf_model(torch.tensor([prompt], device="cuda")).logits[0], dim=-1)
        ours = torch.tensor(
            [entry[prompt[i]].logprob for i, entry in enumerate(output.prompt_logprobs) if entry]
        )
        theirs = torch.tensor([reference[i - 1, prompt[i]].item() for i in range(1, len(prompt))])
        # bf16 weights and activations against the float32 reference: a few hundredths of a nat.
        assert (ours - theirs).abs().mean() < 0.05
        assert output.outputs[0].token_ids[0] == int(reference[-1].argmax())


def test_cuda_graphs_change_no_token(tiny_gpu_model):
    _, model_config = tiny_gpu_model
    prompts = prompts_for(model_config.vocab_size, 20, seed=2)
    params = [
        GREEDY,
        SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.8, top_p=0.9, seed=8, max_tokens=16, ignore_eos=True),
    ] * 7
    outputs = {}
    for enforce_eager in (True, False):
        llm = LLM(model_config.model, device="cuda", dtype="float32", enforce_eager=enforce_eager)
        runner = llm.llm_engine.executor.worker.model_runner
        assert (runner.graph_runner is None) == enforce_eager
        got = llm.generate(prompt_token_ids=prompts, sampling_params=params[: len(prompts)], use_tqdm=False)
        outputs[enforce_eager] = [[c.token_ids for c in o.outputs] for o in got]
        del llm, runner
        gc.collect()
        torch.cuda.empty_cache()
    assert outputs[True] == outputs[False]


def test_swap_and_recompute_preemption_on_the_gpu(tiny_gpu_model):
    _, model_config = tiny_gpu_model
    prompts = prompts_for(model_config.vocab_size, 10, seed=3, lo=20, hi=40)
    params = [
        GREEDY if i % 2 else SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=16, ignore_eos=True)
        for i in range(10)
    ]
    roomy = LLM(model_config.model, device="cuda", dtype="float32", block_size=8, num_kv_blocks=512)
    expected = roomy.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    tight = LLM(
        model_config.model, device="cuda", dtype="float32", block_size=8, num_kv_blocks=24, max_model_len=128
    )
    got = tight.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    stats = tight.llm_engine.get_stats()
    assert stats.num_preemptions_swap > 0 and stats.num_preemptions_recompute > 0
    assert [[c.token_ids for c in o.outputs] for o in got] == [
        [c.token_ids for c in o.outputs] for o in expected
    ]
    assert (
        stats.num_free_gpu_blocks == stats.num_gpu_blocks
        and stats.num_free_cpu_blocks == stats.num_cpu_blocks
    )


def test_prefix_caching_and_chunked_prefill_on_the_gpu(tiny_gpu_model):
    hf_model, model_config = tiny_gpu_model
    rng = random.Random(4)
    prefix = [rng.randrange(3, model_config.vocab_size) for _ in range(100)]
    prompts = [prefix + [rng.randrange(3, model_config.vocab_size) for _ in range(k)] for k in (5, 17, 30)]
    llm = LLM(
        model_config.model,
        device="cuda",
        dtype="float32",
        enable_prefix_caching=True,
        enable_chunked_prefill=True,
        max_num_batched_tokens=32,
        max_num_seqs=8,
    )
    first = llm.generate(prompt_token_ids=prompts[:1], sampling_params=GREEDY, use_tqdm=False)
    rest = llm.generate(prompt_token_ids=prompts[1:], sampling_params=GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in first + rest] == hf_greedy(hf_model, prompts, GREEDY.max_tokens)
    assert llm.llm_engine.get_stats().prefix_cache_hit_rate > 0.5


def test_the_cache_is_sized_by_profiling(tiny_gpu_model):
    _, model_config = tiny_gpu_model
    num_blocks = {}
    for utilization in (0.3, 0.6):
        llm = LLM(model_config.model, device="cuda", gpu_memory_utilization=utilization)
        num_blocks[utilization] = llm.llm_engine.num_gpu_blocks
        block_bytes = llm.llm_engine.executor.worker.kv_cache_spec.block_bytes
        del llm
        gc.collect()
        torch.cuda.empty_cache()
    assert 0 < num_blocks[0.3] < num_blocks[0.6]
    # Doubling the share adds about 0.3 of the device, all of it cache.
    added = (num_blocks[0.6] - num_blocks[0.3]) * block_bytes
    assert abs(added - 0.3 * torch.cuda.mem_get_info()[1]) < 0.05 * torch.cuda.mem_get_info()[1]


def test_start_up_errors(tiny_gpu_model, tmp_path):
    _, model_config = tiny_gpu_model
    with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
        LLM(model_config.model, device="cuda", gpu_memory_utilization=0.0)
    free, total = torch.cuda.mem_get_info()
    tiny_share = 0.5 * (total - free) / total if total > free else 1e-4
    with pytest.raises(ValueError, match=r"no GPU memory left for the KV cache|weights need"):
        LLM(model_config.model, device="cuda", gpu_memory_utilization=max(tiny_share, 1e-4))
    huge = LlamaConfig(
        hidden_size=16384, intermediate_size=65536, num_hidden_layers=64, num_attention_heads=128,
        num_key_value_heads=8, vocab_size=32000, architectures=["LlamaForCausalLM"],
    )  # fmt: skip
    huge.save_pretrained(tmp_path / "huge")
    with pytest.raises(ValueError, match="weights need"):
        LLM(str(tmp_path / "huge"), device="cuda", load_format="dummy")
    with pytest.raises(ValueError, match="fewer than one sequence of max_model_len"):
        LLM(model_config.model, device="cuda", num_kv_blocks=2, block_size=8, max_model_len=256)


def test_the_engine_process_serves_hf_greedy_tokens_on_the_gpu(tiny_gpu_model):
    """``pagedllm serve``'s engine process (spawned, with CUDA initialised in this one already)
    runs the model on the GPU and its outputs cross back whole."""
    import asyncio

    from pagedllm import EngineArgs
    from pagedllm.engine.async_engine import AsyncLLMEngine

    hf_model, model_config = tiny_gpu_model
    prompts = prompts_for(model_config.vocab_size, 6, seed=3)
    args = EngineArgs(model=model_config.model, device="cuda", dtype="float32", num_kv_blocks=256)

    async def serve() -> list[list[int]]:
        engine = AsyncLLMEngine.in_engine_process(args)
        engine.start()
        try:

            async def one(i: int) -> list[int]:
                async for output in engine.generate(
                    str(i), prompt_token_ids=prompts[i], sampling_params=GREEDY
                ):
                    last = output
                return last.outputs[0].token_ids

            return list(await asyncio.gather(*(one(i) for i in range(len(prompts)))))
        finally:
            await engine.shutdown()

    torch.zeros(1, device="cuda")  # CUDA initialised here: the engine process must still start
    assert asyncio.run(asyncio.wait_for(serve(), 300)) == hf_greedy(hf_model, prompts, GREEDY.max_tokens)
