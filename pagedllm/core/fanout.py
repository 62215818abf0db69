"""Fan-out: the sequences a user's request forks into, and the ones beam search lets go.

A request with ``best_of`` > 1 draws its ``best_of`` first tokens from the prompt in one step (one
row each). When they arrive it keeps the first and forks a sibling for each other
(``fork_first_samples``). Beam search forks a beam that several of its chosen continuations
extend and frees one that none extends (``apply_beam_step``); its kept hypotheses are finished
copies that hold no blocks (``new_hypothesis``). The engine's beam driver decides; this module
does.

A fork shares its parent's blocks (copy-on-write: ``KVCacheManager.fork``), joins its group and
runs at once. This module alone makes forks; the scheduler hands it what a fork needs (a fresh
id, a seat among the running requests) and the way to end a beam, so it holds no queue itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from pagedllm.core.kv_cache_manager import KVCacheManager
from pagedllm.core.request import PendingHypothesis, Request, RequestStatus


class FanOut:
    """Forks and frees a group's sequences.

    Args:
        kv_cache_manager: shares a parent's blocks with its forks.
        new_req_id: a fresh sequence id.
        add_running: makes a fork a running request of the scheduler.
        finish_requests: ends sequences wherever they are and frees their blocks.
    """

    def __init__(
        self,
        kv_cache_manager: KVCacheManager,
        new_req_id: Callable[[], int],
        add_running: Callable[[Request], None],
        finish_requests: Callable[[Iterable[Request], RequestStatus], None],
    ) -> None:
        self.kv_cache_manager = kv_cache_manager
        self.new_req_id = new_req_id
        self.add_running = add_running
        self.finish_requests = finish_requests

    def fork_first_samples(self, request: Request) -> list[Request]:
        """A best_of request's first sample arrived (``num_samples`` rows): it takes the first row
        and a fork takes each other. Returns the sequences in row order, the request first."""
        num_samples = request.num_samples
        request.num_samples = 1  # before the forks copy it
        samplers = [request]
        for index in range(1, num_samples):
            child = self._fork(request)
            child.output_index = index
            samplers.append(child)
        return samplers

    def apply_beam_step(
        self, beams: list[Request], extensions: dict[int, list[tuple[int, float]]]
    ) -> list[Request]:
        """Beam search's choice for one request's live beams: ``extensions`` maps a beam's id to
        the (token, logprob) continuations it keeps. A beam kept twice is forked (the forks
        share its blocks), one kept by none is freed. Returns the live beams, in order."""
        live = []
        # The beams no continuation extends end first: their blocks and state slots go back before
        # the forks below take theirs (a model with recurrent state has a slot per seat, no more).
        dropped = [beam for beam in beams if not extensions.get(beam.req_id)]
        if dropped:
            self.finish_requests(dropped, RequestStatus.FINISHED_ABORTED)
        for beam in beams:
            chosen = extensions.get(beam.req_id, [])
            if not chosen:
                continue
            # Forks first: each copies the beam before the beam takes its own token.
            forks = [self._fork(beam) for _ in chosen[1:]]
            for request, (token_id, logprob) in zip([beam, *forks], chosen):
                request.append_output_token(token_id, logprob)
                request.resend = True  # its next input was chosen here, not by the sampler
                live.append(request)
        return live

    def new_hypothesis(self, pending: PendingHypothesis) -> Request:
        """A finished copy of a live beam with one more token, holding no blocks and no member of
        the group (beam search's kept hypotheses)."""
        hypothesis = pending.parent.fork(self.new_req_id())
        hypothesis.append_output_token(pending.token_id, pending.logprob)
        hypothesis.status = pending.status
        return hypothesis

    def _fork(self, parent: Request) -> Request:
        """A running sibling of ``parent`` sharing its blocks."""
        child = parent.fork(self.new_req_id())
        self.kv_cache_manager.fork(parent, child)
        parent.group.members.append(child)
        self.add_running(child)
        return child
