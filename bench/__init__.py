"""Benchmarks for zenflow_kernels: `python -m bench.kernels`, `python -m bench.cpu_adam`, `python -m bench.e2e`.

Every entry point goes through :mod:`bench.harness` (timing, machine description, JSON/CSV, plots).
"""
