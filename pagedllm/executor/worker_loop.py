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
"""

from __future__ import annotations

import logging
import pickle
import traceback
from multiprocessing.connection import Connection
from typing import Any

from pagedllm.config import EngineConfig
from pagedllm.distributed import destroy_distributed_environment
from pagedllm.executor.abstract import call_worker
from pagedllm.worker.worker import Worker

logger = logging.getLogger(__name__)

SHUTDOWN_FRAME = b""


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


def run_worker_loop(
    conn: Connection, config: EngineConfig, rank: int, local_rank: int, distributed_init_method: str
) -> bool:
    """Serve calls until the driver says stop or goes away. Returns False after a failure."""
    try:
        worker = Worker(config, rank, local_rank, distributed_init_method)
    except Exception as e:
        conn.send_bytes(encode_error(e))
        return False
    while True:
        try:
            frame = conn.recv_bytes()
        except (EOFError, OSError):
            logger.info("rank %d: the engine is gone; exiting", rank)
            return True
        if frame == SHUTDOWN_FRAME:
            destroy_distributed_environment()
            return True
        method, args, kwargs, reply_rank = pickle.loads(frame)
        try:
            result = call_worker(worker, method, args, kwargs)
        except Exception as e:
            logger.exception("rank %d: %s failed", rank, method)
            conn.send_bytes(encode_error(e))
            return False
        if reply_rank is None or reply_rank == rank:
            conn.send_bytes(pickle.dumps((True, result), protocol=pickle.HIGHEST_PROTOCOL))
