"""Run on a rank (``collective_rpc``): where the target model's tensor-parallel all-reduces run."""

from __future__ import annotations

from typing import Any


def deferred_reductions(worker: Any) -> dict[str, Any]:
    """Per decoder layer (o_proj reduces, down_proj reduces, input norm sums its input,
    post-attention norm sums its input), and whether the final norm sums its input."""
    model = worker.model_runner.model.model
    return {
        "layers": [
            (
                layer.self_attn.o_proj.reduce_results,
                layer.mlp.down_proj.reduce_results,
                layer.input_layernorm.reduces_input,
                layer.post_attention_layernorm.reduces_input,
            )
            for layer in model.layers
        ],
        "final_norm": model.norm.reduces_input,
    }


def all_deferred(num_layers: int) -> dict[str, Any]:
    """``deferred_reductions``'s answer when every reduction is left to the norm after it."""
    return {
        "layers": [(False, False, i > 0, True) for i in range(num_layers)],
        "final_norm": True,
    }


def none_deferred(num_layers: int) -> dict[str, Any]:
    return {"layers": [(True, True, False, False)] * num_layers, "final_norm": False}
