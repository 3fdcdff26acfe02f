"""transformers caches: the archiving cache (``archiving``), the codes-only cache
(``codes_only``, its static-shape layer for compiled decoding in ``static_codes``, what both of
its layers share in ``codes_layer``) and the attention function that reads its codes
(``codes_attention``), the collector of archive rows (``code_rows``) and the window rules both
caches share (``window``). Imports ``model_adapters.models`` and ``model_adapters.quant``."""
