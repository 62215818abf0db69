"""C++ kernels for the CPU path, built on first use (``build.load``)."""
