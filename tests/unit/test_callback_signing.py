"""Signed callbacks: the header against a vector computed apart (openssl), rotation, tamper
and window checks, the secrets file (parsing, reload, no secret in any message), the HTTP
sender's header on a real local request, the CLI, and the verification examples in
docs/proxy.md, run as written (Python always, Node when it is installed)."""

from __future__ import annotations

import logging
import os
import re
import shutil
import subprocess
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest
from aiohttp import web

from base.errors import ConfigError
from base.settings import Settings
from proxy.app import ProxyApp
from proxy.callback_signing import (
    MAX_FILE_BYTES,
    MAX_SECRETS_PER_TENANT,
    RELOAD_CHECK_S,
    SIGNATURE_HEADER,
    CallbackSigner,
    SecretsFile,
    SignResult,
    VerifyFailure,
    check,
    fingerprint,
    generate_secret,
    parse_secrets,
    sign,
    signer_for,
    write_secrets_file,
)
from proxy.envelope import Envelope, prepare_fire
from proxy.http_sender import HttpSender
from proxy.metrics import ProxyMetrics
from proxy.retry import HttpResult, Undeliverable
from proxy.settings import ProxySettings
from tocsin.cli import main as cli_main
from topics.codec import decode_trigger

ROOT = Path(__file__).resolve().parents[2]
SECRET = "tcs_test_secret_0123456789abcdef"
OLDER = "tcs_older_secret_0123456789abcdef"
BODY = b'{"n":1}'
# Computed apart from this code:
#   printf '1700000000.t-1.{"n":1}' | openssl dgst -sha256 -hmac "$SECRET"
VECTOR = "a750baf8dd11ff9f018e37058cfb3ce6480091241bc9b4c28cf123723e01058e"
VECTOR_OLDER = "1bd82416f08325e2a4390ceb4555dee9276e275e56f2d9477088367bc00b29bf"


def doc_example(language: str) -> str:
    """The fenced block after ``<!-- verify-example:LANG -->`` in docs/proxy.md."""
    text = (ROOT / "docs" / "proxy.md").read_text()
    m = re.search(rf"<!-- verify-example:{language} -->\n```\w+\n(.*?)```", text, re.DOTALL)
    assert m is not None, f"docs/proxy.md has no {language} verification example"
    return m.group(1)


def documented_verify() -> Callable[..., bool]:
    scope: dict[str, Any] = {}
    exec(doc_example("python"), scope)
    verify: Callable[..., bool] = scope["verify"]
    return verify


# ---- the header ----------------------------------------------------------------------------


def test_the_header_matches_a_vector_computed_apart() -> None:
    assert sign([SECRET], 1_700_000_000, "t-1", BODY) == f"t=1700000000,v1={VECTOR}"


def test_during_a_rotation_each_secret_signs_and_either_verifies() -> None:
    header = sign([SECRET, OLDER], 1_700_000_000, "t-1", BODY)
    assert header == f"t=1700000000,v1={VECTOR},v1={VECTOR_OLDER}"
    for secret in (SECRET, OLDER):
        assert check(header, "t-1", BODY, secret, now_s=1_700_000_010) is None
    stranger = "tcs_someone_else_0123456789abcdef"
    assert check(header, "t-1", BODY, stranger, now_s=1_700_000_010) is VerifyFailure.MISMATCH


def test_a_changed_body_trigger_id_or_timestamp_fails() -> None:
    header = sign([SECRET], 1_700_000_000, "t-1", BODY)
    now = 1_700_000_001
    assert check(header, "t-1", b'{"n":2}', SECRET, now_s=now) is VerifyFailure.MISMATCH
    assert check(header, "t-2", BODY, SECRET, now_s=now) is VerifyFailure.MISMATCH
    moved = header.replace("t=1700000000", "t=1700000001")
    assert check(moved, "t-1", BODY, SECRET, now_s=now) is VerifyFailure.MISMATCH
    flipped = header[:-1] + ("0" if header[-1] != "0" else "1")
    assert check(flipped, "t-1", BODY, SECRET, now_s=now) is VerifyFailure.MISMATCH


def test_the_timestamp_window_holds_both_ways() -> None:
    t = 1_700_000_000
    header = sign([SECRET], t, "t-1", BODY)
    assert check(header, "t-1", BODY, SECRET, now_s=t + 300) is None
    assert check(header, "t-1", BODY, SECRET, now_s=t - 300) is None
    assert check(header, "t-1", BODY, SECRET, now_s=t + 301) is VerifyFailure.STALE
    assert check(header, "t-1", BODY, SECRET, now_s=t - 301) is VerifyFailure.STALE


@pytest.mark.parametrize("header", ["", f"v1={VECTOR}", f"t=abc,v1={VECTOR}", f"t=²,v1={VECTOR}"])
def test_a_header_without_a_numeric_timestamp_is_malformed(header: str) -> None:
    assert check(header, "t-1", BODY, SECRET, now_s=1_700_000_000) is VerifyFailure.MALFORMED


def hostile_headers(now: int) -> list[str]:
    """Headers anyone who reaches a receiver can send: each must be refused, not raise."""
    good = sign([SECRET], now, "t-1", BODY)
    return [
        f"t={now},v1=\u00e9" + VECTOR[1:],  # non-ASCII: compare_digest raises on a str
        f"t={now},v1=\udcff",  # what a surrogateescape header decoding gives
        "t=" + "9" * 5000 + f",v1={VECTOR}",  # int() refuses more than 4,300 digits
        good.replace(f"t={now}", "t=" + "".join(chr(0x660 + int(d)) for d in str(now))),
    ]


def test_a_hostile_header_is_refused_without_raising() -> None:
    now = 1_700_000_000
    answers = [check(h, "t-1", BODY, SECRET, now_s=now) for h in hostile_headers(now)]
    assert answers == [
        VerifyFailure.MISMATCH,
        VerifyFailure.MISMATCH,
        VerifyFailure.MALFORMED,
        VerifyFailure.MALFORMED,
    ]


def test_generated_secrets_are_long_random_and_accepted_by_the_file() -> None:
    a, b = generate_secret(), generate_secret()
    assert a != b and len(a) >= 40
    assert parse_secrets(orjson.dumps({"acme": [a, b]})) == {"acme": (a, b)}
    assert re.fullmatch(r"[0-9a-f]{12}", fingerprint(a))


# ---- the documented examples ----------------------------------------------------------------


def test_the_documented_python_example_verifies_what_the_proxy_signs() -> None:
    verify = documented_verify()
    now = int(time.time())
    rotating = sign([SECRET, OLDER], now, "t-1", BODY)
    assert verify(rotating, "t-1", BODY, SECRET)
    assert verify(rotating, "t-1", BODY, OLDER)
    assert not verify(rotating, "t-1", BODY, "tcs_someone_else_0123456789abcdef")
    assert not verify(rotating, "t-1", BODY + b" ", SECRET)
    assert not verify(rotating, "t-2", BODY, SECRET)
    assert not verify(sign([SECRET], now - 301, "t-1", BODY), "t-1", BODY, SECRET)
    assert not verify(sign([SECRET], now + 301, "t-1", BODY), "t-1", BODY, SECRET)
    assert not verify(f"v1={VECTOR}", "t-1", BODY, SECRET)
    for hostile in hostile_headers(now):
        assert verify(hostile, "t-1", BODY, SECRET) is False, hostile[:40]


def test_the_documented_vector_is_the_one_computed_apart() -> None:
    text = " ".join((ROOT / "docs" / "proxy.md").read_text().split())
    assert (
        f"secret `{SECRET}`, `t=1700000000`, trigger id `t-1`, body `{BODY.decode()}` "
        f"({len(BODY)} bytes) give `v1={VECTOR}`"
    ) in text
    verify = documented_verify()
    assert verify(f"t=1700000000,v1={VECTOR}", "t-1", BODY, SECRET, window_s=10**10)


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_the_documented_node_example_verifies_what_the_proxy_signs() -> None:
    now = int(time.time())
    cases = [
        (sign([SECRET, OLDER], now, "t-1", BODY), "t-1", BODY, OLDER, True),
        (sign([SECRET], now, "t-1", BODY), "t-1", BODY, SECRET, True),
        (sign([SECRET], now, "t-1", BODY), "t-1", b'{"n":2}', SECRET, False),
        (sign([SECRET], now, "t-1", BODY), "t-2", BODY, SECRET, False),
        (sign([SECRET], now - 301, "t-1", BODY), "t-1", BODY, SECRET, False),
        (f"v1={VECTOR}", "t-1", BODY, SECRET, False),
    ]
    # All but the lone surrogate, which JSON cannot carry to node.
    cases += [(h, "t-1", BODY, SECRET, False) for h in hostile_headers(now) if "\udcff" not in h]
    program = doc_example("node") + (
        "const cases = JSON.parse(process.argv[1]);\n"
        "console.log(JSON.stringify(cases.map(([h, id, b, s]) =>"
        " verify(h, id, Buffer.from(b, 'latin1'), s))));\n"
    )
    arg = orjson.dumps([[h, i, b.decode("latin-1"), s] for h, i, b, s, _ in cases]).decode()
    out = subprocess.run(
        ["node", "-e", program, arg], capture_output=True, text=True, timeout=60, check=True
    )
    assert orjson.loads(out.stdout) == [want for *_, want in cases]


# ---- the secrets file -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("doc", "says"),
    [
        (b"{not json", "not JSON"),
        (b'["x"]', "must be a JSON object"),
        (orjson.dumps({"bad tenant": [SECRET]}), "bad tenant"),
        (orjson.dumps({"acme": []}), "non-empty list"),
        (orjson.dumps({"acme": SECRET}), "non-empty list"),
        (orjson.dumps({"acme": ["tcs_short_secret"]}), "secret #0 must be a string of"),
        (orjson.dumps({"acme": [SECRET, 7]}), "secret #1"),
        (orjson.dumps({"acme": [SECRET + "\n"]}), "printable ASCII"),
        (orjson.dumps({"acme": [SECRET, SECRET]}), "one secret twice"),
        (
            orjson.dumps({"acme": [f"{SECRET}{i}" for i in range(MAX_SECRETS_PER_TENANT + 1)]}),
            f"at most {MAX_SECRETS_PER_TENANT}",
        ),
        (b" " * (MAX_FILE_BYTES + 1), "bytes; at most"),
    ],
)
def test_a_bad_file_is_refused_naming_the_place_never_the_secret(doc: bytes, says: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_secrets(doc)
    assert says in str(err.value)
    for leaked in ("tcs_", SECRET):
        assert leaked not in str(err.value)


def write(path: Path, doc: dict[str, list[str]]) -> None:
    write_secrets_file(path, doc)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_file_is_reread_when_it_changes_and_only_then(tmp_path: Path) -> None:
    path = tmp_path / "secrets.json"
    write(path, {"acme": [OLDER]})
    clock = Clock()
    reloads: list[tuple[bool, int]] = []
    keys = SecretsFile(path, monotonic=clock, on_reload=lambda ok, n: reloads.append((ok, n)))
    keys.load()
    assert keys.secrets_for("acme") == (OLDER,)
    assert keys.secrets_for("globex") == ()
    write(path, {"acme": [SECRET, OLDER], "globex": [SECRET]})
    # Not looked at again before the check interval has passed.
    assert keys.secrets_for("acme") == (OLDER,)
    clock.now += RELOAD_CHECK_S
    assert keys.secrets_for("acme") == (SECRET, OLDER)
    assert keys.secrets_for("globex") == (SECRET,)
    assert reloads == [(True, 1), (True, 2)]
    clock.now += RELOAD_CHECK_S
    keys.secrets_for("acme")
    assert reloads == [(True, 1), (True, 2)]  # unchanged file: not read again


def test_a_bad_new_version_keeps_the_last_good_secrets_and_logs_no_secret(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "secrets.json"
    write(path, {"acme": [SECRET]})
    clock = Clock()
    reloads: list[tuple[bool, int]] = []
    keys = SecretsFile(path, monotonic=clock, on_reload=lambda ok, n: reloads.append((ok, n)))
    keys.load()
    path.write_text(f'{{"acme": ["{OLDER}", "{OLDER}"]}}')  # invalid: one secret twice
    clock.now += RELOAD_CHECK_S
    with caplog.at_level(logging.INFO, logger="tocsin.proxy"):
        assert keys.secrets_for("acme") == (SECRET,)
    assert reloads[-1] == (False, 1)
    logged = " ".join(f"{r.getMessage()} {r.__dict__}" for r in caplog.records)
    assert "keeping the previous secrets" in logged
    assert OLDER not in logged and SECRET not in logged
    path.unlink()  # gone (a Secret being replaced, or unmounted): keep signing
    clock.now += RELOAD_CHECK_S
    assert keys.secrets_for("acme") == (SECRET,)


def test_a_version_that_could_not_be_read_is_read_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A read failure (out of descriptors, or permissions fixed with chmod, which changes
    neither inode, size nor mtime) is not the file's fault: the same version is tried again
    at the next look, and reported once."""
    path = tmp_path / "secrets.json"
    write(path, {"acme": [OLDER]})
    clock = Clock()
    reloads: list[tuple[bool, int]] = []
    keys = SecretsFile(path, monotonic=clock, on_reload=lambda ok, n: reloads.append((ok, n)))
    keys.load()
    write(path, {"acme": [SECRET]})
    real_open = Path.open

    def no_descriptors(self: Path, *args: Any, **kwargs: Any) -> Any:
        raise OSError(24, "Too many open files")

    monkeypatch.setattr(Path, "open", no_descriptors)
    with caplog.at_level(logging.ERROR, logger="tocsin.proxy"):
        for _ in range(2):
            clock.now += RELOAD_CHECK_S
            assert keys.secrets_for("acme") == (OLDER,)
    assert len(caplog.records) == 1 and "Too many open files" in caplog.records[
        0
    ].getMessage() + str(caplog.records[0].__dict__)
    monkeypatch.setattr(Path, "open", real_open)
    clock.now += RELOAD_CHECK_S
    assert keys.secrets_for("acme") == (SECRET,)
    assert reloads == [(True, 1), (False, 1), (True, 1)]


def test_the_file_is_written_whole_and_private(tmp_path: Path) -> None:
    path = tmp_path / "secrets.json"
    write(path, {"acme": [SECRET]})
    assert os.stat(path).st_mode & 0o777 == 0o600
    assert parse_secrets(path.read_bytes()) == {"acme": (SECRET,)}
    with pytest.raises(ConfigError):
        write(path, {"acme": ["short"]})
    assert parse_secrets(path.read_bytes()) == {"acme": (SECRET,)}
    assert [p.name for p in tmp_path.iterdir()] == ["secrets.json"]


def test_the_signer_signs_refuses_or_leaves_unsigned() -> None:
    keys = SecretsFile(Path("/nonexistent"), monotonic=lambda: 0.0)
    keys._by_tenant = {"acme": (SECRET,)}
    keys._next_check = float("inf")
    optional = CallbackSigner(keys=keys, clock_s=lambda: 1_700_000_000.9)
    signed = optional.sign("acme", "t-1", BODY)
    assert signed.result is SignResult.SIGNED and signed.header == f"t=1700000000,v1={VECTOR}"
    assert optional.sign("globex", "t-1", BODY).result is SignResult.UNSIGNED
    required = replace(optional, required=True)
    assert required.sign("globex", "t-1", BODY).result is SignResult.REFUSED
    assert CallbackSigner(keys=None).sign("acme", "t-1", BODY).result is SignResult.UNSIGNED


# ---- settings and start -------------------------------------------------------------------


def test_settings_read_the_signing_variables_and_refuse_what_cannot_work(tmp_path: Path) -> None:
    s = ProxySettings.from_env(
        {
            "TOCSIN_PROXY_SIGNING_SECRETS_FILE": "/etc/tocsin/callback-signing/secrets.json",
            "TOCSIN_PROXY_REQUIRE_SIGNATURE": "true",
        }
    )
    assert s.signing_secrets_file.endswith("secrets.json") and s.require_signature
    with pytest.raises(ConfigError, match="needs TOCSIN_PROXY_SIGNING_SECRETS_FILE"):
        ProxySettings(require_signature=True)
    with pytest.raises(ConfigError, match="fires mode only"):
        ProxySettings(
            mode="generic", source_topic="t", endpoint_url="http://x/", signing_secrets_file="f"
        )


def test_a_proxy_with_a_missing_or_bad_secrets_file_does_not_start(tmp_path: Path) -> None:
    missing = ProxySettings(signing_secrets_file=str(tmp_path / "none.json"), metrics_port=0)
    with pytest.raises(ConfigError, match="cannot read the secrets file"):
        ProxyApp(Settings.from_env({}), missing)
    bad = tmp_path / "bad.json"
    bad.write_text('{"acme": ["short"]}')
    with pytest.raises(ConfigError, match="secret #0"):
        ProxyApp(Settings.from_env({}), replace(missing, signing_secrets_file=str(bad)))


def test_signer_for_reports_the_tenants_in_use(tmp_path: Path) -> None:
    path = tmp_path / "secrets.json"
    write(path, {"acme": [SECRET], "globex": [OLDER]})
    metrics = ProxyMetrics()
    signer = signer_for(ProxySettings(signing_secrets_file=str(path)), metrics)
    assert signer.keys is not None and signer.keys.tenants == 2
    assert metrics.registry.get_sample_value("tocsin_proxy_signing_tenants") == 2
    assert metrics.registry.get_sample_value("tocsin_proxy_signing_file_stale") == 0


# ---- the HTTP sender ----------------------------------------------------------------------


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[str, list[web.Request], list[bytes]]]:
    seen: list[web.Request] = []
    bodies: list[bytes] = []

    async def hook(request: web.Request) -> web.Response:
        seen.append(request)
        bodies.append(await request.read())
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/hook", hook)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    yield f"http://127.0.0.1:{port}/hook", seen, bodies
    await runner.cleanup()


def fire(url: str, tenant: str, headers: dict[str, str] | None = None) -> Envelope:
    doc = {
        "trigger_id": f"t-{tenant}",
        "schedule_id": "s1",
        "tenant": tenant,
        "due_ms": 1_700_000_000_000,
        "emitted_ms": 1_700_000_000_005,
        "attempt": 1,
        "order_key": "s1",
        "payload": {"n": 1},
        "callback": {"type": "http", "url": url, "headers": headers or {}, "timeout_s": 5},
    }
    e = Envelope(
        topic="fires",
        partition=0,
        offset=0,
        key=b"s1",
        value=orjson.dumps(doc),
        headers=[],
        timestamp_ms=None,
        read_s=time.monotonic(),
    )
    prepare_fire(e, decode_trigger)
    assert e.request is not None, e.invalid
    return e


async def test_each_fires_request_carries_a_signature_the_documented_code_verifies(
    tmp_path: Path, receiver: tuple[str, list[web.Request], list[bytes]]
) -> None:
    url, seen, bodies = receiver
    path = tmp_path / "secrets.json"
    write(path, {"acme": [SECRET, OLDER]})
    settings = ProxySettings(signing_secrets_file=str(path), metrics_port=0)
    metrics = ProxyMetrics()
    verify = documented_verify()
    async with HttpSender(settings, metrics, guard=False) as s:
        # A header of that name in the callback's own is replaced by the proxy's.
        forged = fire(url, "acme", headers={"Tocsin-Signature": "t=1,v1=00"})
        assert await s.send(forged) == HttpResult(status=200)
        assert await s.send(fire(url, "globex", headers={"tocsin-signature": "t=1"})) == (
            HttpResult(status=200)
        )
    acme, globex = seen
    assert acme.headers.getall(SIGNATURE_HEADER) == [acme.headers[SIGNATURE_HEADER]]
    for secret in (SECRET, OLDER):
        assert verify(acme.headers[SIGNATURE_HEADER], acme.headers["Tocsin-Trigger-Id"],
                      bodies[0], secret)  # fmt: skip
    assert SIGNATURE_HEADER not in globex.headers  # no secret: unsigned
    samples = {
        r: metrics.registry.get_sample_value("tocsin_proxy_signatures_total", {"result": r})
        for r in ("signed", "unsigned", "refused")
    }
    assert samples == {"signed": 1.0, "unsigned": 1.0, "refused": 0.0}


async def test_a_required_signature_without_a_secret_is_undeliverable_and_never_sent(
    tmp_path: Path, receiver: tuple[str, list[web.Request], list[bytes]]
) -> None:
    url, seen, _ = receiver
    path = tmp_path / "secrets.json"
    write(path, {"acme": [SECRET]})
    settings = ProxySettings(signing_secrets_file=str(path), require_signature=True, metrics_port=0)
    async with HttpSender(settings, ProxyMetrics(), guard=False) as s:
        result = await s.send(fire(url, "globex"))
        assert await s.send(fire(url, "acme")) == HttpResult(status=200)
    assert isinstance(result, Undeliverable)
    assert result.detail.startswith("unsigned: no delivery secret for tenant 'globex'")
    assert len(seen) == 1 and seen[0].headers["Tocsin-Tenant"] == "acme"


# ---- the command line ---------------------------------------------------------------------


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str]:
    code = cli_main(list(argv))
    return code, capsys.readouterr().out


def test_the_cli_generates_rotates_lists_signs_and_retires(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(tmp_path / "secrets.json")
    code, out = run_cli(capsys, "proxy", "secret", "generate", "--json")
    doc = orjson.loads(out)
    assert code == 0 and doc["fingerprint"] == fingerprint(doc["secret"])
    code, out = run_cli(capsys, "proxy", "secret", "rotate", path, "acme")
    first = out.strip()
    code, out = run_cli(capsys, "--json", "proxy", "secret", "rotate", path, "acme")
    second = orjson.loads(out)["secret"]
    assert code == 0 and parse_secrets(Path(path).read_bytes()) == {"acme": (second, first)}
    code, out = run_cli(capsys, "proxy", "secret", "list", path, "--json")
    assert orjson.loads(out) == [
        {
            "tenant": "acme",
            "secrets": 2,
            "fingerprints": f"{fingerprint(second)} {fingerprint(first)}",
        }
    ]
    assert first not in out and second not in out
    body = tmp_path / "body"
    body.write_bytes(BODY)
    code, out = run_cli(
        capsys, "proxy", "secret", "sign", path, "acme", "--trigger-id", "t-1",
        "--body-file", str(body), "--json",
    )  # fmt: skip
    assert orjson.loads(out) == {
        "header": SIGNATURE_HEADER,
        "value": sign([second, first], int(orjson.loads(out)["value"][2:12]), "t-1", BODY),
    }
    assert documented_verify()(orjson.loads(out)["value"], "t-1", BODY, first)
    code, out = run_cli(capsys, "proxy", "secret", "retire", path, "acme", "--json")
    assert orjson.loads(out) == {
        "tenant": "acme",
        "retired": [fingerprint(first)],
        "kept": [fingerprint(second)],
    }
    assert parse_secrets(Path(path).read_bytes()) == {"acme": (second,)}
    assert run_cli(capsys, "proxy", "secret", "retire", path, "nobody")[0] == 3
    assert run_cli(capsys, "proxy", "secret", "retire", path, "acme", "--all")[0] == 0
    assert parse_secrets(Path(path).read_bytes()) == {}
