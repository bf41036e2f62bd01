"""``tocsin api``: serve the REST API."""

from __future__ import annotations

import argparse
from dataclasses import replace

from base import tracing
from base.settings import Settings
from tocsin.output import SubParsers


def cmd_api(args: argparse.Namespace, settings: Settings) -> int:
    from api.server import run  # loads aiohttp, which only the API needs

    if args.port is not None:
        settings = replace(settings, api=replace(settings.api, port=args.port))
    tracing.configure("tocsin-api")  # the service name unless OTEL_SERVICE_NAME says
    run(settings)
    return 0


def register(sub: SubParsers) -> None:
    api = sub.add_parser("api", help="serve the REST API (docs/api.md)")
    api.add_argument("--port", type=int, default=None, help="override TOCSIN_API_PORT")
    api.set_defaults(func=cmd_api)
