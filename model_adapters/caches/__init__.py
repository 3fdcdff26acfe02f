"""transformers caches: the archiving cache (``archiving``), the codes-only cache
(``codes_only``) and the attention function that reads its codes (``codes_attention``), the
collector of archive rows (``code_rows``) and the window rules both caches share (``window``).
Imports ``model_adapters.models`` and ``model_adapters.quant``."""
