"""Device kernels behind the attention backends, one subpackage per language."""
