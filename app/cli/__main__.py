"""``python -m app.cli``: the same as the ``infersight`` console script."""

import sys

from app.cli.main import main

sys.exit(main())
