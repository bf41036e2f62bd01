"""``tocsin tenant``: register and list tenants, rotate signing keys."""

from __future__ import annotations

import argparse
import asyncio
import sys

import orjson

from base.settings import Settings
from streams.tenant_admin import (
    RotationConflict,
    TenantExists,
    TenantNotFound,
    register_tenant,
    retire_previous_signing_key,
    rotate_signing_key,
)
from streams.tenants import TenantConfig
from tocsin.output import (
    EXIT_FAIL,
    EXIT_NOT_FOUND,
    EXIT_OK,
    EXIT_USAGE,
    Action,
    SubParsers,
    emit,
    run_action,
)
from tocsin.store_session import with_store


def cmd_tenant(args: argparse.Namespace, settings: Settings) -> int:
    actions: dict[str, Action] = {
        "register": _tenant_register,
        "rotate-key": _rotate_key,
        "list": _tenant_list,
    }
    return run_action(
        args, settings, actions, command="tenant", subject="tenant name", given=args.name
    )


def _tenant_config(args: argparse.Namespace) -> TenantConfig:
    """The configuration the register flags give; ValueError names a bad one."""
    flags = {
        "create_quota_per_s": args.create_quota,
        "fire_quota_per_min": args.fire_quota,
        "max_payload_bytes": args.max_payload_bytes,
        "max_horizon_s": args.max_horizon_s,
        "retention_s": args.retention_s,
        "allowed_callback_hosts": args.allow_host or None,
        "allowed_kafka_topics": args.allow_topic or None,
    }
    return TenantConfig.from_dict({k: v for k, v in flags.items() if v is not None})


def _tenant_register(args: argparse.Namespace, settings: Settings) -> int:
    try:
        config = _tenant_config(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USAGE
    try:
        created = asyncio.run(
            with_store(settings, lambda s: register_tenant(s, args.name, config, active=True))
        )
    except TenantExists as exc:
        if args.exist_ok:
            # Setup scripts re-run on every upgrade: an existing tenant keeps its keys
            # and configuration untouched.
            print(f"tenant {args.name} is already registered; left unchanged")
            return EXIT_OK
        print(
            f"error: {exc}; its keys and configuration are left unchanged (a new "
            f"signing key: `tocsin tenant rotate-key {args.name}`; an API key: POST "
            f"/v1/tenants/{args.name}/keys; new limits: PATCH /v1/tenants/{args.name})",
            file=sys.stderr,
        )
        return EXIT_FAIL
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAIL
    if args.no_print_keys:
        print(f"tenant {created['tenant']} registered (keys not printed)")
    elif args.json:
        print(orjson.dumps(created, option=orjson.OPT_INDENT_2).decode())
    else:
        print(f"tenant {created['tenant']} registered; store these now, they are not shown again:")
        print(f"  api key      {created['api_key']}")
        print(f"  signing key  {created['signing_key']}")
    return EXIT_OK


def _tenant_list(args: argparse.Namespace, settings: Settings) -> int:
    rows = asyncio.run(with_store(settings, lambda s: s.list_tenants()))
    out: list[dict[str, object]] = []
    for r in sorted(rows, key=lambda r: r["tenant"]):
        cfg = TenantConfig.from_json(r.get("config"))
        out.append(
            {
                "tenant": r["tenant"],
                "active": bool(r["active"]),
                "signed": bool(r.get("signing_secret")),
                "create_quota_per_s": cfg.create_quota_per_s,
                "allowed_hosts": ",".join(cfg.allowed_callback_hosts) or "*",
            }
        )
    emit(args, out, ["tenant", "active", "signed", "create_quota_per_s", "allowed_hosts"])
    return EXIT_OK


def _rotate_key(args: argparse.Namespace, settings: Settings) -> int:
    if args.retire_previous and args.previous_valid_s is not None:
        print("error: --retire-previous and --previous-valid-s exclude each other", file=sys.stderr)
        return EXIT_USAGE
    try:
        if args.retire_previous:
            done = asyncio.run(
                with_store(settings, lambda s: retire_previous_signing_key(s, args.name))
            )
        else:
            done = asyncio.run(
                with_store(
                    settings,
                    lambda s: rotate_signing_key(
                        s, args.name, previous_valid_s=args.previous_valid_s
                    ),
                )
            )
    except TenantNotFound as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_NOT_FOUND
    except (ValueError, RotationConflict) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_FAIL
    if getattr(args, "json", False):
        print(orjson.dumps(done, option=orjson.OPT_INDENT_2).decode())
    elif args.retire_previous:
        print(
            f"tenant {args.name}: previous signing key retired (within "
            "TOCSIN_TENANT_CACHE_TTL_S on every worker)"
        )
    else:
        expires = done["previous_expires_ms"]
        until = "until `--retire-previous`" if expires is None else f"until epoch ms {expires}"
        print(f"tenant {args.name}: new signing key (store it now, it is not shown again):")
        print(f"  signing key  {done['signing_key']}")
        if done["previous_key"]:
            print(f"  the previous key stays valid {until}")
        if done["retired_earlier_previous"]:
            print("  the key rotated out before it is retired now")
    return EXIT_OK


def register(sub: SubParsers) -> None:
    tenant = sub.add_parser(
        "tenant",
        help="register and list tenants, rotate signing keys",
        description="register: a tenant with a signing key and an API key (printed once; "
        "an existing name is refused, or left unchanged with --exist-ok); list; "
        "rotate-key: issue a new "
        "signing key, the previous one staying valid until --retire-previous (or for "
        "--previous-valid-s seconds).",
    )
    tenant.add_argument("action", choices=["register", "list", "rotate-key"])
    tenant.add_argument("name", nargs="?")
    tenant.add_argument(
        "--exist-ok",
        action="store_true",
        help="register: an existing tenant is left unchanged and the exit code is 0",
    )
    tenant.add_argument(
        "--no-print-keys",
        action="store_true",
        help="register: do not print the new keys (setup jobs whose output is logged; "
        "issue keys later with rotate-key and the REST API)",
    )
    tenant.add_argument("--create-quota", type=float, help="commands/s (0 = unlimited)")
    tenant.add_argument("--fire-quota", type=int, help="fires/min (0 = unlimited)")
    tenant.add_argument("--max-payload-bytes", type=int)
    tenant.add_argument("--max-horizon-s", type=int)
    tenant.add_argument("--retention-s", type=int, help="keep fired schedules this long")
    tenant.add_argument(
        "--previous-valid-s",
        type=int,
        help="rotate-key: the previous key stays valid this long (default: until retired)",
    )
    tenant.add_argument(
        "--retire-previous",
        action="store_true",
        help="rotate-key: retire the previous key now (no new key is issued)",
    )
    tenant.add_argument("--allow-host", action="append", help="allowed callback host")
    tenant.add_argument("--allow-topic", action="append", help="allowed Kafka callback topic")
    tenant.add_argument(
        "--json", action="store_true", default=argparse.SUPPRESS, help="machine-readable output"
    )
    tenant.set_defaults(func=cmd_tenant)
