"""One method for every static-against-elastic comparison of serving engines (see DESIGN.md, "Comparing
configurations"), written once; each engine is a driver.

- :mod:`.trace`: the trace's shapes (ramps, bursty, saturated, steady), seeded Poisson arrivals;
- :mod:`.method`: the order of runs (one discarded warm-up replay per configuration, then ABBA pairs), the replay
  of a trace against one configuration, and the figures and counters of a run;
- :mod:`.report`: the ratios pair by pair (median and range), the report (JSON and markdown, every run listed with
  its counters) and its picture;
- :mod:`.tcb` (transformers' continuous batching) and :mod:`.vllm` (vLLM servers): the drivers.

``python -m benchmarks multimodel`` (``benchmarks/multimodel.py``) is the command line.
"""
