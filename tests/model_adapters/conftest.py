"""Fixtures every model_adapters test module sees: a tiny saved checkpoint for the CLI tests,
and one torch thread for all of them (see ``one_thread``)."""

from adapters_fixtures import tiny_checkpoint  # noqa: F401 (a fixture)
from serving_fixtures import one_thread  # noqa: F401 (an autouse fixture)
