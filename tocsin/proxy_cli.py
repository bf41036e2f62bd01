"""``tocsin proxy``: run the delivery proxy (settings from TOCSIN_* and TOCSIN_PROXY_*)."""

from __future__ import annotations

import argparse
import os

from base.settings import Settings
from proxy.settings import ProxySettings
from tocsin.output import SubParsers


def cmd_proxy(args: argparse.Namespace, settings: Settings) -> int:
    from proxy.app import run  # loads aiokafka and aiohttp, which only the proxy needs

    # The process edge hands the environment to the settings readers, like Settings.from_env.
    run(settings, ProxySettings.from_env(os.environ))
    return 0


def register(sub: SubParsers) -> None:
    proxy = sub.add_parser("proxy", help="run the Kafka-to-REST delivery proxy (MPS model)")
    proxy.set_defaults(func=cmd_proxy)
