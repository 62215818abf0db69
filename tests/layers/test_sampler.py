"""The sampler against direct computations of each option's distribution."""

import torch

from pagedllm.layers.sampler import Sampler, SamplingGroup, apply_min_p, apply_top_k_top_p
from pagedllm.sampling_params import SamplingParams

VOCAB = 50


def group(params: SamplingParams, seq_ids: list[int], generator=None, outputs=None, stop_ids=None):
    return SamplingGroup(
        request_id=str(seq_ids[0]),
        params=params,
        seq_ids=seq_ids,
        num_output_tokens=outputs or [0] * len(seq_ids),
        stop_token_ids=stop_ids or [],
        generator=generator,
    )


def test_greedy_takes_the_argmax_and_reports_its_logprob():
    logits = torch.randn(3, VOCAB)
    groups = [group(SamplingParams(temperature=0.0), [i]) for i in range(3)]
    out = Sampler()(logits.clone(), groups)
    expected = logits.argmax(-1)
    logprobs = torch.log_softmax(logits, -1)
    for i in range(3):
        (sample,) = out[str(i)]
        assert sample.parent_seq_id == i and sample.token_id == expected[i].item()
        assert abs(sample.logprob - logprobs[i, expected[i]].item()) < 1e-6


def test_top_k_top_p_keep_exactly_the_expected_tokens():
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0, -1.0], [5.0, 4.0, 0.0, 0.0, 0.0]])
    masked = apply_top_k_top_p(logits, torch.tensor([2, 5]), None)
    assert torch.isfinite(masked[0]).tolist() == [False, True, False, True, False]
    assert torch.isfinite(masked[1]).all()
    probs = torch.softmax(logits[1], -1)
    # top_p=0.7: 5.0 has ~0.72 of the mass alone; the nucleus is that token only.
    assert probs[0] > 0.7
    masked = apply_top_k_top_p(logits, None, torch.tensor([1.0, 0.7]))
    assert torch.isfinite(masked[1]).tolist() == [True, False, False, False, False]
    assert torch.isfinite(masked[0]).all()


def test_min_p_zeroes_unlikely_tokens():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    kept = apply_min_p(probs, torch.tensor([0.2]))  # threshold 0.1
    assert torch.equal(kept, torch.tensor([[0.5, 0.3, 0.15, 0.0]]))


def test_random_sampling_follows_the_distribution():
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.6, 0.3, 0.1, 1e-9]]))
    num_rows = 4000
    params = SamplingParams(temperature=1.0)
    out = Sampler()(logits.expand(num_rows, -1).clone(), [group(params, list(range(num_rows)))])
    counts = torch.bincount(torch.tensor([s.token_id for s in out["0"]]), minlength=4).float() / num_rows
    assert torch.allclose(counts, torch.tensor([0.6, 0.3, 0.1, 0.0]), atol=0.03)


def test_temperature_sharpens():
    torch.manual_seed(0)
    logits = torch.log(torch.tensor([[0.6, 0.4]])).expand(2000, -1).clone()
    out = Sampler()(logits, [group(SamplingParams(temperature=0.25), list(range(2000)))])
    share = sum(s.token_id == 0 for s in out["0"]) / 2000
    expected = 0.6**4 / (0.6**4 + 0.4**4)  # p^(1/T), renormalised
    assert abs(share - expected) < 0.03


def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(4, VOCAB)
    params = SamplingParams(temperature=1.0, seed=7)

    def draw(batch_logits, groups):
        return Sampler()(batch_logits, groups)

    alone = draw(logits[2:3].clone(), [group(params, [2], torch.Generator().manual_seed(7))])
    torch.manual_seed(123)
    mixed = draw(
        logits.clone(),
        [
            group(SamplingParams(temperature=1.0), [0, 1]),
            group(params, [2], torch.Generator().manual_seed(7)),
            group(SamplingParams(temperature=0.5), [3]),
        ],
    )
    assert alone["2"][0].token_id == mixed["2"][0].token_id


def test_min_tokens_bans_stop_tokens_until_reached():
    logits = torch.zeros(2, VOCAB)
    logits[:, 3] = 10.0  # token 3 (EOS) is by far the most likely
    params = SamplingParams(temperature=0.0, min_tokens=2)
    out = Sampler()(logits, [group(params, [0, 1], outputs=[1, 2], stop_ids=[3])])
    assert out["0"][0].token_id != 3  # under min_tokens
    assert out["0"][1].token_id == 3  # reached it
