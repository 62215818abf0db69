"""``pagedllm bench ...``: one module per benchmark, each with ``add_cli_args(parser)`` and
``main(args)``: ``throughput`` (W1, W2), ``latency`` (W3), ``serve`` (online serving, W4),
``kernels`` (decode attention, K1). The workloads are in ``workloads.py``."""
