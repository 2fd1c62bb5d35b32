"""Entry point of the PyInstaller build: the same as the `infersight` console script."""

import sys

from app.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
