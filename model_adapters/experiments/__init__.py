"""Measurements: the perplexity / bytes harness (``eval``, run as ``python -m
model_adapters.eval``), token-by-token NLL (``perplexity``), the book and its split (``text``)
and the rate-distortion figure (``plot``)."""
