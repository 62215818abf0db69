"""Model building blocks: norms, rotary, tensor-parallel linear layers, embeddings, logits."""
