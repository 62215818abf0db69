"""Which hidden-state rows a step scores: a row per sample to draw, then a row per prompt token
whose logprob was asked for; and the scoring of the prompt rows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedllm.layers.sampler import SamplingGroup, SequenceSample, top_logprobs
from pagedllm.worker.execute_request import SequenceGroupMetadata


@dataclass
class PromptLogprobRequest:
    """One request's prompt positions scored this step (rows follow the sampling rows)."""

    request_id: str
    seq_id: int
    target_token_ids: list[int]
    num_top_tokens: int


def sampling_rows(
    seq_groups: list[SequenceGroupMetadata],
    last_token_index: dict[int, int],
    generators: dict[str, torch.Generator],
) -> tuple[list[int], list[SamplingGroup]]:
    """The batch row of each sample (a sequence's last token, repeated when it draws several
    first tokens), and each sampling request's parameters."""
    logits_indices: list[int] = []
    sampling_groups: list[SamplingGroup] = []
    for group in seq_groups:
        sampling_seqs = [seq for seq in group.seqs if seq.do_sample]
        if not sampling_seqs:
            continue
        repeat = group.num_samples
        seq_ids: list[int] = []
        num_output_tokens: list[int] = []
        output_token_ids: list[list[int]] = []
        for seq in sampling_seqs:
            logits_indices += [last_token_index[seq.seq_id]] * repeat
            seq_ids += [seq.seq_id] * repeat
            num_output_tokens += [seq.num_output_tokens] * repeat
            output_token_ids += [seq.output_token_ids or []] * repeat
        has_outputs = sampling_seqs[0].output_token_ids is not None
        sampling_groups.append(
            SamplingGroup(
                request_id=group.request_id,
                params=group.sampling_params,
                seq_ids=seq_ids,
                num_output_tokens=num_output_tokens,
                stop_token_ids=group.stop_token_ids,
                generator=generators.get(group.request_id),
                output_token_ids=output_token_ids if has_outputs else None,
                prompt_token_ids=group.prompt_token_ids,
                num_top_tokens=group.num_top_tokens,
            )
        )
    return logits_indices, sampling_groups


def prompt_logprob_rows(
    seq_groups: list[SequenceGroupMetadata], first_token_index: dict[int, int]
) -> tuple[list[int], list[PromptLogprobRequest]]:
    rows: list[int] = []
    requests: list[PromptLogprobRequest] = []
    for group in seq_groups:
        if not group.prompt_logprob_positions:
            continue
        (seq,) = group.seqs  # prompt logprobs are scored before the request forks
        first = first_token_index[seq.seq_id] - seq.num_computed_tokens
        rows += [first + position for position in group.prompt_logprob_positions]
        requests.append(
            PromptLogprobRequest(
                group.request_id, seq.seq_id, group.prompt_logprob_targets, group.num_prompt_logprobs
            )
        )
    return rows, requests


def score_prompts(
    logits: torch.Tensor, requests: list[PromptLogprobRequest]
) -> dict[str, list[SequenceSample]]:
    """logits: [sum of targets, vocab], the requests' rows in order."""
    if not requests:
        return {}
    targets = torch.tensor([t for r in requests for t in r.target_token_ids], device=logits.device)
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(-1, targets[:, None]).squeeze(-1)
    top = top_logprobs(logprobs, chosen, max(1, *(r.num_top_tokens for r in requests)))
    chosen_list = chosen.tolist()
    scored: dict[str, list[SequenceSample]] = {}
    row = 0
    for request in requests:
        samples = []
        for token_id in request.target_token_ids:
            rank, top_ids, top_values = top.row(row, request.num_top_tokens)
            samples.append(
                SequenceSample(request.seq_id, token_id, chosen_list[row], rank, top_ids, top_values)
            )
            row += 1
        scored[request.request_id] = samples
    return scored
