"""Builders of tiny real models for tests, demos and benchmarks (no downloads)."""
