"""``python -m proxy``: run the delivery proxy from TOCSIN_* variables.

A stop-gap process edge for tests and benchmarks until ``tocsin proxy`` is wired in the CLI;
like the CLI it is a process entry point, so it is allowed to hand ``os.environ`` to the
settings readers.
"""

from __future__ import annotations

import os
import sys

from proxy.app import run
from proxy.settings import ProxySettings
from tocsin.errors import TocsinError
from tocsin.logs import setup_logging
from tocsin.settings import Settings


def main() -> int:
    settings = Settings.from_env()
    setup_logging(settings.log_level, settings.log_format)
    try:
        run(settings, ProxySettings.from_env(os.environ))
    except TocsinError as exc:
        print(f"tocsin proxy: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
