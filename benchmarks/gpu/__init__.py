"""The GPU check's parts (benchmarks/gpu_check.py runs them): offline installs and child processes (runtime),
the environment and probe, the sizes (plan), the synthetic corpus, the report, and one module per measurement."""
