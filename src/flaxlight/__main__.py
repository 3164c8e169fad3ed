"""``python -m flaxlight``: the ``flaxlight`` command line (see :mod:`flaxlight.cli`)."""

import sys

from flaxlight.cli import main

if __name__ == "__main__":
    sys.exit(main())
