"""``tocsin proxy``: run the delivery proxy (settings from TOCSIN_* and TOCSIN_PROXY_*), and
``tocsin proxy secret ...``: make and rotate the delivery secrets that sign its callbacks
(docs/proxy.md, "Verifying callbacks")."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import orjson

from base import tracing
from base.settings import Settings
from proxy.callback_signing import (
    MAX_SECRETS_PER_TENANT,
    SIGNATURE_HEADER,
    fingerprint,
    generate_secret,
    read_secrets_file,
    sign,
    write_secrets_file,
)
from proxy.settings import ProxySettings
from tocsin.output import EXIT_FAIL, EXIT_NOT_FOUND, EXIT_OK, SubParsers, emit


def cmd_proxy(args: argparse.Namespace, settings: Settings) -> int:
    from proxy.app import run  # loads aiokafka and aiohttp, which only the proxy needs

    # The process edge hands the environment to the settings readers, like Settings.from_env.
    tracing.configure("tocsin-proxy")  # the service name unless OTEL_SERVICE_NAME says
    run(settings, ProxySettings.from_env(os.environ))
    return 0


def _print(args: argparse.Namespace, doc: dict[str, object], text: str) -> None:
    if getattr(args, "json", False):
        sys.stdout.write(orjson.dumps(doc, option=orjson.OPT_INDENT_2).decode() + "\n")
    else:
        print(text)


def _load(path: Path, *, missing_ok: bool) -> dict[str, tuple[str, ...]]:
    if missing_ok and not path.exists():
        return {}
    return read_secrets_file(path)


def cmd_generate(args: argparse.Namespace, settings: Settings) -> int:
    secret = generate_secret()
    _print(args, {"secret": secret, "fingerprint": fingerprint(secret)}, secret)
    return EXIT_OK


def cmd_rotate(args: argparse.Namespace, settings: Settings) -> int:
    """A new secret first in the tenant's list (the tenant added if new): the proxy signs
    with it and the previous ones until ``retire``."""
    path = Path(args.file)
    by_tenant = _load(path, missing_ok=True)
    old = by_tenant.get(args.tenant, ())
    if len(old) >= MAX_SECRETS_PER_TENANT:
        print(
            f"tenant {args.tenant!r} already has {len(old)} secrets: retire first",
            file=sys.stderr,
        )
        return EXIT_FAIL
    secret = generate_secret()
    by_tenant[args.tenant] = (secret, *old)
    write_secrets_file(path, by_tenant)
    doc: dict[str, object] = {
        "tenant": args.tenant,
        "secret": secret,
        "fingerprints": [fingerprint(s) for s in by_tenant[args.tenant]],
    }
    # The new secret is printed once, for the tenant's receiver; the file keeps it.
    _print(args, doc, secret)
    return EXIT_OK


def cmd_retire(args: argparse.Namespace, settings: Settings) -> int:
    """Keep only the tenant's newest secret (or, with --all, drop the tenant)."""
    path = Path(args.file)
    by_tenant = _load(path, missing_ok=False)
    old = by_tenant.get(args.tenant)
    if old is None:
        print(f"tenant {args.tenant!r} is not in {path}", file=sys.stderr)
        return EXIT_NOT_FOUND
    if args.all:
        del by_tenant[args.tenant]
    else:
        by_tenant[args.tenant] = old[:1]
    write_secrets_file(path, by_tenant)
    kept = list(by_tenant.get(args.tenant, ()))
    doc: dict[str, object] = {
        "tenant": args.tenant,
        "retired": [fingerprint(s) for s in old if s not in kept],
        "kept": [fingerprint(s) for s in kept],
    }
    _print(args, doc, f"{args.tenant}: {len(old) - len(kept)} retired, {len(kept)} kept")
    return EXIT_OK


def cmd_list(args: argparse.Namespace, settings: Settings) -> int:
    """The file's tenants with their secrets' fingerprints (never the secrets)."""
    by_tenant = _load(Path(args.file), missing_ok=False)
    rows: list[dict[str, object]] = [
        {"tenant": t, "secrets": len(s), "fingerprints": " ".join(fingerprint(x) for x in s)}
        for t, s in sorted(by_tenant.items())
    ]
    emit(args, rows, ["tenant", "secrets", "fingerprints"])
    return EXIT_OK


def cmd_sign(args: argparse.Namespace, settings: Settings) -> int:
    """The header the proxy would send for a body now: to test a receiver's verification."""
    by_tenant = _load(Path(args.file), missing_ok=False)
    listed = by_tenant.get(args.tenant)
    if listed is None:
        print(f"tenant {args.tenant!r} is not in {args.file}", file=sys.stderr)
        return EXIT_NOT_FOUND
    body = sys.stdin.buffer.read() if args.body_file == "-" else Path(args.body_file).read_bytes()
    t = int(time.time()) if args.timestamp is None else args.timestamp
    header = sign(listed, t, args.trigger_id, body)
    _print(args, {"header": SIGNATURE_HEADER, "value": header}, f"{SIGNATURE_HEADER}: {header}")
    return EXIT_OK


def _json_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
    )


def register(sub: SubParsers) -> None:
    proxy = sub.add_parser("proxy", help="run the Kafka-to-REST delivery proxy (MPS model)")
    proxy.set_defaults(func=cmd_proxy)
    proxy_sub = proxy.add_subparsers(dest="proxy_command", required=False)
    secret = proxy_sub.add_parser(
        "secret", help="delivery secrets that sign callbacks (TOCSIN_PROXY_SIGNING_SECRETS_FILE)"
    )
    actions = secret.add_subparsers(dest="secret_action", required=True)

    gen = actions.add_parser("generate", help="print a new random secret")
    gen.set_defaults(func=cmd_generate)

    rotate = actions.add_parser(
        "rotate", help="put a new secret first in a tenant's list (prints it once)"
    )
    rotate.set_defaults(func=cmd_rotate)

    retire = actions.add_parser("retire", help="keep only a tenant's newest secret")
    retire.add_argument("--all", action="store_true", help="drop the tenant from the file")
    retire.set_defaults(func=cmd_retire)

    listing = actions.add_parser("list", help="tenants and their secrets' fingerprints")
    listing.set_defaults(func=cmd_list)

    signing = actions.add_parser("sign", help="the signature header the proxy would send now")
    signing.add_argument("--trigger-id", required=True)
    signing.add_argument("--body-file", default="-", help="the body (default: standard input)")
    signing.add_argument("--timestamp", type=int, help="unix seconds (default: now)")
    signing.set_defaults(func=cmd_sign)

    for p in (rotate, retire, listing, signing):
        p.add_argument("file", help="the secrets file (JSON: tenant -> [secret, ...])")
    for p in (rotate, retire, signing):
        p.add_argument("tenant")
    for p in (gen, rotate, retire, listing, signing):
        _json_flag(p)
