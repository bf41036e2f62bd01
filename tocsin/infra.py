"""The local single-node stack: Apache Kafka (KRaft) and Apache Cassandra from Maven Central.

Jars are resolved with Maven from one small pom per server (infra/kafka, infra/cassandra;
kept apart because their netty/guava/jackson versions clash) and cached under the state
folder, keyed by the pom's hash, so a second run never downloads. Servers run on the
machine's Java 17 with data, logs and pid files under ``.state/`` (git-ignored).

``up`` is idempotent (a running, ready server is left alone), ``down`` leaves nothing
running, and readiness means really ready: a Kafka metadata request lists the broker and
Cassandra answers ``SELECT release_version FROM system.local``. A server that dies or does
not become ready in time raises InfraError with the tail of its log; this module never hangs.

It must never touch a server it did not start (it only signals pids from its own pid files).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import tarfile
import threading
import time
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path
from string import Template

from confluent_kafka.admin import AdminClient

from base.errors import InfraError
from base.settings import REPO_ROOT, CassandraSettings, Settings, StackSettings

log = logging.getLogger("tocsin.infra")

INFRA_DIR = REPO_ROOT / "infra"
_LOG_TAIL_LINES = 40


@dataclass(frozen=True)
class ServerStatus:
    name: str
    pid: int | None
    running: bool
    ready: bool
    port: int
    detail: str = ""


# ----------------------------------------------------------------------------- helpers


def _tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    if not path.exists():
        return f"(no log at {path})"
    with path.open("rb") as fh:
        fh.seek(0, os.SEEK_END)
        size = fh.tell()
        fh.seek(max(0, size - 64 * 1024))
        text = fh.read().decode("utf-8", "replace")
    return "\n".join(text.splitlines()[-lines:])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie child still answers kill(0); check its state.
    stat = Path(f"/proc/{pid}/stat")
    if stat.exists():
        with contextlib.suppress(OSError, IndexError):
            if stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                return False
    return True


def _proc_start_ticks(pid: int) -> int | None:
    """The process's start time in clock ticks since boot (/proc/PID/stat field 22): with
    the pid, it names one process for good, since a pid is reused but never with the same
    start time."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


def _proc_cmdline(pid: int) -> str:
    try:
        return (
            Path(f"/proc/{pid}/cmdline")
            .read_bytes()
            .replace(b"\0", b" ")
            .decode("utf-8", "replace")
        )
    except OSError:
        return ""


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def broker_registered(host: str, port: int, *, node_id: int) -> bool:
    """The Kafka node at ``host:port`` answers and lists ``node_id`` among the brokers (so
    a controller quorum exists)."""
    if not port_open(port, host):
        return False
    admin = AdminClient(
        {"bootstrap.servers": f"{host}:{port}", "socket.connection.setup.timeout.ms": 2000}
    )
    try:
        meta = admin.list_topics(timeout=3)
    except Exception:
        return False
    return node_id in meta.brokers


def cassandra_node_answers(host: str, port: int) -> bool:
    """The Cassandra node at ``host:port`` answers a query itself (not through another
    node of its cluster)."""
    if not port_open(port, host):
        return False
    # Imported here: tocsin.cli imports this module for every command, and these load the
    # Cassandra driver.
    from cassandra.policies import WhiteListRoundRobinPolicy

    from base.cassandra import make_cluster

    cluster = make_cluster(
        CassandraSettings(contact_points=(host,), port=port, request_timeout_s=5),
        profile={"load_balancing_policy": WhiteListRoundRobinPolicy([host])},
        connect_timeout=3,
        control_connection_timeout=3,
    )
    try:
        session = cluster.connect()
        row = session.execute("SELECT release_version FROM system.local", timeout=5).one()
        return row is not None
    except Exception:
        return False
    finally:
        cluster.shutdown()


def find_java(stack: StackSettings) -> str:
    """A Java 17..23 binary: Cassandra 5.0 calls System.setSecurityManager (gone in 24)."""
    candidates: list[str] = []
    if stack.java_home:
        candidates.append(str(Path(stack.java_home) / "bin" / "java"))
    candidates += [
        "/usr/lib/jvm/java-17-openjdk-amd64/bin/java",
        "/usr/lib/jvm/java-17-openjdk-arm64/bin/java",
    ]
    on_path = shutil.which("java")
    if on_path:
        candidates.append(on_path)
    seen: list[str] = []
    for java in candidates:
        if not Path(java).exists() or java in seen:
            continue
        seen.append(java)
        out = subprocess.run([java, "-version"], capture_output=True, text=True).stderr
        match = re.search(r'version "(\d+)', out)
        if match and 17 <= int(match.group(1)) < 24:
            return java
    raise InfraError(
        "no Java 17-23 found (tried: " + ", ".join(seen or candidates) + "); install OpenJDK 17 "
        "or set JAVA_HOME. Cassandra 5.0 does not run on Java 24+."
    )


def _render(template: Path, target: Path, **values: object) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    text = Template(template.read_text()).substitute({k: str(v) for k, v in values.items()})
    target.write_text(text)


# ----------------------------------------------------------------------------- jars


# Maven itself, fetched from Maven Central when no ``mvn`` is on PATH: pinned, and checked
# against the SHA-512 Maven Central publishes for it.
MAVEN_VERSION = "3.9.11"
MAVEN_SHA512 = (
    "bcfe4fe305c962ace56ac7b5fc7a08b87d5abd8b7e89027ab251069faebee516"
    "b0ded8961445d6d91ec1985dfe30f8153268843c89aa392733d1a3ec956c9978"
)
MAVEN_URL = (
    "https://repo.maven.apache.org/maven2/org/apache/maven/apache-maven/"
    f"{MAVEN_VERSION}/apache-maven-{MAVEN_VERSION}-bin.tar.gz"
)
_MAVEN_FETCH_TIMEOUT_S = 60.0


def find_maven(cache: Path) -> str:
    """``mvn`` on PATH, else Maven ``MAVEN_VERSION`` unpacked under ``cache`` (fetched from
    Maven Central the first time). Raises InfraError saying what to install if it cannot."""
    on_path = shutil.which("mvn")
    if on_path is not None:
        return on_path
    home = cache / f"apache-maven-{MAVEN_VERSION}"
    mvn = home / "bin" / "mvn"
    if mvn.is_file():
        return str(mvn)
    print(
        f"[infra] Maven (mvn) is not on PATH: fetching Maven {MAVEN_VERSION} from Maven "
        f"Central into {home} (first run only)...",
        flush=True,
    )
    cache.mkdir(parents=True, exist_ok=True)
    work = cache / f".maven-{uuid.uuid4().hex[:8]}"
    work.mkdir()
    try:
        archive = work / "maven.tar.gz"
        digest = hashlib.sha512()
        try:
            with (
                urllib.request.urlopen(MAVEN_URL, timeout=_MAVEN_FETCH_TIMEOUT_S) as response,
                archive.open("wb") as out,
            ):
                while chunk := response.read(1 << 16):
                    digest.update(chunk)
                    out.write(chunk)
        except OSError as exc:
            raise InfraError(
                f"Maven (mvn) is not on PATH and could not be fetched from {MAVEN_URL}: "
                f"{exc}; install Maven 3 (e.g. apt-get install maven) and retry"
            ) from exc
        if digest.hexdigest() != MAVEN_SHA512:
            raise InfraError(
                f"Maven from {MAVEN_URL} does not have the pinned SHA-512; not using it "
                "(install Maven 3, e.g. apt-get install maven, and retry)"
            )
        with tarfile.open(archive) as tar:
            tar.extractall(work, filter="data")
        unpacked = work / f"apache-maven-{MAVEN_VERSION}"
        if not (unpacked / "bin" / "mvn").is_file():
            raise InfraError(f"the Maven archive from {MAVEN_URL} holds no bin/mvn")
        # Rename into place: a concurrent fetch (another stack) that won leaves its copy.
        with contextlib.suppress(OSError):
            unpacked.rename(home)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if not mvn.is_file():
        raise InfraError(f"Maven could not be unpacked into {home}")
    return str(mvn)


def resolve_jars(
    name: str, state_dir: Path, jars_dir: Path | None = None, *, java: str | None = None
) -> Path:
    """Resolve the server's jars with Maven into a folder keyed by the pom's hash.

    The cache is ``jars_dir`` (TOCSIN_JARS_DIR) if given, else ``state_dir/jars``; a Maven
    fetched because none is on PATH lives there too. ``java``: the binary the servers run
    on; Maven runs on it when JAVA_HOME is not set (a fetched Maven finds no other).
    """
    pom = INFRA_DIR / name / "pom.xml"
    digest = hashlib.sha256(pom.read_bytes()).hexdigest()[:12]
    cache = jars_dir or state_dir / "jars"
    target = cache / f"{name}-{digest}"
    marker = target / ".complete"
    if marker.exists():
        return target
    mvn = find_maven(cache)
    log.info("resolving jars", extra={"server": name, "target": str(target)})
    print(f"[infra] resolving {name} jars from Maven Central (first run only)...", flush=True)
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    started = time.monotonic()
    proc = subprocess.run(
        [
            mvn,
            "-q",
            "-B",
            "-f",
            str(pom),
            "dependency:copy-dependencies",
            f"-DoutputDirectory={target}",
            "-DincludeScope=runtime",
        ],
        capture_output=True,
        text=True,
        env=_maven_env(java),
    )
    if proc.returncode != 0 or not any(target.glob("*.jar")):
        shutil.rmtree(target, ignore_errors=True)
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-_LOG_TAIL_LINES:])
        raise InfraError(f"Maven could not resolve the {name} jars:\n{tail}")
    marker.write_text(f"resolved in {time.monotonic() - started:.1f}s\n")
    return target


def _maven_env(java: str | None) -> dict[str, str]:
    env = dict(os.environ)
    if java and not env.get("JAVA_HOME"):
        env["JAVA_HOME"] = str(Path(java).resolve().parent.parent)
    return env


# ----------------------------------------------------------------------------- servers


def ports_taken_message(taken: list[tuple[int, str]]) -> str:
    lines = [f"  port {port} ({var})" for port, var in taken]
    return (
        "ports taken by processes this stack did not start:\n" + "\n".join(lines) + "\n"
        "stop them, set the variables named to free ports, or set TOCSIN_PORT_OFFSET=N to "
        "move every port of the stack, worker, proxy and API by N"
    )


def _wait_gone(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _pid_alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


class _Server:
    name: str
    port: int

    @property
    def jar_set(self) -> str:
        """Which pom under infra/ this server's jars come from: a cluster's nodes share
        their server's jars under their own names."""
        return self.name

    def __init__(self, stack: StackSettings) -> None:
        self.stack = stack
        self.home = stack.state_dir / self.name
        self.pid_file = self.home / "server.pid"
        self.console_log = self.home / "logs" / "console.log"

    # subclasses
    def _prepare(self, jars: Path) -> None:
        raise NotImplementedError

    def _command(self, java: str, jars: Path) -> list[str]:
        raise NotImplementedError

    def ready(self) -> bool:
        raise NotImplementedError

    def ports(self) -> list[tuple[int, str]]:
        """Every port the server listens on, with the variable that moves it."""
        raise NotImplementedError

    def taken_ports(self) -> list[tuple[int, str]]:
        return [(port, var) for port, var in self.ports() if port_open(port)]

    @property
    def main_log(self) -> Path:
        raise NotImplementedError

    # shared lifecycle
    def pid(self) -> int | None:
        """The pid of the server this stack started, or None: the pid file's pid counts only
        while that process is alive, has the start time recorded with it and runs with this
        server's home folder on its command line. A stale file whose pid the system gave to
        another process must never get that process signalled."""
        try:
            words = self.pid_file.read_text().split()
            pid = int(words[0])
            started = int(words[1]) if len(words) > 1 else None
        except (OSError, ValueError, IndexError):
            return None
        if not _pid_alive(pid):
            return None
        if started is not None and _proc_start_ticks(pid) != started:
            return None
        if str(self.home) not in _proc_cmdline(pid):
            return None
        return pid

    def running(self) -> bool:
        return self.pid() is not None

    def status(self) -> ServerStatus:
        running = self.running()
        ready = running and self.ready()
        return ServerStatus(self.name, self.pid(), running, ready, self.port)

    def start(self, java: str) -> float:
        """Start (or adopt a running) server; return seconds until ready (0.0 if it was)."""
        if self.running():
            if self.ready():
                return 0.0
            return self._wait_ready(time.monotonic())
        if taken := self.taken_ports():
            raise InfraError(ports_taken_message(taken))
        jars = resolve_jars(self.jar_set, self.stack.state_dir, self.stack.jars_dir, java=java)
        try:
            (self.home / "logs").mkdir(parents=True, exist_ok=True)
            self._prepare(jars)
        except OSError as exc:
            raise InfraError(f"cannot prepare {self.name} under {self.home}: {exc}") from exc
        cmd = self._command(java, jars)
        started = time.monotonic()
        with self.console_log.open("ab") as out:
            # A new session: the server outlives this command and ignores our Ctrl-C.
            proc = subprocess.Popen(
                cmd,
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.home,
                start_new_session=True,
            )
        self.pid_file.write_text(f"{proc.pid} {_proc_start_ticks(proc.pid) or ''}".strip() + "\n")
        # Reap the child if it exits while we are still here (avoids zombie false-alive).
        threading.Thread(target=proc.wait, daemon=True).start()
        return self._wait_ready(started, proc)

    def _wait_ready(self, started: float, proc: subprocess.Popen[bytes] | None = None) -> float:
        """``proc``: the server this call started, whose exit status then says whether it
        exited: ``running()``'s pid-file check judged a restarted broker that was busy
        recovering its logs gone while it ran on."""
        deadline = started + self.stack.start_timeout_s
        next_note = time.monotonic() + 15
        while time.monotonic() < deadline:
            if (proc.poll() is not None) if proc is not None else not self.running():
                raise InfraError(
                    f"{self.name} exited during start-up; last lines of {self.main_log}:\n"
                    f"{_tail(self.main_log)}\n--- {self.console_log}:\n{_tail(self.console_log)}"
                )
            if self.ready():
                return time.monotonic() - started
            if time.monotonic() > next_note:
                print(
                    f"[infra] waiting for {self.name} ({time.monotonic() - started:.0f}s)...",
                    flush=True,
                )
                next_note = time.monotonic() + 15
            time.sleep(0.5)
        self.stop()
        raise InfraError(
            f"{self.name} was not ready after {self.stack.start_timeout_s:.0f}s; stopped it. "
            f"Last lines of {self.main_log}:\n{_tail(self.main_log)}"
        )

    def stop(self, timeout_s: float = 60.0, kill_timeout_s: float = 15.0) -> bool:
        pid = self.pid()
        if pid is None:
            if self.pid_file.exists():
                log.info("stale pid file, nothing signalled", extra={"server": self.name})
            self.pid_file.unlink(missing_ok=True)
            return False
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGTERM)
        if not _wait_gone(pid, timeout_s):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(pid, signal.SIGKILL)
            if not _wait_gone(pid, kill_timeout_s):
                raise InfraError(
                    f"{self.name} (pid {pid}) is still alive {kill_timeout_s:.0f}s after "
                    "SIGKILL (a process stuck in the kernel); its pid file is kept"
                )
        self.pid_file.unlink(missing_ok=True)
        return True


class KafkaServer(_Server):
    name = "kafka"

    def ports(self) -> list[tuple[int, str]]:
        return [
            (self.stack.kafka_port, "TOCSIN_KAFKA_PORT"),
            (self.stack.kafka_controller_port, "TOCSIN_KAFKA_CONTROLLER_PORT"),
        ]

    def __init__(self, stack: StackSettings) -> None:
        super().__init__(stack)
        self.port = stack.kafka_port
        self.config = self.home / "config" / "server.properties"
        self.data_dir = self.home / "data"

    @property
    def main_log(self) -> Path:
        return self.home / "logs" / "server.log"

    def _prepare(self, jars: Path) -> None:
        _render(
            INFRA_DIR / "kafka" / "server.properties.in",
            self.config,
            port=self.stack.kafka_port,
            controller_port=self.stack.kafka_controller_port,
            data_dir=self.data_dir,
        )
        shutil.copy(INFRA_DIR / "kafka" / "log4j2.properties", self.home / "config")
        if (self.data_dir / "meta.properties").exists():
            return
        # KRaft storage is formatted once per data folder with a fresh cluster id.
        java = find_java(self.stack)
        cluster_id = kafka_cluster_id()
        proc = subprocess.run(
            [
                java,
                *self._jvm_base(jars),
                "kafka.tools.StorageTool",
                "format",
                f"--cluster-id={cluster_id}",
                "-c",
                str(self.config),
            ],
            capture_output=True,
            text=True,
            cwd=self.home,
        )
        if proc.returncode != 0:
            raise InfraError(f"formatting Kafka storage failed:\n{proc.stdout}{proc.stderr}")

    def _jvm_base(self, jars: Path) -> list[str]:
        return [
            "-cp",
            f"{jars}/*",
            f"-Dlog4j2.configurationFile=file:{self.home / 'config' / 'log4j2.properties'}",
            f"-Dkafka.logs.dir={self.home / 'logs'}",
        ]

    def _command(self, java: str, jars: Path) -> list[str]:
        heap = self.stack.kafka_heap_mib
        return [
            java,
            f"-Xms{heap}m",
            f"-Xmx{heap}m",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=20",
            "-Djava.awt.headless=true",
            *self._jvm_base(jars),
            "kafka.Kafka",
            str(self.config),
        ]

    def ready(self) -> bool:
        return broker_registered("127.0.0.1", self.port, node_id=1)


def kafka_cluster_id() -> str:
    # Kafka wants a base64url-encoded 16-byte uuid (what `kafka-storage random-uuid` prints).
    return base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")


class CassandraServer(_Server):
    name = "cassandra"

    def ports(self) -> list[tuple[int, str]]:
        return [
            (self.stack.cassandra_port, "TOCSIN_CASSANDRA_PORT"),
            (self.stack.cassandra_storage_port, "TOCSIN_CASSANDRA_STORAGE_PORT"),
        ]

    def __init__(self, stack: StackSettings) -> None:
        super().__init__(stack)
        self.port = stack.cassandra_port
        self.config = self.home / "config" / "cassandra.yaml"
        self.data_dir = self.home / "data"

    @property
    def main_log(self) -> Path:
        return self.home / "logs" / "system.log"

    def _prepare(self, jars: Path) -> None:
        _render(
            INFRA_DIR / "cassandra" / "cassandra.yaml.in",
            self.config,
            port=self.stack.cassandra_port,
            storage_port=self.stack.cassandra_storage_port,
            data_dir=self.data_dir,
        )
        shutil.copy(INFRA_DIR / "cassandra" / "logback.xml", self.home / "config")
        (self.home / "triggers").mkdir(exist_ok=True)
        for sub in ("data", "commitlog", "saved_caches", "hints", "cdc_raw"):
            (self.data_dir / sub).mkdir(parents=True, exist_ok=True)

    def _command(self, java: str, jars: Path) -> list[str]:
        heap = self.stack.cassandra_heap_mib
        jamm = next(jars.glob("jamm-*.jar"), None)
        if jamm is None:
            raise InfraError(f"no jamm agent jar in {jars}; Cassandra cannot start without it")
        opts = [
            line.strip()
            for line in (INFRA_DIR / "cassandra" / "jvm17.options").read_text().splitlines()
            if line.strip() and not line.startswith("#")
        ]
        args: list[str] = []
        for opt in opts:
            args += opt.split(" ", 1)
        return [
            java,
            f"-Xms{heap}m",
            f"-Xmx{heap}m",
            "-Xss512k",
            "-XX:+UseG1GC",
            "-XX:MaxGCPauseMillis=50",
            "-XX:+HeapDumpOnOutOfMemoryError",
            f"-XX:HeapDumpPath={self.home / 'logs'}",
            "-Djava.awt.headless=true",
            f"-javaagent:{jamm}",
            "-Djdk.attach.allowAttachSelf=true",
            *args,
            f"-Dcassandra.config=file://{self.config}",
            "-Dcassandra-foreground=yes",
            f"-Dcassandra.storagedir={self.data_dir}",
            f"-Dcassandra.logdir={self.home / 'logs'}",
            f"-Dlogback.configurationFile=file://{self.home / 'config' / 'logback.xml'}",
            f"-Dcassandra.triggers_dir={self.home / 'triggers'}",
            "-Dcassandra.skip_wait_for_gossip_to_settle=0",
            "-Dcassandra.superuser_setup_delay_ms=0",
            "-cp",
            f"{jars}/*",
            "org.apache.cassandra.service.CassandraDaemon",
        ]

    def ready(self) -> bool:
        return cassandra_node_answers("127.0.0.1", self.port)


# ----------------------------------------------------------------------------- stack


class Stack:
    """Both servers; ``up`` starts them in parallel (Cassandra is the slow one)."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.stack = settings.stack
        self.kafka = KafkaServer(self.stack)
        self.cassandra = CassandraServer(self.stack)
        self.servers: list[_Server] = [self.kafka, self.cassandra]

    def _check_state_dir(self) -> None:
        state = self.stack.state_dir
        probe = state / ".write-probe"
        try:
            state.mkdir(parents=True, exist_ok=True)
            try:
                probe.write_bytes(b"x" * 4096)
            finally:
                # A full disk fails the write after creating the file: never leave it behind.
                with contextlib.suppress(OSError):
                    probe.unlink()
        except OSError as exc:
            raise InfraError(f"state folder {state} is not writable: {exc}") from exc
        free_mib = shutil.disk_usage(state).free // (1024 * 1024)
        if free_mib < 1024:
            raise InfraError(
                f"only {free_mib} MiB free under {state}; the stack needs at least 1 GiB"
            )

    def up(self) -> dict[str, float]:
        """Start what is not running; return each server's seconds-to-ready."""
        self._check_state_dir()
        # Every busy port at once, before minutes of resolving jars.
        taken = [p for server in self.servers if not server.running() for p in server.taken_ports()]
        if taken:
            raise InfraError(ports_taken_message(taken))
        java = find_java(self.stack)
        # Resolve jars one after the other: two Maven runs sharing ~/.m2 can corrupt it.
        for server in self.servers:
            if not server.running():
                resolve_jars(server.name, self.stack.state_dir, self.stack.jars_dir, java=java)
        timings: dict[str, float] = {}
        errors: list[InfraError] = []

        def start(server: _Server) -> None:
            try:
                timings[server.name] = server.start(java)
            except InfraError as exc:
                errors.append(exc)
            except Exception as exc:
                errors.append(InfraError(f"{server.name} failed to start: {exc!r}"))

        threads = [threading.Thread(target=start, args=(s,)) for s in self.servers]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise InfraError("\n\n".join(str(e) for e in errors))
        return timings

    def down(self) -> list[str]:
        return [s.name for s in self.servers if s.stop()]

    def status(self) -> list[ServerStatus]:
        return [s.status() for s in self.servers]
