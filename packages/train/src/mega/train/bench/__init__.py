"""Benchmarks shipped as ``mega bench ...`` commands."""
