"""``python -m samebits``: the ``samebits`` command line."""

import sys

from samebits.cli import main

sys.exit(main())
