"""``pagedllm chat``: Ctrl-C cancels a reply and keeps the session, Ctrl-C at the prompt ends it
cleanly, old turns are dropped (with a notice) when the history would not fit, and n > 1 replies
are all printed, labelled."""

from __future__ import annotations

import io
import signal
import subprocess
import sys
import time

import pytest

from pagedllm import EngineArgs, SamplingParams
from pagedllm.engine.llm_engine import LLMEngine
from pagedllm.entrypoints.chat import ChatSession, run_chat
from pagedllm.tokenizer import apply_chat_template

MAX_MODEL_LEN = 192


@pytest.fixture(scope="module")
def engine(tiny_llama_with_tokenizer: str) -> LLMEngine:
    args = EngineArgs(
        model=tiny_llama_with_tokenizer, device="cpu", max_model_len=MAX_MODEL_LEN, swap_space=0.01
    )
    return LLMEngine.from_engine_args(args)


def _session(engine: LLMEngine, **params) -> tuple[ChatSession, io.StringIO, io.StringIO]:
    out, err = io.StringIO(), io.StringIO()
    sampling = SamplingParams(**{"temperature": 0.0, "max_tokens": 8, "ignore_eos": True, **params})
    return ChatSession(engine, sampling, system="Be brief.", out=out, err=err), out, err


def _all_blocks_free(engine: LLMEngine) -> bool:
    return engine.scheduler.kv_cache_manager.get_num_free_gpu_blocks() == engine.num_gpu_blocks


def test_ctrl_c_during_a_reply_cancels_it_and_keeps_the_session(engine, monkeypatch):
    session, _, err = _session(engine)
    first = session.ask("Hello")
    assert first is not None and len(session.turns) == 2
    step = engine.step
    calls = []

    def interrupted_step():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    monkeypatch.setattr(engine, "step", interrupted_step)
    assert session.ask("Tell me a long story") is None
    monkeypatch.undo()
    assert "(reply cancelled;" in err.getvalue()
    # The cancelled turn is gone, its request aborted and its blocks free; the session goes on.
    assert len(session.turns) == 2 and not engine.has_unfinished_requests() and _all_blocks_free(engine)
    assert session.ask("Hello again") is not None and len(session.turns) == 4


def test_old_turns_are_dropped_with_a_notice_when_the_history_would_not_fit(engine):
    session, _, err = _session(engine)
    long_message = "one two three four five six seven eight nine ten " * 3
    for _ in range(8):
        assert session.ask(long_message) is not None
        prompt = apply_chat_template(engine.tokenizer, [*session.system, *session.turns])
        assert len(prompt) <= MAX_MODEL_LEN
    assert "oldest turn(s): the history would not fit max_model_len 192" in err.getvalue()
    assert 2 <= len(session.turns) < 16 and session.turns[0]["role"] == "user"
    # A message that cannot fit even alone is not sent, and the history stays.
    turns = list(session.turns)
    assert session.ask("word " * 400) is None
    assert "over max_model_len 192; not sent" in err.getvalue() and session.turns == turns


def test_every_reply_of_n_is_printed_and_labelled(engine):
    session, out, _ = _session(engine, n=2, temperature=1.0, seed=0)
    reply = session.ask("Pick a colour")
    text = out.getvalue()
    assert "[reply 1 of 2]\n" in text and "[reply 2 of 2]\n" in text
    assert session.turns[-1] == {"role": "assistant", "content": reply}


def test_ctrl_c_or_ctrl_d_at_the_prompt_ends_the_chat(engine):
    for error in (KeyboardInterrupt, EOFError):
        session, _, err = _session(engine)

        def read(prompt: str, error=error) -> str:
            raise error

        run_chat(session, read)  # returns, raising nothing
        assert err.getvalue().startswith("Chat with the model")


@pytest.mark.slow
def test_the_chat_command_exits_cleanly_on_ctrl_c_at_the_prompt(tiny_llama_with_tokenizer: str):
    command = [sys.executable, "-m", "pagedllm", "chat", "--model", tiny_llama_with_tokenizer]
    command += ["--max-model-len", str(MAX_MODEL_LEN), "--max-tokens", "4", "--swap-space", "0.01"]
    process = subprocess.Popen(
        command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    assert process.stdin is not None and process.stdout is not None
    process.stdin.write("Hello\n")
    process.stdin.flush()
    reply = process.stdout.readline()  # "> " prompt, then the streamed reply and its newline
    assert reply.startswith("> ")
    time.sleep(0.5)  # back at the prompt, waiting for the next line
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 0, stderr[-2000:]
    assert "Traceback" not in stderr
