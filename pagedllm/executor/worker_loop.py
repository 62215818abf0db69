"""The loop a worker process (or Ray actor) runs: read a call, run it on the worker, answer.

Frames travel over one ``multiprocessing.connection.Connection`` per rank (a pipe for "mp", an
authenticated TCP socket for "ray"), each a length-prefixed byte string:

    driver -> worker   pickle((method, args, kwargs, reply_rank))     a call; b"" = shut down
    worker -> driver   pickle((True, result)) | pickle((False, (exception, traceback text)))

``reply_rank`` None means every rank answers (setup calls); an int means only that rank does
(the per-step call: rank 0's sampled tokens). A rank whose call raises answers with the error
whatever ``reply_rank`` says, then leaves the loop: its peers may be waiting in a collective it
never reached, so the driver must stop them all.

The message is pickled once by the driver and written to each rank's connection; it holds plain
Python values (token ids, block tables), never tensors, so nothing is copied off a device.

Answers leave through a thread of their own (``ReplySender``), in call order. A step's answer is
its samples, which exist only once the device has run the step: the thread waits for them while
the loop reads the next step, prepares its inputs and launches it, so the device goes from one
step to the next without waiting for this process's host work (the next step's message is
already waiting: the driver sends it before it reads this one's answer).
"""

from __future__ import annotations

import logging
import pickle
import queue
import threading
import traceback
from multiprocessing.connection import Connection
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.distributed import destroy_distributed_environment
from pagedllm.executor.abstract import call_worker
from pagedllm.worker.model_runner import StepOutput
from pagedllm.worker.worker import Worker

logger = logging.getLogger(__name__)

SHUTDOWN_FRAME = b""
# torch's error in a forked child of a process that had started CUDA.
FORKED_AFTER_CUDA = "Cannot re-initialize CUDA in forked subprocess"


def encode_call(
    method: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None, reply_rank: int | None
) -> bytes:
    return pickle.dumps((method, args, kwargs, reply_rank), protocol=pickle.HIGHEST_PROTOCOL)


def encode_error(error: BaseException) -> bytes:
    """The error and its traceback; an exception that does not pickle travels as its repr."""
    text = "".join(traceback.format_exception(error))
    try:
        return pickle.dumps((False, (error, text)), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:
        return pickle.dumps((False, (RuntimeError(repr(error)), text)), protocol=pickle.HIGHEST_PROTOCOL)


class ReplySender:
    """Sends a rank's answers in the order they are given, from a thread: a ``StepOutput`` is
    waited for (``get()``) there, so the loop does not wait for the device.

    After a failure (an answer that raised while it was waited for) the error is sent in its
    place, nothing more is sent and ``failed`` is set: the loop stops at its next call.
    """

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._queue: queue.SimpleQueue[tuple[bool, Any] | None] = queue.SimpleQueue()
        self.failed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedllm-replies", daemon=True)
        self._thread.start()

    def answer(self, result: Any) -> None:
        self._queue.put((True, result))

    def fail(self, error: BaseException) -> None:
        self._queue.put((False, error))

    def close(self) -> None:
        """Send what is queued, then stop the thread."""
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self.failed.is_set():
                continue
            ok, value = item
            try:
                if ok:
                    result = value.get() if isinstance(value, StepOutput) else value
                    frame = pickle.dumps((True, result), protocol=pickle.HIGHEST_PROTOCOL)
                else:
                    frame = encode_error(value)
            except Exception as e:
                logger.exception("a step failed on the device")
                frame, ok = encode_error(e), False
            try:
                self._conn.send_bytes(frame)
            except OSError:  # the engine is gone; the loop sees it on its next read
                self.failed.set()
            if not ok:
                self.failed.set()


def run_worker_loop(
    conn: Connection, config: EngineConfig, rank: int, local_rank: int, distributed_init_method: str
) -> bool:
    """Serve calls until the driver says stop or goes away. Returns False after a failure."""
    try:
        worker = Worker(config, rank, local_rank, distributed_init_method)
    except Exception as e:
        if FORKED_AFTER_CUDA in str(e):
            e = RuntimeError(
                f"{e}. This rank was forked from a process whose CUDA driver had started (a torch.cuda "
                "call before the engine: torch.cuda.is_available() does so unless "
                "PYTORCH_NVML_BASED_CUDA_CHECK=1, which importing pagedllm first sets). Set "
                "PAGEDLLM_WORKER_MULTIPROC_METHOD=spawn and build the engine under "
                '`if __name__ == "__main__":`'
            )
        conn.send_bytes(encode_error(e))
        return False
    replies = ReplySender(conn)
    try:
        return _serve(conn, worker, rank, replies)
    finally:
        replies.close()


def _serve(conn: Connection, worker: Worker, rank: int, replies: ReplySender) -> bool:
    while True:
        try:
            frame = conn.recv_bytes()
        except (EOFError, OSError):
            logger.info("rank %d: the engine is gone; exiting", rank)
            return True
        if replies.failed.is_set():
            return False
        if frame == SHUTDOWN_FRAME:
            destroy_distributed_environment()
            return True
        method, args, kwargs, reply_rank = pickle.loads(frame)
        try:
            result = call_worker(worker, method, args, kwargs)
        except Exception as e:
            logger.exception("rank %d: %s failed", rank, method)
            replies.fail(e)
            return False
        if reply_rank is None or reply_rank == rank:
            replies.answer(result)
