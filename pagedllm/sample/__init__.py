"""Sampling: per-row parameters as tensors (SamplingMetadata), penalties, logits processors, and
the Sampler that turns a step's logits into tokens and logprobs on the device."""
