"""Quantizers: the configuration grammar (``configs``), k-means (``kmeans``), residual VQ
(``rvq``), the per-model codebook set :class:`~model_adapters.quant.quantizer.KVQuantizer`
(``quantizer``) and its training data (``collect``). Imports only ``model_adapters.models``."""
