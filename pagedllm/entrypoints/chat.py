"""``pagedllm chat``: an interactive conversation that forgives.

Ctrl-C while a reply streams cancels that reply (the request is aborted, the turn dropped from
the history) and the session goes on; Ctrl-C or Ctrl-D at the prompt ends it without a
traceback. When the history would not leave room for a reply within ``max_model_len``, the
oldest turns are dropped, with a notice. With ``n`` > 1 every reply is printed, labelled; the
first is the one the conversation keeps.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Callable
from typing import TextIO

from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.sampling_params import SamplingParams
from pagedllm.tokenizer import apply_chat_template

Message = dict[str, str]


class ChatSession:
    """A conversation with ``engine``: ``ask(text)`` streams a reply to ``out`` and returns it.

    Args:
        engine: an engine with a tokenizer that has a chat template; nothing else runs on it.
        params: every reply's sampling parameters.
        system: a system message kept at the head of the history (never dropped).
        out: where replies go; notices go to ``err``.
    """

    def __init__(
        self,
        engine: LLMEngine,
        params: SamplingParams,
        system: str | None = None,
        out: TextIO = sys.stdout,
        err: TextIO = sys.stderr,
    ) -> None:
        if engine.tokenizer is None:
            raise ValueError("pagedllm chat: this model has no tokenizer")
        self.engine = engine
        self.params = params
        self.system: list[Message] = [{"role": "system", "content": system}] if system else []
        # The conversation after the system message: user and assistant turns, alternating.
        self.turns: list[Message] = []
        self.out, self.err = out, err
        self._request_ids = (f"chat-{i}" for i in itertools.count())
        max_model_len = engine.config.model_config.max_model_len
        # Room kept for a reply when old turns are dropped: max_tokens, up to half the context.
        self.reply_room = min(params.max_tokens or max_model_len, max_model_len // 2)

    def ask(self, text: str) -> str | None:
        """Answer ``text``; None when it was cancelled (Ctrl-C) or cannot fit, and then the history
        is as it was before."""
        token_ids = self._fit([*self.turns, {"role": "user", "content": text}])
        if token_ids is None:
            return None
        request_id = next(self._request_ids)
        # Several replies are printed at the end: no need to detokenize them every step.
        stream = self.params.n == 1
        self.engine.add_request(
            request_id, sampling_params=self.params, prompt_token_ids=token_ids, stream=stream
        )
        try:
            replies = self._stream()
        except KeyboardInterrupt:
            self.engine.abort_request(request_id)
            print("\n(reply cancelled; Ctrl-C at the prompt, or Ctrl-D, ends the chat)", file=self.err)
            return None
        if replies is None:
            return None
        self.turns += [{"role": "user", "content": text}, {"role": "assistant", "content": replies[0]}]
        return replies[0]

    def _fit(self, turns: list[Message]) -> list[int] | None:
        """The prompt's token ids, dropping the oldest user/assistant pairs (with a notice) until
        a reply has room within max_model_len; None, with a notice, when even the new message alone
        does not fit."""
        max_model_len = self.engine.config.model_config.max_model_len
        num_dropped = 0
        while True:
            token_ids = apply_chat_template(self.engine.tokenizer, [*self.system, *turns])
            if len(token_ids) + self.reply_room <= max_model_len or len(turns) == 1:
                break
            turns = turns[2:]
            num_dropped += 1
        if len(token_ids) >= max_model_len:
            print(
                f"(this message is {len(token_ids)} tokens with the chat template, over max_model_len "
                f"{max_model_len}; not sent)",
                file=self.err,
            )
            return None
        if num_dropped:
            self.turns = self.turns[2 * num_dropped :]
            print(
                f"(dropped the {num_dropped} oldest turn(s): the history would not fit max_model_len "
                f"{max_model_len} with room for a reply)",
                file=self.err,
            )
        return token_ids

    def _stream(self) -> list[str] | None:
        """Step the engine until the request finishes; returns its replies (None, with a notice,
        when it failed). One reply streams as it comes; several (n > 1) are printed at the end,
        each labelled."""
        n = self.params.n
        texts = [""] * n
        while self.engine.has_unfinished_requests():
            for output in self.engine.step():
                if output.error:
                    print(f"\n(error: {output.error})", file=self.err)
                    return None
                if n == 1:
                    new_text = output.outputs[0].text
                    self._write(new_text[len(texts[0]) :])
                    texts[0] = new_text
                elif output.finished:
                    texts = [completion.text for completion in output.outputs]
        if n == 1:
            self._write("\n")
        else:
            for i, text in enumerate(texts, 1):
                self._write(f"[reply {i} of {n}]\n{text.strip()}\n")
        return [text.strip() for text in texts]

    def _write(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()


def run_chat(session: ChatSession, read: Callable[[str], str] = input) -> None:
    """Read messages with ``read`` until an empty line, Ctrl-D or Ctrl-C at the prompt."""
    print("Chat with the model; an empty line, Ctrl-D or Ctrl-C ends.", file=session.err)
    while True:
        try:
            text = read("> ")
        except (EOFError, KeyboardInterrupt):
            print(file=session.err)
            return
        if not text.strip():
            return
        session.ask(text)
