"""Laptop-side tools: building and chaining the kernels, a local Kaggle, benchmarks."""
