import sys

from model_adapters.retrieval.cli import main

sys.exit(main())
