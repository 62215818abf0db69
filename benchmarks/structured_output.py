"""The cost of structured outputs: output tokens/s of a batch of JSON-schema requests against
the same batch unconstrained.

    PYTHONPATH=. python benchmarks/structured_output.py [--model M] [--num-requests 32] [--device cuda]
        [--load-format dummy] [--shape benchmarks/configs/llama-3.1-8b] [--in-step]

The runs (unconstrained, then each schema of SCHEMAS) use the same chat prompts, temperature 0.8
and seeds, and the same max_tokens; a constrained run's extra cost is the grammar's bitmask
(filled on the host each step, applied on the device) and accepting each sampled token. A first
short run of each kind warms up (compilation, CUDA graphs) and is not counted; then the kinds
run in turn ``--repeats`` times: each kind reports its median, and a constrained kind its slowdown
as the median, over the rounds, of its run's rate against the unconstrained run of the same round.
Target: the constrained batch at most 10% slower.

``--shape CONFIG_DIR`` runs a model of that architecture (random weights) with ``--model``'s
tokenizer and vocabulary: the grammar's work is the same, the step's device time that of the
larger model (on SmolLM2-135M a step is bound by the host, where the grammar's work lands).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedllm import LLM, SamplingParams
from pagedllm.sampling_params import StructuredOutputsParams

# "strict": the keywords OpenAI's strict structured outputs accept (what the openai client and
# LangChain's with_structured_output send). "bounded": string lengths and item counts bounded too,
# which made xgrammar's masks about 15x slower (a bound was a repetition to it) and llguidance's
# about 6x (median per 32-row fill on the development CPU: 3.34 against 0.22 ms, 0.87 against 0.15).
SCHEMAS = {
    "strict": {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "country": {"type": "string"},
            "population": {"type": "integer"},
            "landmarks": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["name", "country", "population", "landmarks"],
        "additionalProperties": False,
    },
    "bounded": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "country": {"type": "string", "maxLength": 40},
            "population": {"type": "integer"},
            "landmarks": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 4},
        },
        "required": ["name", "country", "population", "landmarks"],
        "additionalProperties": False,
    },
}
CITIES = ["Paris", "Rome", "Tokyo", "Lima", "Cairo", "Oslo", "Lagos", "Hanoi"]


def _run(llm: LLM, num_requests: int, max_tokens: int, schema: dict | None) -> tuple[float, int]:
    structured = StructuredOutputsParams(json=schema) if schema is not None else None
    conversations = [
        [{"role": "user", "content": f"Describe {CITIES[i % len(CITIES)]} as a JSON object."}]
        for i in range(num_requests)
    ]
    params = [
        SamplingParams(temperature=0.8, seed=i, max_tokens=max_tokens, structured_outputs=structured)
        for i in range(num_requests)
    ]
    start = time.perf_counter()
    outputs = llm.chat(conversations, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    if schema is not None:
        for output in outputs:
            if output.outputs[0].finish_reason == "stop":
                json.loads(output.outputs[0].text)
    return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)


def _with_shape(model: str, shape: str, into: str) -> str:
    """A model directory in ``into``: ``shape``'s config with ``model``'s vocabulary and special
    tokens, and ``model``'s tokenizer files."""
    config = json.loads((Path(shape) / "config.json").read_text())
    vocab = json.loads((Path(model) / "config.json").read_text())
    for key in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id"):
        config[key] = vocab.get(key)
    (Path(into) / "config.json").write_text(json.dumps(config))
    for path in Path(model).iterdir():
        weights = path.name.endswith((".safetensors", ".gguf", ".bin"))
        if path.name != "config.json" and path.is_file() and not weights:
            shutil.copy(path, into)
    return into


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--device", default="auto")
    parser.add_argument(
        "--load-format", default="auto", help="dummy: random weights (the grammar costs the same)"
    )
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=9, help="rounds: runs of each kind, interleaved")
    parser.add_argument("--output-json", default=None)
    parser.add_argument("--shape", default=None, help="a config directory: its architecture, random weights")
    parser.add_argument(
        "--in-step", action="store_true", help="also each schema with its masks filled in the step (CUDA)"
    )
    args = parser.parse_args()
    model, load_format = args.model, args.load_format
    if args.shape is not None:
        if args.model is None:
            parser.error("--shape needs --model: a directory with the tokenizer and its config")
        model, load_format = _with_shape(args.model, args.shape, tempfile.mkdtemp()), "dummy"
    llm = LLM(model, device=args.device, max_model_len=1024, load_format=load_format)
    grammars = llm.llm_engine.executor.worker.model_runner.logits_processors.grammars
    # (name, schema, masks made ahead on a thread): the engine's default, and with --in-step each
    # schema once more with the masks filled in the step, for an A/B in one process.
    kinds = [("unconstrained", None, grammars.fill_ahead)]
    kinds += [(name, schema, grammars.fill_ahead) for name, schema in SCHEMAS.items()]
    if args.in_step and grammars.fill_ahead:
        kinds += [(f"{name} in the step", schema, False) for name, schema in SCHEMAS.items()]
    for _, schema, _ in kinds:  # warm-up: compilation, the batch's shapes
        _run(llm, args.num_requests, 8, schema)
    # The kinds interleaved, each run repeated: on a small model a run lasts a fraction of a
    # second and the host's jitter moves one by 20%; the median of the repeats is reported.
    runs: dict[str, list[tuple[float, int]]] = {name: [] for name, _, _ in kinds}
    for _ in range(args.repeats):
        for name, schema, fill_ahead in kinds:
            grammars.fill_ahead = fill_ahead
            runs[name].append(_run(llm, args.num_requests, args.max_tokens, schema))
    result: dict = {}
    for name, _, _ in kinds:
        rates = [num_tokens / elapsed for elapsed, num_tokens in runs[name]]
        result[name] = {"tokens_per_s": statistics.median(rates), "runs_tokens_per_s": rates}
        print(f"{name:>13}: median {result[name]['tokens_per_s']:.1f} tok/s over {len(rates)} runs")
    unconstrained = result["unconstrained"]["runs_tokens_per_s"]
    for name, schema, _ in kinds:
        if schema is not None:
            # Each round's runs follow one another, so the host's drift from round to round (20%
            # on a small model's host-bound step) cancels in the round's ratio; the median of the
            # rounds' ratios is the figure.
            ratios = [1 - rate / base for rate, base in zip(result[name]["runs_tokens_per_s"], unconstrained)]
            slowdown = statistics.median(ratios)
            result[name]["slowdown"] = slowdown
            result[name]["rounds_slowdown"] = ratios
            print(
                f"json_schema ({name}) is {100 * slowdown:.1f}% slower in output tokens/s (median of "
                f"{len(ratios)} rounds' ratios; target: 10%)"
            )
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
