"""The grammar bitmask applied on the GPU equals the CPU's, and a constrained request on the GPU
engine yields JSON of its schema."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from pagedllm.engine.arg_utils import EMBEDDED_MODEL_PACKAGE
from pagedllm.structured_output import allocate_token_bitmask, apply_token_bitmask

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("vocab_size", [33, 32000, 49152, 151936])
def test_bitmask_on_the_gpu_equals_the_cpu(vocab_size):
    generator = torch.Generator().manual_seed(vocab_size)
    bitmask = allocate_token_bitmask(8, vocab_size)
    bitmask.copy_(
        torch.randint(-(2**31), 2**31, bitmask.shape, generator=generator, dtype=torch.int64).to(torch.int32)
    )
    logits = torch.randn((8, vocab_size), generator=generator)
    on_gpu = logits.cuda()
    apply_token_bitmask(logits, bitmask)
    apply_token_bitmask(on_gpu, bitmask)
    assert torch.equal(on_gpu.cpu(), logits)


def _smollm2() -> dict:
    """The embedded model; where its package is missing (the GPU image), its config and tokenizer
    saved under .models/smollm2-135m (see scripts/gpu_check.sh) with random weights: the grammar
    keeps the output inside the schema whatever the weights."""
    if importlib.util.find_spec(EMBEDDED_MODEL_PACKAGE) is not None:
        return {}
    exported = Path(__file__).resolve().parents[2] / ".models" / "smollm2-135m"
    if not exported.is_dir():
        pytest.skip(f"neither {EMBEDDED_MODEL_PACKAGE} nor {exported} is here")
    return {"model": str(exported), "load_format": "dummy"}


def test_json_schema_request_on_the_gpu_engine():
    from pagedllm import LLM, SamplingParams
    from pagedllm.sampling_params import StructuredOutputsParams

    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    llm = LLM(**_smollm2(), device="cuda", max_model_len=512)
    params = SamplingParams(
        n=2, temperature=1.0, seed=0, max_tokens=20, structured_outputs=StructuredOutputsParams(json=schema)
    )
    [output] = llm.chat(
        [{"role": "user", "content": "Is water wet? Answer in JSON."}], params, use_tqdm=False
    )
    for completion in output.outputs:
        assert isinstance(json.loads(completion.text)["ok"], bool)
