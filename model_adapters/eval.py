"""``python -m model_adapters.eval``: the perplexity / bytes harness
(:mod:`model_adapters.experiments.eval`, where the code lives)."""

import sys

from model_adapters.experiments.eval import build_parser, main, run

__all__ = ["build_parser", "main", "run"]

if __name__ == "__main__":
    sys.exit(main())
