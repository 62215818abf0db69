"""Tensor and pipeline parallelism on a Ray cluster of two nodes (a head and a second ``ray start
--address`` node, one CPU each, started here): one rank per node, the same greedy tokens as one
rank, a cluster too small refused up front, a dead rank failing the engine fast."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from transformers import LlamaConfig, Qwen3Config

import pagedllm
from pagedllm import LLM, SamplingParams

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))
from test_spec_decode import mixed_prompts
from test_spec_eagle import write_head
from test_spec_tensor_parallel import record_drafts

ray = pytest.importorskip("ray")

STARTUP_TIMEOUT_S = 120
# A throwaway cluster on the loopback interface: no token authentication, no usage reports.
RAY_ENV = {"RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ray_start(*args: str, log: Path, temp_dir: str) -> subprocess.Popen:
    """``ray start --block``: the node's processes live as long as this one (SIGTERM stops them)."""
    env = {
        **os.environ,
        **RAY_ENV,
        # The ranks import pagedllm from this source tree.
        "PYTHONPATH": os.pathsep.join(
            [str(Path(pagedllm.__file__).parents[1]), os.environ.get("PYTHONPATH", "")]
        ),
    }
    command = ["ray", "start", "--block", "--num-cpus=1", "--num-gpus=0", "--object-store-memory=100000000"]
    with open(log, "wb") as out:
        return subprocess.Popen([*command, *args], stdout=out, stderr=subprocess.STDOUT, env=env)


@pytest.fixture(scope="module")
def two_node_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A head node and a worker node with one CPU each; the driver connected to it. Yields the address."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        for name, value in RAY_ENV.items():
            monkeypatch.setenv(name, value)
        yield from _two_node_cluster(tmp_path_factory)


def _two_node_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("ray")
    # Short: Ray's socket paths under it must fit in 107 bytes.
    temp_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    port = _free_port()
    address = f"127.0.0.1:{port}"
    head = _ray_start(
        "--head", f"--port={port}", "--node-ip-address=127.0.0.1", "--include-dashboard=false",
        f"--temp-dir={temp_dir}", log=logs / "head.log", temp_dir=temp_dir,
    )  # fmt: skip
    nodes = [head]
    try:
        _wait_for_port(port, head, logs / "head.log")
        nodes.append(
            _ray_start(
                f"--address={address}",
                "--node-ip-address=127.0.0.1",
                log=logs / "node.log",
                temp_dir=temp_dir,
            )
        )
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        _connect(address, deadline, logs / "head.log")
        while sum(node["Alive"] for node in ray.nodes()) < 2:
            assert time.monotonic() < deadline, (logs / "node.log").read_text()
            time.sleep(0.5)
        yield address
    finally:
        ray.shutdown()
        for node in reversed(nodes):
            node.send_signal(signal.SIGTERM)
            try:
                node.wait(60)
            except subprocess.TimeoutExpired:
                node.kill()


def _connect(address: str, deadline: float, log: Path) -> None:
    """ray.init, retried: the head's GCS answers before its raylet (which the driver joins) is up."""
    while True:
        try:
            ray.init(address=address)
            return
        except (ConnectionError, RuntimeError):
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(1.0)


def _wait_for_port(port: int, process: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        assert process.poll() is None, log.read_text()
        assert time.monotonic() < deadline, log.read_text()
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return
        except OSError:
            time.sleep(0.5)


@pytest.mark.parametrize(
    "config_class, overrides",
    [
        # One KV head, replicated on both ranks; biases on every projection.
        (
            LlamaConfig,
            {"num_attention_heads": 4, "num_key_value_heads": 1, "attention_bias": True, "mlp_bias": True},
        ),
        (Qwen3Config, {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}),
    ],
    ids=["llama-kv1-bias", "qwen3-gqa"],
)
@pytest.mark.slow
def test_one_rank_per_node_gives_the_tokens_of_one_rank(
    two_node_cluster, make_tiny_model_once, random_prompts, assert_every_block_free, config_class, overrides
):
    _, model_config = make_tiny_model_once(config_class, **overrides)
    prompts = random_prompts(5, model_config.vocab_size)
    one = LLM(model_config.model, device="cpu", swap_space=0.01)
    expected = one.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)

    two = LLM(
        model_config.model,
        device="cpu",
        swap_space=0.01,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
    )
    try:
        executor = two.llm_engine.executor
        assert len(set(executor.rank_node_ids)) == 2
        assert executor.rank_node_ids[0] == ray.get_runtime_context().get_node_id()
        outputs = two.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
        assert_every_block_free(two.llm_engine)
    finally:
        two.llm_engine.shutdown()


@pytest.mark.slow
def test_an_eagle3_head_sharded_over_the_nodes_drafts_as_one_rank(
    two_node_cluster, make_tiny_model_once, tmp_path, hf_greedy_tokens
):
    """Speculative decoding with an EAGLE-3 head, sharded over the two nodes' ranks: greedy output
    is HF's, and rank 0's drafts are one rank's step for step."""
    hf_model, model_config = make_tiny_model_once(
        LlamaConfig, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2
    )
    head, *_ = write_head(tmp_path / "head", model_config.hf_config, "eagle3", 97)
    spec = {"method": "eagle3", "model": head, "num_speculative_tokens": 3}
    prompts = mixed_prompts(4, model_config.vocab_size)
    one = LLM(model_config.model, device="cpu", swap_space=0.01, speculative_config=spec)
    one_drafts = record_drafts(one)
    one.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    two = LLM(
        model_config.model,
        device="cpu",
        swap_space=0.01,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
        speculative_config=spec,
    )
    try:
        two_drafts = record_drafts(two)
        outputs = two.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        expected = [hf_greedy_tokens(hf_model, prompt, GREEDY.max_tokens) for prompt in prompts]
        assert [o.outputs[0].token_ids for o in outputs] == expected
        assert two_drafts == one_drafts and any(two_drafts)
    finally:
        two.llm_engine.shutdown()


@pytest.mark.slow
def test_one_pipeline_stage_per_node_gives_the_tokens_of_one_rank(
    two_node_cluster, make_tiny_model_once, random_prompts, assert_every_block_free
):
    """PP=2 over the two nodes: stage 0 on the driver's node, stage 1 (which samples) on the other."""
    _, model_config = make_tiny_model_once(
        LlamaConfig, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=3
    )
    prompts = random_prompts(5, model_config.vocab_size)
    expected = LLM(model_config.model, device="cpu", swap_space=0.01).generate(
        prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False
    )
    two = LLM(
        model_config.model,
        device="cpu",
        swap_space=0.01,
        pipeline_parallel_size=2,
        distributed_executor_backend="ray",
    )
    try:
        assert len(set(two.llm_engine.executor.rank_node_ids)) == 2
        outputs = two.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
        assert_every_block_free(two.llm_engine)
    finally:
        two.llm_engine.shutdown()


def test_a_cluster_with_fewer_devices_than_ranks_is_refused(two_node_cluster, make_tiny_model_once):
    _, model_config = make_tiny_model_once(LlamaConfig, num_attention_heads=4, num_key_value_heads=2)
    start = time.monotonic()
    with pytest.raises(
        ValueError, match=r"tensor_parallel_size=4 needs 4 CPUs in the Ray cluster .* it has 2"
    ):
        LLM(model_config.model, device="cpu", tensor_parallel_size=4, distributed_executor_backend="ray")
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=2 x pipeline_parallel_size=2 needs 4 CPUs in the Ray cluster .* has 2",
    ):
        LLM(
            model_config.model,
            device="cpu",
            tensor_parallel_size=2,
            pipeline_parallel_size=2,
            distributed_executor_backend="ray",
        )
    assert time.monotonic() - start < 10  # no actor was started, no weight read


@pytest.mark.slow
def test_a_killed_rank_fails_the_requests_within_seconds(
    two_node_cluster, make_tiny_model_once, kill_a_rank_mid_batch
):
    _, model_config = make_tiny_model_once(LlamaConfig, num_attention_heads=4, num_key_value_heads=2)
    llm = LLM(
        model_config.model,
        device="cpu",
        swap_space=0.01,
        tensor_parallel_size=2,
        distributed_executor_backend="ray",
    )
    kill_a_rank_mid_batch(llm.llm_engine)
    # The executor killed the other actor and released its reservation: the cluster is whole again.
    deadline = time.monotonic() + 30
    while ray.available_resources().get("CPU", 0) < 2:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.5)
