"""Long-context retrieval benchmark: needle items from held-out books, answered through
compressed KV caches (the project's residual-VQ caches and peer methods side by side).

``python -m model_adapters.retrieval --help``; docs/retrieval.md. Modules: ``tasks`` (items),
``presses`` (kvpress-style presses), ``peers`` (transformers' ``QuantizedCache`` backends),
``methods`` (the method registry), ``scoring``, ``runner``, ``report``, ``cli``.
"""
