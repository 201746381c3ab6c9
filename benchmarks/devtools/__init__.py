"""Device probes and profilers behind the benchmarks' numbers (`python -m benchmarks.devtools.<name>`)."""
