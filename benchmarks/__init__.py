"""Benchmark scripts of walkserve (``python benchmarks/bench_X.py [--quick]``) and the HTTP load
generator (``python -m benchmarks ...``). Not part of the installed package: run from a source
checkout."""
