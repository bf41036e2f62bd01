"""``python -m tocsin``: the command line, for processes started from the source tree."""

import sys

from tocsin.cli import main

sys.exit(main())
