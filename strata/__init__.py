"""Strata: an inference engine for large Mixture-of-Experts language models."""

__version__ = "0.1.0"
