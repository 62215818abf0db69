"""The package's dependencies point one way:

    base (config, sampling_params, step_io, platform, ...) <- kernels <- attention <- layers, sample,
    structured_output <- models <- model_loader <- worker <- executor <- engine <- entrypoints

and the core (scheduler, KV cache manager, requests) imports the base alone: it decides what runs
and speaks to the workers only through ``step_io``'s messages, so it sits right above the base.

A test walks every import of every module (lazy and type-checking ones too) and fails on an
import of a higher layer (a back edge) or on a cycle between modules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "pagedllm"

# Lowest first. A module may import its own layer and the layers below it.
LAYERS: list[tuple[str, ...]] = [
    (
        "pagedllm.cache_dir",
        "pagedllm.config",
        "pagedllm.config_checks",
        "pagedllm.parallel_config",
        "pagedllm.spec_config",
        "pagedllm.sampling_params",
        "pagedllm.distributed",
        "pagedllm.cpu_info",
        "pagedllm.tokenizer",
        "pagedllm.logger",
        "pagedllm.step_io",
        "pagedllm.pooling_params",
        "pagedllm.platform",
        # LoRA's request type, limits and adapter files: the core and the step messages carry them.
        "pagedllm.lora.request",
        "pagedllm.lora.config",
        "pagedllm.lora.peft",
    ),
    ("pagedllm.core",),
    ("pagedllm.kernels",),
    ("pagedllm.attention",),
    # LoRA's layers, batched product and slots (pagedllm.lora.* below is the base's).
    ("pagedllm.layers", "pagedllm.sample", "pagedllm.structured_output", "pagedllm.lora"),
    ("pagedllm.models",),
    ("pagedllm.model_loader",),
    ("pagedllm.worker",),
    ("pagedllm.executor",),
    (
        "pagedllm.detokenizer",
        "pagedllm.outputs",
        "pagedllm.request_validation",
        "pagedllm.engine",
        "pagedllm.metrics",
    ),
    ("pagedllm.entrypoints", "pagedllm.__main__", "pagedllm"),
]


def layer_of(module: str) -> int:
    best, best_len = None, -1
    for rank, prefixes in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = rank, len(prefix)
    assert best is not None, f"{module} is in no layer: add it to LAYERS"
    return best


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports_of(path: Path, name: str) -> set[str]:
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {m for m in found if m == "pagedllm" or m.startswith("pagedllm.")}


def import_graph() -> dict[str, set[str]]:
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        # Keep imports of modules (from-imports of names resolve to their module).
        graph[name] = {m if m in modules else m.rpartition(".")[0] for m in imports_of(path, name)} - {name}
        graph[name] &= set(modules)
    return graph


def test_no_module_imports_a_higher_layer():
    back_edges = [
        f"{src} ({layer_of(src)}) imports {dst} ({layer_of(dst)})"
        for src, dsts in import_graph().items()
        for dst in dsts
        if layer_of(dst) > layer_of(src) and dst != "pagedllm"
    ]
    assert not back_edges, "\n".join(sorted(back_edges))


def test_core_imports_only_the_base():
    graph = import_graph()
    base, core = layer_of("pagedllm.step_io"), layer_of("pagedllm.core")
    outside = [
        f"{src} imports {dst}"
        for src, dsts in graph.items()
        if layer_of(src) == core
        for dst in dsts
        if layer_of(dst) not in (base, core)
    ]
    assert not outside, "\n".join(sorted(outside))


def test_step_io_imports_only_leaves():
    assert import_graph()["pagedllm.step_io"] <= {"pagedllm.sampling_params", "pagedllm.lora.request"}


def test_no_import_cycles():
    graph = import_graph()
    # Package __init__ files that only re-export are allowed to import their own submodules.
    edges = {src: {d for d in dsts if not (src + ".").startswith(d + ".")} for src, dsts in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:  # Tarjan's strongly connected components
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    assert not cycles, f"import cycles: {cycles}"


@pytest.mark.parametrize("module", ["pagedllm.core.scheduler", "pagedllm.worker.model_runner"])
def test_layers_are_known(module):
    assert layer_of(module) >= 0
