"""find_maven: mvn on PATH, else a pinned Maven fetched from Maven Central (hash-checked)
and unpacked once into the jar cache. The archive is served from a local file here."""

from __future__ import annotations

import hashlib
import io
import tarfile
from pathlib import Path

import pytest

from base.errors import InfraError
from tocsin import infra


def fake_maven(path: Path) -> str:
    """A Maven-shaped archive at ``path``; returns its SHA-512."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        script = b"#!/bin/sh\necho fake maven\n"
        info = tarfile.TarInfo(f"apache-maven-{infra.MAVEN_VERSION}/bin/mvn")
        info.size, info.mode = len(script), 0o755
        tar.addfile(info, io.BytesIO(script))
    path.write_bytes(buf.getvalue())
    return hashlib.sha512(buf.getvalue()).hexdigest()


@pytest.fixture
def no_mvn_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    empty = tmp_path / "empty-path"
    empty.mkdir()
    monkeypatch.setenv("PATH", str(empty))


def test_without_mvn_maven_is_fetched_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_mvn_on_path: None
) -> None:
    archive = tmp_path / "maven.tar.gz"
    monkeypatch.setattr(infra, "MAVEN_SHA512", fake_maven(archive))
    monkeypatch.setattr(infra, "MAVEN_URL", archive.as_uri())
    cache = tmp_path / "jars"
    mvn = Path(infra.find_maven(cache))
    assert mvn == cache / f"apache-maven-{infra.MAVEN_VERSION}" / "bin" / "mvn"
    assert mvn.stat().st_mode & 0o111
    archive.unlink()  # the second call must not fetch again
    assert Path(infra.find_maven(cache)) == mvn
    assert [p.name for p in cache.iterdir()] == [f"apache-maven-{infra.MAVEN_VERSION}"]


def test_an_archive_with_another_hash_is_refused_and_nothing_is_left(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_mvn_on_path: None
) -> None:
    archive = tmp_path / "maven.tar.gz"
    fake_maven(archive)
    monkeypatch.setattr(infra, "MAVEN_SHA512", "0" * 128)
    monkeypatch.setattr(infra, "MAVEN_URL", archive.as_uri())
    cache = tmp_path / "jars"
    with pytest.raises(InfraError, match="SHA-512"):
        infra.find_maven(cache)
    assert list(cache.iterdir()) == []


def test_an_unreachable_maven_central_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_mvn_on_path: None
) -> None:
    monkeypatch.setattr(infra, "MAVEN_URL", (tmp_path / "absent.tar.gz").as_uri())
    with pytest.raises(InfraError, match="install Maven 3"):
        infra.find_maven(tmp_path / "jars")
    assert list((tmp_path / "jars").iterdir()) == []


def test_mvn_on_path_is_used_as_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    mvn = bin_dir / "mvn"
    mvn.write_text("#!/bin/sh\n")
    mvn.chmod(0o755)
    monkeypatch.setenv("PATH", str(bin_dir))
    monkeypatch.setattr(infra, "MAVEN_URL", "http://127.0.0.1:1/never-fetched")
    assert infra.find_maven(tmp_path / "jars") == str(mvn)
    assert not (tmp_path / "jars").exists()


def test_maven_runs_on_the_servers_java_when_java_home_is_unset(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    java = tmp_path / "jdk" / "bin" / "java"
    java.parent.mkdir(parents=True)
    java.write_text("")
    monkeypatch.delenv("JAVA_HOME", raising=False)
    assert infra._maven_env(str(java))["JAVA_HOME"] == str(tmp_path / "jdk")
    # A JAVA_HOME the user set is theirs.
    monkeypatch.setenv("JAVA_HOME", "/opt/mine")
    assert infra._maven_env(str(java))["JAVA_HOME"] == "/opt/mine"
