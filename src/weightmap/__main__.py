"""``python -m weightmap``: the command line."""

import sys

from weightmap.cli import main

sys.exit(main())
