#!/usr/bin/env bash
# Debian's chromium and chromium-driver for the console's browser tests
# (tests/integration/test_console.py). Run by `make venv`; as root it installs them with
# apt-get, otherwise it says what to run. It never fails the setup: without the browser
# those tests skip and say why.
set -uo pipefail
if [ -x /usr/bin/chromium ] && [ -x /usr/bin/chromedriver ]; then
  exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
  echo "note: the console's browser tests need chromium and chromium-driver;" \
       "run as root: apt-get install -y chromium chromium-driver" >&2
  exit 0
fi
export DEBIAN_FRONTEND=noninteractive
if ! apt-get install -y -q chromium chromium-driver >/dev/null; then
  apt-get update -q >/dev/null && apt-get install -y -q chromium chromium-driver >/dev/null \
    || echo "note: could not install chromium and chromium-driver; the console's browser" \
            "tests will skip" >&2
fi
exit 0
