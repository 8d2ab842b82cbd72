"""One-off probes run on the GPU machine to explain a benchmark's figures (not part of ``python -m benchmarks``)."""
