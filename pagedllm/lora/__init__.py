"""Multi-LoRA serving: many PEFT adapters over one base model, mixed in one batch.

- ``request``: ``LoRARequest`` (vLLM's type), in the base layer: the core and the step messages
  carry it.
- ``config``: ``LoRAConfig`` (max_loras, max_lora_rank, max_cpu_loras), in the base layer.
- ``peft``: PEFT adapter directories read and checked against the base model (base layer: the
  engine checks an adapter before it queues the request; the workers load it).
- ``punica``, ``layers``, ``model_manager``: the math and the slots, at the layers' level.

This package's ``__init__`` imports nothing, so the base-layer modules stay importable alone.
"""
