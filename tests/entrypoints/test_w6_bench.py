"""W6 without a GPU: its floor (hybrid_floor.py) against benchmarks/README.md's derivation, and the
long-context comparison: ``bench throughput``'s ``--input-len`` / ``--output-len`` overrides, the
all-attention twin of W6's config, and the summary row ``scripts/gpu_check.sh w6-long`` prints."""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os

import pytest
import torch
from transformers import AutoConfig

from pagedllm.attention.backends.torch_backend import TorchAttentionBackend
from pagedllm.entrypoints.bench import throughput
from pagedllm.entrypoints.bench.hybrid_floor import HybridShape, hybrid_floor
from pagedllm.entrypoints.bench.workloads import CONFIG_DIR
from pagedllm.models import get_model_class

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _args(*argv: str) -> argparse.Namespace:
    return throughput.add_cli_args(argparse.ArgumentParser()).parse_args(["--workload", "W6", *argv])


def test_input_and_output_len_override_the_workload() -> None:
    workload = throughput.workload_for(_args("--input-len", "32768", "--output-len", "64"))
    prompts = workload.prompts(16)
    assert len(prompts) == 16 and {len(p) for p in prompts} == {32768}
    assert workload.output_len == 64 and workload.max_model_len == 32768 + 64
    default = throughput.workload_for(_args())
    assert default.output_len == 256 and default.input_len == (100, 1024)


def test_prefix_len_gives_every_prompt_the_same_start() -> None:
    workload = throughput.workload_for(_args("--prefix-len", "300"))
    prompts, plain = workload.prompts(4), throughput.workload_for(_args()).prompts(4)
    assert all(p[:300] == prompts[0][:300] for p in prompts)
    assert [p[300:] for p in prompts] == plain  # each prompt's own tokens unchanged
    assert workload.max_model_len == 300 + 1024 + 256


@pytest.mark.parametrize(
    ("flag", "value"), [("--input-len", "0"), ("--output-len", "1"), ("--prefix-len", "-1")]
)
def test_lengths_the_run_cannot_use_are_refused_by_name(flag: str, value: str) -> None:
    with pytest.raises(ValueError, match=flag):
        throughput.workload_for(_args(flag, value))


def _meta_model(name: str):
    config = AutoConfig.from_pretrained(os.path.join(CONFIG_DIR, name))
    model_class = get_model_class(config.architectures, config.model_type)
    with torch.device("meta"):
        model = model_class(config, TorchAttentionBackend)
    return config, model_class, sum(p.numel() for p in model.parameters())


def test_the_all_attention_twin_is_w6_with_every_layer_attention() -> None:
    config, model_class, params = _meta_model("qwen3-next-2b")
    twin_config, _, twin_params = _meta_model("qwen3-next-2b-attention")
    assert model_class.num_attention_layers(twin_config) == twin_config.num_hidden_layers == 24
    assert model_class.state_shapes(twin_config, 1) == []
    different = {k for k in config.to_dict() if config.to_dict()[k] != twin_config.to_dict().get(k)}
    assert different - {"_name_or_path"} == {"layer_types"}
    assert abs(twin_params / params - 1) < 0.05  # "a same-size dense model": 2.56B against 2.68B


def load_gpu_summary():
    """scripts/gpu_summary.py as a module (a script, not in a package)."""
    spec = importlib.util.spec_from_file_location(
        "gpu_summary", os.path.join(REPO, "scripts", "gpu_summary.py")
    )
    summary = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summary)
    return summary


def test_summary_prints_the_decode_steps_ratio(tmp_path) -> None:
    for name, step in (("qwen3-next-2b", 3.0), ("qwen3-next-2b-attention", 12.0)):
        (tmp_path / f"w6_long_{name}.json").write_text(json.dumps({"median_decode_step_ms": step}))
    summary = load_gpu_summary()
    assert summary._long_context_rows(str(tmp_path)) == [
        ("W6 32k decode step / all-attention", "ms (target <= 0.5x)", "3.00 / 12.00 ms = 0.25x")
    ]


def test_summary_prints_the_shared_prefix_rows(tmp_path) -> None:
    runs = {"hybrid": (6.0, 9.0), "twin_enable": (2.0, 5.0), "twin_no-enable": (8.0, 11.0)}
    for name, (prefill, elapsed) in runs.items():
        result = {"prefill_s": prefill, "elapsed_s": elapsed}
        (tmp_path / f"w6_prefix_{name}.json").write_text(json.dumps(result))
    summary = load_gpu_summary()
    assert summary._prefix_rows(str(tmp_path)) == [
        ("W6 shared prefix: hybrid, caching off", "prefill s (elapsed s)", "6.00 (9.00)"),
        ("W6 shared prefix: twin, caching on", "prefill s (elapsed s)", "2.00 (5.00)"),
        ("W6 shared prefix: twin, caching off", "prefill s (elapsed s)", "8.00 (11.00)"),
        ("W6 shared prefix: caching's saving", "of the twin's prefill", "75%"),
    ]


def test_w6_floor_is_benchmarks_readme_derivation() -> None:
    """The bench's floor for W6 against benchmarks/README.md's figures (H200: 4.25 TB/s copy,
    811 TFLOP/s): 1.21 TB of decode weights, 0.55 TB of KV, 2.58 TB of state, 0.42 PFLOP."""
    workload = throughput.WORKLOADS["W6"]
    shape = HybridShape.from_config(AutoConfig.from_pretrained(workload.model))
    # 24 sparse layers of 16 experts of gate, up and down (2,048 x 512).
    assert shape.routed_expert_params == 24 * 16 * 3 * 2048 * 512
    prompt_lens = [len(p) for p in workload.prompts()]
    floor = hybrid_floor(shape, prompt_lens, workload.output_len, 256, 2, 4.25e12, 811e12)
    assert floor["decode_weight_tb"] == pytest.approx(1.21, abs=0.005)
    assert floor["kv_tb"] == pytest.approx(0.55, abs=0.005)
    assert floor["state_tb"] == pytest.approx(2.58, abs=0.005)
    assert floor["prefill_tflop"] == pytest.approx(420, abs=5)
    assert floor["floor_s"] == pytest.approx(1.54, abs=0.01)


def test_floor_without_experts_and_the_touched_experts() -> None:
    """A Mamba-2 hybrid with no experts reads every dense weight each step; with experts, a batch
    of one token touches k of E, a large batch all of them."""
    shape = HybridShape.from_config(AutoConfig.from_pretrained(os.path.join(CONFIG_DIR, "nemotron-h-8b")))
    assert shape.routed_expert_params == 0 and shape.touched_expert_fraction(256) == 0.0
    assert shape.active_params_per_token == shape.dense_params - shape.lm_head_params
    floor = hybrid_floor(shape, [1000] * 4, 5, 4, 2, 1e12, 1e15)
    assert floor["decode_weight_tb"] == pytest.approx(4 * shape.dense_params * 2 / 1e12)
    w6 = HybridShape.from_config(AutoConfig.from_pretrained(throughput.WORKLOADS["W6"].model))
    assert w6.touched_expert_fraction(1) == pytest.approx(8 / 16)
    assert w6.touched_expert_fraction(256) == pytest.approx(1.0)


def test_a_cached_prefix_counts_once_in_the_floor() -> None:
    """With prefix caching on, every request but the first skips the shared prefix's products and
    the causal pairs among its tokens: the floor's prefill loses exactly those FLOPs; its decode
    (weights, KV, state) is unchanged."""
    workload = dataclasses.replace(throughput.WORKLOADS["W6"], prefix_len=2048)
    shape = HybridShape.from_config(AutoConfig.from_pretrained(workload.model))
    prompt_lens = [len(p) for p in workload.prompts()]
    n, c = len(prompt_lens), 2048
    args = (shape, prompt_lens, workload.output_len, 256, 2, 4.25e12, 811e12)
    full, cached = hybrid_floor(*args), hybrid_floor(*args, cached_prefix_len=c)
    pairs_per_layer = shape.attention_flops_per_pair * shape.num_attention_layers
    skipped = (n - 1) * (2 * shape.active_params_per_token * c + pairs_per_layer * c * (c + 1) // 2)
    assert full["prefill_tflop"] - cached["prefill_tflop"] == pytest.approx(skipped / 1e12, rel=1e-9)
    assert cached["prefill_tflop"] < 0.3 * full["prefill_tflop"]
    for part in ("decode_weight_tb", "kv_tb", "state_tb"):
        assert cached[part] == full[part]
