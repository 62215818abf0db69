"""Sampling: what turns a step's logits into the next tokens, row by row."""
