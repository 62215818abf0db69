"""The proposal loop's static buffers (worker/proposal_graphs.py) against its eager form: a loop run
on the buffers (what a captured graph replays) sees, in its real rows, the positions, slots,
lengths and tables of the eager loop, and padding rows that write nothing; the drafts come back
the same. A step that reports what it saw stands in for the model: the expected values are the
inputs, worked out by hand."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from pagedllm.attention.forward_context import get_forward_context
from pagedllm.worker.proposal_graphs import (
    ProposalGraphs,
    StepPassGraphs,
    eager_steps,
    proposal_inputs,
    run_steps,
)

CPU = torch.device("cpu")
MAX_MODEL_LEN = 64


def recording_step(seen: list[dict]):
    """A step whose next token is token + position (and hidden + 1), recording its metadata."""

    def step(tokens, positions, hidden):
        md = get_forward_context().attn_metadata
        seen.append(
            {
                "num_decodes": md.num_decodes,
                "positions": positions.tolist(),
                "slots": md.slot_mapping.tolist(),
                "seq_lens": md.seq_lens.tolist(),
                "tables": md.block_tables.tolist(),
                "hidden": None if hidden is None else hidden[:, 0].tolist(),
            }
        )
        return tokens + positions, None if hidden is None else hidden + 1

    return step


# Two requests at newest positions 5 and 9 with block tables [3, 7, 0] and [4, 9, 2], block size
# 4, two steps: positions 5, 6 (block 7: slots 29, 30) and 9, 10 (block 2: slots 9, 10).
TABLES = torch.tensor([[3, 7, 0], [4, 9, 2]], dtype=torch.int32)
NEWEST = torch.tensor([5, 9])


def prepare(block_tables, newest, valid):
    """The loop's inputs without scratch tables (the drafters' add them: tests/engine)."""
    return proposal_inputs(block_tables, newest, 2, 4, MAX_MODEL_LEN, valid)


def test_proposal_inputs_walk_each_request_from_its_newest_position():
    # Block size 4. Request 0: P = 6, table [3, 8 (scratch), 9 (scratch)]: positions 6, 7, 8 in
    # slots 8 * 4 + 2, 8 * 4 + 3, 9 * 4 + 0. Request 1: P = 61 near max_model_len 63: positions 61,
    # 62, then 62 again (clamped), through its table's column 15.
    tables = torch.zeros((2, 17), dtype=torch.int32)
    tables[0, :3] = torch.tensor([3, 8, 9])
    tables[1, 15] = 20
    inputs = proposal_inputs(tables, torch.tensor([6, 61]), 3, 4, 63)
    assert inputs.positions.tolist() == [[6, 61], [7, 62], [8, 62]]
    assert inputs.slot_mapping.tolist() == [[34, 81], [35, 82], [36, 82]]
    assert inputs.seq_lens.tolist() == [[7, 62], [8, 63], [9, 63]] and inputs.seq_lens.dtype == torch.int32
    assert inputs.num_steps == 3 and inputs.block_tables is tables
    # A padding row (a graph's) writes nothing and reads one token.
    padded = proposal_inputs(tables, torch.tensor([6, 61]), 3, 4, 63, torch.tensor([True, False]))
    assert padded.slot_mapping.tolist() == [[34, -1], [35, -1], [36, -1]]
    assert padded.seq_lens.tolist() == [[7, 1], [8, 1], [9, 1]]


def test_the_static_loop_sees_the_eager_inputs_and_pads_with_rows_that_write_nothing():
    tokens, hidden = torch.tensor([100, 200]), torch.tensor([[0.5, 0.0], [1.5, 0.0]])
    eager_seen: list[dict] = []
    eager = torch.empty((2, 2), dtype=torch.int64)
    run_steps(recording_step(eager_seen), tokens, hidden, eager_steps(prepare(TABLES, NEWEST, None)), eager)
    # Step 0 reads the first tokens at 5 and 9; step 1 their sums at 6 and 10.
    assert eager.tolist() == [[105, 111], [209, 219]]
    assert [s["slots"] for s in eager_seen] == [[29, 9], [30, 10]]

    static_seen: list[dict] = []
    step = recording_step(static_seen)
    graphs = ProposalGraphs(step, prepare, 2, [1, 4], (2, torch.float32), 3, MAX_MODEL_LEN, CPU)
    drafts = graphs.run(tokens, hidden, TABLES, NEWEST)  # no capture on the CPU: the loop on the buffers
    assert drafts.tolist() == eager.tolist()
    assert [s["num_decodes"] for s in static_seen] == [4, 4]  # two requests padded to size 4
    for eager_step, static_step in zip(eager_seen, static_seen):
        for name in ("positions", "slots", "seq_lens", "tables", "hidden"):
            assert static_step[name][:2] == eager_step[name], name
        # Padding rows: slot -1 (no write), length 1, block 0.
        assert static_step["slots"][2:] == [-1, -1] and static_step["seq_lens"][2:] == [1, 1]
        assert static_step["tables"][2:] == [[0, 0, 0]] * 2
    assert static_seen[1]["hidden"][:2] == [1.5, 2.5]


def test_a_smaller_loop_after_a_larger_one_leaves_no_stale_inputs_in_its_rows():
    seen: list[dict] = []
    graphs = ProposalGraphs(
        recording_step(seen), prepare, 2, [1, 4], (0, torch.float32), 3, MAX_MODEL_LEN, CPU
    )
    graphs.run(torch.tensor([100, 200]), None, TABLES, NEWEST)
    seen.clear()
    # One request at P = 2 in block 5: slots 22, 23.
    one = graphs.run(torch.tensor([7]), None, torch.tensor([[5, 0, 0]], dtype=torch.int32), torch.tensor([2]))
    assert one.tolist() == [[9, 12]]
    # Size 1 replays the graph of one row: the earlier second request is not in it.
    assert [s["slots"] for s in seen] == [[22], [23]] and seen[0]["tables"] == [[5, 0, 0]]
    assert seen[0]["hidden"] is None


class RecordingGraph:
    """Stands in for torch.cuda.CUDAGraph: counts its replays."""

    def __init__(self) -> None:
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1


def test_the_pass_over_a_steps_tokens_is_captured_per_target_size_and_replayed_at_the_next_one(
    monkeypatch,
):
    capturing = [False]

    @contextlib.contextmanager
    def graph(_graph, pool=None):
        capturing[0] = True
        yield
        capturing[0] = False

    monkeypatch.setattr(torch.cuda, "graph", graph)
    monkeypatch.setattr(torch.cuda, "CUDAGraph", RecordingGraph)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    seen = []

    def step_pass(batch_size):
        # Each run under the target graphs' metadata of its own size, in a fresh context.
        seen.append((batch_size, get_forward_context().attn_metadata.num_decodes, capturing[0]))
        return torch.arange(batch_size) + 100 * batch_size, torch.zeros(batch_size, 2)

    graphs = StepPassGraphs(step_pass, lambda b: SimpleNamespace(num_decodes=b), [1, 2, 4])
    graphs.capture()
    # Largest first; two warm-up runs and the capture each.
    assert seen == [(b, b, c) for b in (4, 2, 1) for c in (False, False, True)]
    ids, hidden = graphs.replay(3)  # three tokens replay size 4's graph, its first three rows
    assert ids.tolist() == [400, 401, 402] and hidden.shape == (3, 2)
    assert [graphs._graphs[b].replays for b in (1, 2, 4)] == [0, 0, 1]
