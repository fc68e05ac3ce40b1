"""Sampling: counter-based RNG, logits processing, sampling and lossless verification."""
