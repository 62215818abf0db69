"""Speculative decoding's configuration (vLLM's ``speculative_config``), a base module: the core's
drafting policy (core/spec_decode.py), the worker's drafters and ``EngineArgs`` read it."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from pagedllm.config_checks import is_int, require

logger = logging.getLogger(__name__)

SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
# The methods whose drafts come from a model the worker loads from ``model``.
MODEL_METHODS = ("draft_model", "eagle", "eagle3", "mtp")
# The methods whose ``model`` defaults to the target's checkpoint (which holds the drafter).
_TARGET_CHECKPOINT_METHODS = ("mtp",)
# Methods vLLM names that pagedllm does not run yet: refused by name rather than as unknown.
_SPECULATIVE_METHODS_NOT_YET = ("medusa", "mlp_speculator")
# Drafted tokens per request and step, at most: each is one more query row to verify and one more
# [vocab] row of target probabilities; past ~8 an n-gram draft is almost never accepted whole.
MAX_NUM_SPECULATIVE_TOKENS = 16
# n-gram drafting on a GPU stops at this many running requests unless ``disable_by_batch_size`` is
# given: at W1's shape (Qwen3-0.6B, contexts of 100-1,280 tokens, k = 3, acceptance 0.5; one H200)
# drafts gave 1.24x output tok/s at one request, 0.91x at 2, 0.82x at 4 and 0.61x at 64, where a
# verify step of 64 requests took 2.1x a decode step. A model drafter's cost differs (not measured
# past one request): none is set for it.
NGRAM_CUDA_DISABLE_BY_BATCH_SIZE = 2
_SPECULATIVE_KEYS = (
    "method",
    "num_speculative_tokens",
    "prompt_lookup_max",
    "prompt_lookup_min",
    "model",
    "disable_by_batch_size",
    "synthetic_acceptance_rate",
)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vLLM's ``speculative_config`` keys): each step a request's next
    ``num_speculative_tokens`` tokens are drafted cheaply and verified by one forward pass of the
    target model over all of them (docs/spec_decode.md).

    ``method="ngram"`` (prompt lookup, no model): the draft continues the latest earlier match of
    the request's last ``prompt_lookup_max`` .. ``prompt_lookup_min`` tokens. ``method="draft_model"``:
    ``model`` (a path) is a smaller model with the target's vocabulary that drafts greedily, run by
    the worker beside the target (worker/draft_model.py). ``method="eagle3"`` / ``"eagle"``:
    ``model`` is an EAGLE head (worker/eagle.py) drafting from the target's hidden states. The
    model's config (``EngineConfig.draft_model_config``) is read by ``EngineArgs`` once the
    target's is known. ``model`` "ngram" or "[ngram]" is vLLM's
    older spelling of the n-gram method. ``method="mtp"``: the multi-token-prediction layer the target's
    own checkpoint stores (DeepSeek-V3, GLM-4.5; models/mtp.py) drafts like an EAGLE head;
    ``model`` defaults to the target's. ``disable_by_batch_size``: no drafts in a
    step with at least this many running requests (verification then costs more than it saves);
    ``with_device_defaults`` gives n-gram on a GPU a measured one when the user set none.
    ``synthetic_acceptance_rate`` is for benchmarks only: each drafted token is accepted with this
    probability whatever the model says, so outputs are NOT the model's (``pagedllm bench latency``
    labels every figure "synthetic").
    """

    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_max: int = 5
    prompt_lookup_min: int = 1
    disable_by_batch_size: int | None = None
    synthetic_acceptance_rate: float | None = None
    model: str | None = None

    def __post_init__(self) -> None:
        method = self.method
        if method in _SPECULATIVE_METHODS_NOT_YET:
            raise ValueError(
                f"speculative_config.method {method!r} is not supported yet; supported: {SPECULATIVE_METHODS}"
            )
        require(
            method in SPECULATIVE_METHODS,
            "speculative_config.method",
            f"one of {SPECULATIVE_METHODS}",
            method,
        )
        k = self.num_speculative_tokens
        require(
            is_int(k) and 1 <= k <= MAX_NUM_SPECULATIVE_TOKENS,
            "speculative_config.num_speculative_tokens",
            f"an int in [1, {MAX_NUM_SPECULATIVE_TOKENS}]",
            k,
        )
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        require(is_int(lo) and lo >= 1, "speculative_config.prompt_lookup_min", "an int >= 1", lo)
        require(
            is_int(hi) and hi >= lo,
            "speculative_config.prompt_lookup_max",
            f"an int >= prompt_lookup_min ({lo})",
            hi,
        )
        n = self.disable_by_batch_size
        require(
            n is None or (is_int(n) and n >= 1),
            "speculative_config.disable_by_batch_size",
            "None or >= 1",
            n,
        )
        rate = self.synthetic_acceptance_rate
        require(
            rate is None or (isinstance(rate, (int, float)) and 0.0 <= rate <= 1.0),
            "speculative_config.synthetic_acceptance_rate",
            "None or in [0, 1]",
            rate,
        )
        require(
            (method in MODEL_METHODS) == (self.model is not None) or method in _TARGET_CHECKPOINT_METHODS,
            "speculative_config.model",
            f"a model path with a method in {MODEL_METHODS} (and only then; optional with "
            f"{_TARGET_CHECKPOINT_METHODS}: the target's)",
            self.model,
        )

    def with_device_defaults(self, device_type: str, given: Iterable[str]) -> SpeculativeConfig:
        """This config with the defaults measured for ``device_type`` ("cuda", "cpu") filled in
        where the user's keys (``given``) leave them open."""
        if device_type == "cuda" and self.method == "ngram" and "disable_by_batch_size" not in given:
            logger.info(
                "speculative_config: n-gram drafts only while fewer than %d requests run (measured on "
                "a GPU); set disable_by_batch_size to change it (null: at every batch size)",
                NGRAM_CUDA_DISABLE_BY_BATCH_SIZE,
            )
            return dataclasses.replace(self, disable_by_batch_size=NGRAM_CUDA_DISABLE_BY_BATCH_SIZE)
        return self

    @classmethod
    def from_dict(cls, config: dict[str, Any]) -> SpeculativeConfig:
        """From vLLM's keys. Unknown keys are refused by name; a missing ``method`` is taken from
        ``model`` ("ngram"); a ``prompt_lookup_min`` above the default maximum raises the maximum to it."""
        if not isinstance(config, dict):
            raise ValueError(f"speculative_config must be a dict (or its JSON), got {config!r}")
        unknown = sorted(set(config) - set(_SPECULATIVE_KEYS))
        if unknown:
            raise ValueError(
                f"speculative_config has unknown keys {unknown}; known: {list(_SPECULATIVE_KEYS)}"
            )
        values = dict(config)
        model = values.pop("model", None)
        if model is not None and str(model).strip("[]") != "ngram":
            # A model path: vLLM's draft model (its older configs give the path without a method).
            values.setdefault("method", "draft_model")
            values["model"] = model
        elif "method" not in values:
            if model is None:
                raise ValueError(f"speculative_config.method is required: one of {SPECULATIVE_METHODS}")
            values["method"] = "ngram"
        lo = values.get("prompt_lookup_min")
        if values.get("prompt_lookup_max") is None and isinstance(lo, int) and lo > cls.prompt_lookup_max:
            values["prompt_lookup_max"] = lo
        return cls(**{key: value for key, value in values.items() if value is not None})
