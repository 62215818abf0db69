"""The embedded SmolLM2-135M-Instruct end to end on the CPU (dequantized to float32 where it is
compared with HF; the CLI runs the defaults)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedllm import LLM, SamplingParams
from pagedllm.tokenizer import apply_chat_template

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "What is 12 times 7?",
    "Name two renewable energy sources.",
    "Translate 'good morning' to Spanish.",
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(device="cpu", max_model_len=512, dtype="float32")  # compared with HF in float32


@pytest.mark.slow
def test_greedy_chat_equals_hf_generate(llm, smollm2_hf_model):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    outputs = llm.chat([[{"role": "user", "content": p}] for p in PROMPTS], params, use_tqdm=False)
    tokenizer = llm.get_tokenizer()
    eos = tokenizer.eos_token_id
    for prompt, output in zip(PROMPTS, outputs):
        prompt_ids = apply_chat_template(tokenizer, [{"role": "user", "content": prompt}])
        assert output.prompt_token_ids == prompt_ids
        input_ids = torch.tensor([prompt_ids])
        expected = smollm2_hf_model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
        )[0, len(prompt_ids) :].tolist()
        completion = output.outputs[0]
        # HF keeps the EOS token; so do we (it ends the text, which omits it).
        assert completion.token_ids == expected
        assert completion.text == tokenizer.decode(expected, skip_special_tokens=True)
        assert completion.finish_reason == ("stop" if expected[-1] == eos else "length")
    assert "Paris" in outputs[0].outputs[0].text


def test_stop_strings_cut_the_text(llm):
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
    free = llm.chat([{"role": "user", "content": PROMPTS[0]}], params, use_tqdm=False)[0].outputs[0]
    assert "Paris" in free.text
    stopped = llm.chat(
        [{"role": "user", "content": PROMPTS[0]}],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=["Paris"]),
        use_tqdm=False,
    )[0].outputs[0]
    assert stopped.text == free.text[: free.text.index("Paris")]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == "Paris"


def test_text_prompts_are_tokenized_with_special_tokens(llm):
    out = llm.generate(
        "The capital of France is", SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False
    )
    tokenizer = llm.get_tokenizer()
    assert out[0].prompt_token_ids == tokenizer("The capital of France is")["input_ids"]
    assert out[0].prompt == "The capital of France is"
    assert out[0].outputs[0].text.strip()


def run_cli(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagedllm", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


@pytest.mark.slow
def test_cli_generate_and_chat(tmp_path: Path):
    result = run_cli("generate", "--chat", "--temperature", "0", "--max-tokens", "16", PROMPTS[0])
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout

    prompts_file = tmp_path / "prompts.json"
    prompts_file.write_text(json.dumps(PROMPTS[:2]))
    result = run_cli(
        "generate", "--prompts-file", str(prompts_file), "--max-tokens", "4", "--sampling-seed", "3"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.count("=== ") == 2

    result = run_cli("chat", "--temperature", "0", "--max-tokens", "16", stdin=PROMPTS[0] + "\n\n")
    assert result.returncode == 0, result.stderr
    assert "Paris" in result.stdout


# Slow (~9 s): CLI processes on the embedded model.
@pytest.mark.slow
def test_cli_reports_bad_input_without_a_traceback(tmp_path: Path):
    result = run_cli("generate", "--model", str(tmp_path / "nowhere"), "hi")
    assert result.returncode != 0
    assert "not a local directory" in result.stderr and "Traceback" not in result.stderr
    result = run_cli("generate", "--top-p", "1.5", "hi")
    assert result.returncode != 0 and "top_p must be in (0, 1]" in result.stderr


@pytest.mark.slow
def test_attention_sinks_keep_a_long_text_that_a_window_alone_loses():
    """StreamingLLM's finding (Xiao et al. 2023) on the embedded model: with a 64-token window the
    perplexity of a 572-token public-domain text explodes once its first tokens leave the window,
    and keeping four of them (re-positioned) brings it back near full attention."""
    sys.path.insert(0, str(Path(__file__).parents[2] / "benchmarks"))
    from streaming_perplexity import perplexity

    full, num_tokens = perplexity("float32")
    alone, _ = perplexity("float32", sliding_window=64)
    sinks, _ = perplexity("float32", sliding_window=64, attention_sinks=4)
    assert num_tokens > 8 * 64
    assert alone > 5 * full  # 13.6x measured
    assert sinks < 1.3 * full  # 1.16x measured
