"""pagedllm: LLM inference and serving with PagedAttention and continuous batching."""

from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.llm import LLM
from pagedllm.outputs import CompletionOutput, RequestOutput
from pagedllm.sampling_params import SamplingParams

__version__ = "0.1.0"

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]
