"""The offline API: ``LLM(...).generate(prompts, params)``, ``.chat(messages)``,
``.beam_search(prompts, BeamSearchParams(...))``, and for pooling models ``.embed(prompts)`` and
``.score(text_1, text_2)``."""

from __future__ import annotations

import collections
import itertools
import logging
import operator
import threading
import time
from collections.abc import Sequence as SequenceABC
from typing import Any, TypeVar

from tqdm.auto import tqdm

from pagedllm.beam_search import BeamSearchOutput, BeamSearchSequence
from pagedllm.engine.arg_utils import EngineArgs
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.score_utils import cosine_similarity, pair_inputs
from pagedllm.entrypoints.utils import engine_summary
from pagedllm.lora.request import LoRARequest
from pagedllm.outputs import (
    EmbeddingRequestOutput,
    PoolingRequestOutput,
    RequestOutput,
    ScoringOutput,
    ScoringRequestOutput,
)
from pagedllm.pooling_params import PoolingParams
from pagedllm.sampling_params import BeamSearchParams, SamplingParams
from pagedllm.tokenizer import Tokenizer, apply_chat_template

logger = logging.getLogger(__name__)

# A prompt: text, or a dict with "prompt" (text) or "prompt_token_ids" (vLLM's TextPrompt /
# TokensPrompt).
PromptType = str | dict[str, Any]
ChatMessages = list[dict[str, Any]]
P = TypeVar("P", SamplingParams, PoolingParams)


class LLM:
    """An engine for offline generation. Arguments are EngineArgs' (vLLM's names).

    Example::

        llm = LLM()  # the embedded SmolLM2-135M-Instruct
        out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=32))
        print(out[0].outputs[0].text)
    """

    def __init__(self, model: str | None = None, **kwargs: Any) -> None:
        start = time.perf_counter()
        engine = self.llm_engine = LLMEngine.from_engine_args(EngineArgs(model=model, **kwargs))
        # At INFO: the CLI shows it; a script sees it once it configures logging (a library
        # prints nothing unasked).
        logger.info("%s", engine_summary(engine.config, engine.num_gpu_blocks, time.perf_counter() - start))
        self._request_counter = itertools.count()
        # The engine is stepped by the thread in generate(); abort() may come from any thread.
        # The lock is held across each step; an abort that finds it taken is queued and applied by
        # the stepping thread before its next step: it takes effect between steps, never inside
        # the scheduler's or the engine's bookkeeping, and the aborting thread never waits.
        self._engine_lock = threading.Lock()
        # Request ids to abort, or None for every request (deque appends are atomic).
        self._pending_aborts: collections.deque[list[str] | None] = collections.deque()
        # Final outputs of requests of the generate() in progress that abort() ended: generate()
        # returns them in their place ("abort", with the tokens they had).
        self._generating: set[str] = set()
        self._aborted: dict[str, RequestOutput] = {}

    def get_tokenizer(self) -> Tokenizer | None:
        return self.llm_engine.tokenizer

    def start_profile(self, torch_profiler: bool = True) -> None:
        """Profile what the engine runs from here, on every rank (vLLM's name; the traces are
        kept where ``$PAGEDLLM_TORCH_PROFILER_DIR`` says). ``torch_profiler=False``: only each
        step's start and end, which cost the host nothing it would notice."""
        with self._engine_lock:
            self.llm_engine.start_profile(torch_profiler)

    def stop_profile(self) -> list[dict[str, Any]]:
        """End the profile; each rank's summary: its device's busy time against the span of its
        events, the idle gaps, the busiest operations (pagedllm/worker/profiler.py)."""
        with self._engine_lock:
            return self.llm_engine.stop_profile()

    def abort(self, request_id: str | SequenceABC[str]) -> None:
        """End requests (their ``RequestOutput.request_id``) and free their blocks. Safe from
        another thread while ``generate`` runs: it returns at once and takes effect before the next
        step, and ``generate`` returns each aborted request's output so far (finish reason
        "abort") in its place."""
        self._queue_abort([request_id] if isinstance(request_id, str) else list(request_id))

    def abort_all(self) -> None:
        """End every unfinished request, e.g. after a ``generate`` interrupted from outside."""
        self._queue_abort(None)

    def _queue_abort(self, request_ids: list[str] | None) -> None:
        self._pending_aborts.append(request_ids)
        if self._engine_lock.acquire(blocking=False):  # no step in progress: apply it now
            try:
                self._apply_aborts()
            finally:
                self._engine_lock.release()

    def _apply_aborts(self) -> None:
        """Apply the queued aborts (the engine lock held), keeping the outputs generate() returns."""
        engine = self.llm_engine
        while self._pending_aborts:
            request_ids = self._pending_aborts.popleft()
            outputs = engine.abort_request(list(engine.requests) if request_ids is None else request_ids)
            self._aborted.update((o.request_id, o) for o in outputs if o.request_id in self._generating)

    def generate(
        self,
        prompts: PromptType | SequenceABC[PromptType] | None = None,
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        prompt_token_ids: list[int] | list[list[int]] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt; outputs come back in prompt order.

        A request that makes the model step fail (it fails again when it runs alone) comes back
        finished with ``RequestOutput.error`` set (``failed``; its sequences end with
        finish_reason "error", keeping their tokens so far); the other requests are unaffected,
        even those that shared its steps. When the engine gives up (its workers are gone, the
        device reported a fault, or steps fail whatever runs in them), this raises
        ExecutorDeadError, and none of its requests stays queued; the LLM is unusable after.

        Args:
            prompts: a prompt or a list of them (strings, or dicts with "prompt" or
                "prompt_token_ids").
            sampling_params: one for all prompts, or one per prompt.
            prompt_token_ids: token ids instead of (or, one for one, alongside) ``prompts``.
            use_tqdm: show a progress bar with requests done and output tokens per second.
            lora_request: the LoRA adapter for all prompts, or one (or None) per prompt
                (needs ``enable_lora=True``).
        """
        requests = _normalize_prompts(prompts, prompt_token_ids)
        params = _per_prompt(sampling_params, SamplingParams, len(requests), "sampling_params")
        return self._run(requests, params, use_tqdm, _per_prompt_lora(lora_request, len(requests)))

    def chat(
        self,
        messages: ChatMessages | list[ChatMessages],
        sampling_params: SamplingParams | SequenceABC[SamplingParams] | None = None,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate a reply to one conversation or to each of a list of them, through the
        model's chat template (vLLM's arguments; ``lora_request`` as in ``generate``).

        Args:
            chat_template: a Jinja template to use instead of the tokenizer's.
            add_generation_prompt: end the prompt with the template's assistant header.
            continue_final_message: leave the last (assistant) message open, so the reply
                continues it; needs ``add_generation_prompt=False``.
            tools: OpenAI-style tool definitions, rendered by templates that take ``tools``.
            chat_template_kwargs: more variables for the template (e.g. ``enable_thinking``).
        """
        tokenizer = self.get_tokenizer()
        if tokenizer is None:
            raise ValueError("chat needs a tokenizer, and this engine has none")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message needs add_generation_prompt=False")
        kwargs = dict(chat_template_kwargs or {})
        kwargs["continue_final_message"] = continue_final_message
        if chat_template is not None:
            kwargs["chat_template"] = chat_template
        if tools is not None:
            kwargs["tools"] = tools
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        requests = [
            {
                "prompt_token_ids": apply_chat_template(
                    tokenizer, conversation, add_generation_prompt, **kwargs
                )
            }
            for conversation in conversations
        ]
        params = _per_prompt(sampling_params, SamplingParams, len(requests), "sampling_params")
        return self._run(requests, params, use_tqdm, _per_prompt_lora(lora_request, len(requests)))

    def beam_search(
        self,
        prompts: PromptType | SequenceABC[PromptType],
        params: BeamSearchParams,
        use_tqdm: bool = False,
    ) -> list[BeamSearchOutput]:
        """The ``params.beam_width`` best beams of each prompt (vLLM's ``LLM.beam_search``), run
        by the engine's beam search (scores as Hugging Face ``generate(num_beams=...)``)."""
        outputs = self.generate(prompts, params.to_sampling_params(), use_tqdm=use_tqdm)
        tokenizer = self.get_tokenizer()
        results = []
        for output in outputs:
            sequences = []
            for completion in output.outputs:
                tokens = [*output.prompt_token_ids, *completion.token_ids]
                sequences.append(
                    BeamSearchSequence(
                        tokens=tokens,
                        logprobs=list(completion.logprobs or []),
                        cum_logprob=completion.cumulative_logprob or 0.0,
                        text=None if tokenizer is None else tokenizer.decode(tokens),
                        finish_reason=completion.finish_reason,
                        stop_reason=completion.stop_reason,
                    )
                )
            results.append(BeamSearchOutput(sequences=sequences))
        return results

    def embed(
        self,
        prompts: PromptType | SequenceABC[PromptType] | None = None,
        pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None,
        *,
        prompt_token_ids: list[int] | list[list[int]] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
    ) -> list[EmbeddingRequestOutput]:
        """The embedding of each prompt, in prompt order (a pooling model: ``runner="pooling"``).

        ``pooling_params``: one for all prompts, or one per prompt; ``dimensions`` truncates
        (Matryoshka models only), ``normalize`` overrides the model's pooler config. Prompts
        longer than max_model_len raise ValueError before anything is queued.
        """
        outputs = self.encode(
            prompts,
            pooling_params,
            prompt_token_ids=prompt_token_ids,
            use_tqdm=use_tqdm,
            lora_request=lora_request,
        )
        return [EmbeddingRequestOutput.from_base(output) for output in outputs]

    def encode(
        self,
        prompts: PromptType | SequenceABC[PromptType] | None = None,
        pooling_params: PoolingParams | SequenceABC[PoolingParams] | None = None,
        *,
        prompt_token_ids: list[int] | list[list[int]] | None = None,
        use_tqdm: bool = True,
        lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None = None,
    ) -> list[PoolingRequestOutput]:
        """Each prompt's pooled vector as a PoolingRequestOutput (``outputs.data``, a tensor);
        ``embed`` returns the same as lists of floats. Arguments as ``embed``'s."""
        if self.llm_engine.config.pooler_config is None:
            raise ValueError(
                "LLM.embed and LLM.encode need a pooling model: this LLM runs with runner='generate' "
                "(create it with runner='pooling')"
            )
        requests = _normalize_prompts(prompts, prompt_token_ids)
        params = _per_prompt(pooling_params, PoolingParams, len(requests), "pooling_params")
        return self._run(requests, params, use_tqdm, _per_prompt_lora(lora_request, len(requests)))

    def score(
        self,
        data_1: str | SequenceABC[str],
        data_2: str | SequenceABC[str],
        /,
        *,
        use_tqdm: bool = True,
        pooling_params: PoolingParams | None = None,
        lora_request: LoRARequest | None = None,
    ) -> list[ScoringRequestOutput]:
        """The similarity of text pairs with an embedding model: the cosine of their embeddings
        (vLLM's score for embedding models). One ``data_1`` is paired with each ``data_2`` (1 -> N),
        else the two lists one for one (N -> N)."""
        pairs = pair_inputs(data_1, data_2, str, ("data_1", "data_2"))
        embeddings = self.embed(
            [text for pair in pairs for text in pair],
            pooling_params,
            use_tqdm=use_tqdm,
            lora_request=lora_request,
        )
        outputs = []
        for first, second in zip(embeddings[::2], embeddings[1::2]):
            score = cosine_similarity(first.outputs.embedding, second.outputs.embedding)
            outputs.append(
                ScoringRequestOutput(
                    f"{first.request_id}_{second.request_id}",
                    ScoringOutput(score),
                    first.prompt_token_ids + second.prompt_token_ids,
                    True,
                )
            )
        return outputs

    def _run(
        self,
        requests: list[dict[str, Any]],
        params: list[SamplingParams] | list[PoolingParams],
        use_tqdm: bool,
        lora_requests: list[LoRARequest | None],
    ) -> list[RequestOutput]:
        self._check_prompt_lengths(requests, params)
        engine = self.llm_engine
        request_ids: list[str] = []
        try:
            for index, (request, request_params, lora) in enumerate(zip(requests, params, lora_requests)):
                request_id = str(next(self._request_counter))
                try:
                    with self._engine_lock:
                        pooling = isinstance(request_params, PoolingParams)
                        engine.add_request(
                            request_id,
                            prompt=request.get("prompt"),
                            sampling_params=None if pooling else request_params,
                            prompt_token_ids=request.get("prompt_token_ids"),
                            stream=False,
                            lora_request=lora,
                            pooling_params=request_params if pooling else None,
                        )
                        self._generating.add(request_id)
                except ValueError as e:
                    raise ValueError(f"prompt {index}: {e}") from e
                request_ids.append(request_id)
        except BaseException:
            # Nothing of a refused or interrupted (Ctrl-C) batch stays queued.
            self._end_call(request_ids, abort=True)
            raise
        return self._run_engine(request_ids, use_tqdm)

    def _check_prompt_lengths(self, requests: list[dict[str, Any]], params: list[SamplingParams]) -> None:
        """ValueError for a prompt longer than max_model_len, before anything is queued (as
        vLLM); text prompts are tokenized here, once, and go to the engine as token ids."""
        max_model_len = self.llm_engine.config.model_config.max_model_len
        tokenizer = self.get_tokenizer()
        for index, (request, request_params) in enumerate(zip(requests, params)):
            prompt = request.get("prompt")
            if request.get("prompt_token_ids") is None and isinstance(prompt, str) and tokenizer is not None:
                request["prompt_token_ids"] = tokenizer(prompt)["input_ids"]
            token_ids = request.get("prompt_token_ids")
            if token_ids is None:
                continue  # the engine's add_request says what is missing
            num_tokens = len(token_ids)
            # Not yet a checked SamplingParams: the engine names a wrong type.
            truncate = getattr(request_params, "truncate_prompt_tokens", None)
            if isinstance(truncate, int) and truncate >= 1:
                num_tokens = min(num_tokens, truncate)
            if num_tokens > max_model_len:
                raise ValueError(
                    f"prompt {index} has {num_tokens} tokens, more than max_model_len={max_model_len}"
                )

    def _end_call(self, request_ids: list[str], abort: bool) -> None:
        """Forget a generate() call's requests; with ``abort``, end those still live."""
        with self._engine_lock:
            if abort:
                self.llm_engine.abort_request(request_ids)
            self._generating.difference_update(request_ids)
            for request_id in request_ids:
                self._aborted.pop(request_id, None)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        progress = tqdm(total=len(request_ids), desc="Processed prompts", unit="req", disable=not use_tqdm)
        try:
            self._step_until_done(finished, progress)
        except BaseException:
            # Interrupted (Ctrl-C, an engine error): none of this call's requests stays queued.
            self._end_call([r for r in request_ids if r not in finished], abort=True)
            raise
        finally:
            progress.close()
        with self._engine_lock:
            self._apply_aborts()
            finished.update((r, self._aborted[r]) for r in request_ids if r in self._aborted)
        self._end_call(request_ids, abort=False)
        lost = [r for r in request_ids if r not in finished]
        if lost:
            raise RuntimeError(
                f"requests {lost} were ended outside LLM.abort (the engine's abort_request): use "
                "LLM.abort, which returns their outputs here"
            )
        return [finished[request_id] for request_id in request_ids]

    def _step_until_done(self, finished: dict[str, RequestOutput], progress: tqdm) -> None:
        engine = self.llm_engine
        start = time.perf_counter()
        num_output_tokens = 0
        while True:
            with self._engine_lock:
                self._apply_aborts()
                if not engine.has_unfinished_requests():
                    break
                outputs = engine.step()
            for output in outputs:
                if not output.finished:
                    continue
                finished[output.request_id] = output
                progress.update(1)
                if not isinstance(output, RequestOutput):
                    continue  # a pooling model's: no tokens out
                num_output_tokens += sum(len(o.token_ids) for o in output.outputs)
                if output.error and not output.failed:  # the engine logs the failed ones
                    logger.warning("request %s failed: %s", output.request_id, output.error)
                progress.set_postfix_str(
                    f"output {num_output_tokens / (time.perf_counter() - start):.1f} tok/s"
                )


def _normalize_prompts(
    prompts: PromptType | SequenceABC[PromptType] | None, prompt_token_ids: list[int] | list[list[int]] | None
) -> list[dict[str, Any]]:
    if isinstance(prompts, (str, dict)):
        prompts = [prompts]
    if prompts is not None and not isinstance(prompts, SequenceABC):
        raise ValueError(f"prompts must be a string, a dict or a list of them, got {type(prompts).__name__}")
    if prompt_token_ids is not None:
        if len(prompt_token_ids) == 0:
            raise ValueError("prompt_token_ids is empty: give at least one token")
        if _is_token_id(prompt_token_ids[0]):
            prompt_token_ids = [prompt_token_ids]
    if prompts is None and prompt_token_ids is None:
        raise ValueError("give prompts or prompt_token_ids")
    if prompts is not None and prompt_token_ids is not None and len(prompts) != len(prompt_token_ids):
        raise ValueError(
            f"prompts ({len(prompts)}) and prompt_token_ids ({len(prompt_token_ids)}) "
            "must have the same length"
        )
    num_prompts = len(prompts) if prompts is not None else len(prompt_token_ids)
    requests = []
    for i in range(num_prompts):
        prompt = prompts[i] if prompts is not None else None
        request = dict(prompt) if isinstance(prompt, dict) else {"prompt": prompt}
        if prompt_token_ids is not None:
            request["prompt_token_ids"] = prompt_token_ids[i]
        requests.append(request)
    return requests


def _is_token_id(value: object) -> bool:
    # Python, numpy and torch integers (a 0-d tensor too), but not a list of them.
    try:
        operator.index(value)
    except TypeError:
        return False
    return not isinstance(value, bool)


def _per_prompt(params: Any, kind: type[P], num_prompts: int, name: str) -> list[P]:
    """One ``kind`` (default-made when None) for all prompts, or the list of one per prompt."""
    if params is None:
        return [kind()] * num_prompts
    if isinstance(params, kind):
        return [params] * num_prompts
    if len(params) != num_prompts:
        raise ValueError(
            f"{name} has {len(params)} entries for {num_prompts} prompts: give one, or one per prompt"
        )
    return list(params)


def _per_prompt_lora(
    lora_request: LoRARequest | SequenceABC[LoRARequest | None] | None, num_prompts: int
) -> list[LoRARequest | None]:
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * num_prompts
    if isinstance(lora_request, str) or not isinstance(lora_request, SequenceABC):
        raise ValueError(
            f"lora_request must be a LoRARequest or a list of them, got {type(lora_request).__name__}"
        )
    if len(lora_request) != num_prompts:
        raise ValueError(
            f"lora_request has {len(lora_request)} entries for {num_prompts} prompts: "
            "give one, or one per prompt"
        )
    return list(lora_request)
