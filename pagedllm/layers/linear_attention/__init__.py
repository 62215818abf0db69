"""Linear-attention layers with a per-request recurrent state (Gated DeltaNet; core/state_cache.py
owns which state row each request holds)."""
