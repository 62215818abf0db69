"""The mp executor forks its ranks where that is safe, as vLLM does, so that a user's quick script
(``LLM(..., tensor_parallel_size=2)`` at top level, no ``__main__`` guard) works; where fork is
unsafe it spawns, with one line saying what the script needs."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from pagedllm import LLM, SamplingParams
from pagedllm.executor import multiproc_executor, worker_loop
from pagedllm.executor.multiproc_executor import START_METHOD_ENV, choose_start_method

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = ["The capital of France is", "One, two, three,"]
ROOT = str(Path(__file__).resolve().parents[2])


@pytest.mark.slow
def test_a_script_without_a_main_guard_runs_at_two_ranks(
    tiny_llama_with_tokenizer: str, tmp_path, monkeypatch
):
    script = tmp_path / "quick.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import json
            from pagedllm import LLM, SamplingParams

            llm = LLM({tiny_llama_with_tokenizer!r}, device="cpu", swap_space=0.01, tensor_parallel_size=2)
            params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
            outputs = llm.generate({PROMPTS!r}, params, use_tqdm=False)
            print(json.dumps([output.outputs[0].token_ids for output in outputs]))
            """
        )
    )
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    # The script imports the package under test, installed or not.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")])))
    result = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "spawning the tensor-parallel ranks" not in result.stderr
    one = LLM(tiny_llama_with_tokenizer, device="cpu", swap_space=0.01)
    expected = [output.outputs[0].token_ids for output in one.generate(PROMPTS, GREEDY, use_tqdm=False)]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == expected


def test_cuda_initialised_spawns_and_says_what_a_script_needs(monkeypatch, caplog):
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(multiproc_executor.torch.cuda, "is_initialized", lambda: True)
    with caplog.at_level(logging.WARNING, logger="pagedllm"):
        assert choose_start_method() == "spawn"
    [message] = [record.getMessage() for record in caplog.records]
    assert "CUDA is initialised in this process, so fork is unsafe" in message
    assert 'build the engine under `if __name__ == "__main__":`' in message


def test_fork_is_chosen_on_linux_without_cuda(monkeypatch):
    monkeypatch.delenv(START_METHOD_ENV, raising=False)
    monkeypatch.setattr(sys, "platform", "linux")
    monkeypatch.setattr(multiproc_executor.torch.cuda, "is_initialized", lambda: False)
    assert choose_start_method() == "fork"


def test_the_environment_names_the_start_method(monkeypatch):
    monkeypatch.setenv(START_METHOD_ENV, "spawn")
    assert choose_start_method() == "spawn"
    monkeypatch.setenv(START_METHOD_ENV, "vfork")
    with pytest.raises(ValueError, match=f"{START_METHOD_ENV}='vfork': expected one of fork, spawn"):
        choose_start_method()


def test_choosing_the_ranks_devices_leaves_cuda_uninitialised(monkeypatch):
    """``torch.cuda.is_available()`` initializes the CUDA driver, after which a forked rank cannot
    use CUDA ("Cannot re-initialize CUDA in forked subprocess") although ``is_initialized()``
    still says False: the engine's process counts GPUs through NVML (``device_count``) before it
    forks its ranks."""
    import torch

    from pagedllm.config import resolve_device
    from pagedllm.parallel_config import ParallelConfig

    def poisons_fork() -> bool:
        raise AssertionError("torch.cuda.is_available() was called before the ranks were forked")

    monkeypatch.setattr(torch.cuda, "is_available", poisons_fork)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    for sizes in ({"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        parallel_config = ParallelConfig(distributed_executor_backend="mp", **sizes)
        assert resolve_device("auto", parallel_config).type == "cuda"
        assert resolve_device("cuda", parallel_config).type == "cuda"


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (ValueError("this rank's device is unusable"), "this rank's device is unusable"),
        # torch's, in a rank forked after CUDA started: the engine says what to do.
        (RuntimeError(worker_loop.FORKED_AFTER_CUDA), "PAGEDLLM_WORKER_MULTIPROC_METHOD=spawn"),
    ],
)
def test_a_rank_that_fails_to_start_names_its_error(
    tiny_llama_with_tokenizer: str, monkeypatch, error: Exception, expected: str
):
    """A rank whose worker cannot be built sends its error and exits before the engine's first
    call: the engine's error is the rank's, not a broken pipe."""
    from pagedllm.executor.multiproc_executor import MultiprocExecutor

    def failing_worker(*args, **kwargs):
        raise error

    start_workers = MultiprocExecutor._init_workers

    def start_and_wait_for_the_exits(self):
        start_workers(self)
        for process in self.ranks.processes:  # the first call then finds every pipe closed
            process.join(30)

    monkeypatch.setenv(START_METHOD_ENV, "fork")  # the ranks inherit the failing worker
    monkeypatch.setattr(worker_loop, "Worker", failing_worker)
    monkeypatch.setattr(MultiprocExecutor, "_init_workers", start_and_wait_for_the_exits)
    with pytest.raises(Exception, match=expected):
        LLM(tiny_llama_with_tokenizer, device="cpu", swap_space=0.01, tensor_parallel_size=2)


def test_importing_the_package_keeps_cuda_availability_checks_fork_safe():
    """torch.cuda.is_available() through NVML, not the driver: a script may check for a GPU before
    it builds an engine whose ranks are forked."""
    code = "import pagedllm, os; print(os.environ.get('PYTORCH_NVML_BASED_CUDA_CHECK'))"
    env = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, env.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert result.stdout.strip() == "1", result.stderr
