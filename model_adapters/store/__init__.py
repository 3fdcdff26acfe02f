"""Archives on disk: the layout of one run's archive (``archive_io``), the codes-only cache
bound to an archive (``serving_archive``) and streams continuing a parent archive
(``serving_streams``). The only part of model_adapters that imports fkvstore."""
