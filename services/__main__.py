"""`python -m services` is the `slipstream` command (services/train/cli.py), as the tests run it."""

import sys

from services.train.cli import main

sys.exit(main())
