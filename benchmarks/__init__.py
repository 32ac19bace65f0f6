"""Benchmarks and the GPU campaign (run from the repository's root; never imported by diffmeg).

A regular package, so `python3 -m benchmarks.campaign` and `from benchmarks import ...` find this folder
even where another installed distribution ships a top-level `benchmarks` package.
"""
