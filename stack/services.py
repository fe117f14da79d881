"""The production topology on one machine: PostgreSQL, an S3 endpoint, an MLflow server, a Prefect server, workers.

Every server runs in the ``srv`` host (a network namespace, ``net.py``) and listens on its address; workers and
training nodes are hosts of their own that reach it over the bridge.  State, logs and the generated credentials
live in the state folder (``.stack/``); ``env`` there holds the ``export`` lines a user sources, which are all a
workspace needs to use the stack: the pipeline reaches it by configuration alone.

- PostgreSQL 15 from the machine's binaries, run as an unprivileged user (it refuses root), databases ``mlflow``
  and ``prefect``, each with its own role and a generated password;
- moto's server mode as the S3 API (in memory: ``down`` forgets the buckets, so it forgets the rest too),
  buckets ``retrain-mlflow`` and ``retrain-dvc``;
- ``mlflow server`` on PostgreSQL with artifacts in ``s3://retrain-mlflow/``, proxied: clients upload through it
  and never hold its S3 credentials;
- ``prefect server start`` on PostgreSQL, with the process work pool ``retrain``;
- ``prefect worker start --pool retrain`` on each worker host.
"""

from __future__ import annotations

import contextlib
import json
import os
import pwd
import secrets
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from stack.net import Net

PG_PORT, S3_PORT, MOTO_PORT, MLFLOW_PORT, PREFECT_PORT = 5432, 9000, 9001, 5000, 4200
BUCKETS = ("retrain-mlflow", "retrain-dvc")
POOL = "retrain"
SERVICES = ("postgres", "s3", "mlflow", "prefect")


class StackError(RuntimeError):
    """The stack cannot be started or used; one line saying why."""


def _bin(name: str) -> str:
    """A program of this interpreter's environment."""
    return str(Path(sys.executable).parent / name)


def _pg_bindir() -> Path:
    found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if not found and shutil.which("apt-get") and os.geteuid() == 0:
        subprocess.run(["apt-get", "install", "-y", "-q", "postgresql"], check=False,
                       env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        found = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    if not found:
        raise StackError("PostgreSQL's binaries are not installed (/usr/lib/postgresql/*/bin): apt-get install "
                         "postgresql")
    return found[-1].parent


def _pg_user() -> str:
    """The unprivileged user PostgreSQL runs as: ``postgres`` where the package made it, else ``retrain-pg``."""
    for name in ("postgres", "retrain-pg"):
        try:
            pwd.getpwnam(name)
            return name
        except KeyError:
            continue
    subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", "retrain-pg"],
                   check=True, capture_output=True)
    return "retrain-pg"


def _until(what: str, check: Callable[[], bool], timeout: float, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if check():
                return
        except Exception:  # not up yet
            pass
        if time.monotonic() > deadline:
            tail = log.read_text(errors="replace")[-1500:] if log is not None and log.is_file() else ""
            raise StackError(f"{what} did not come up within {timeout:g} s" + (f"; its log ends:\n{tail}" if tail
                                                                               else ""))
        time.sleep(0.5)


def _http_ok(url: str) -> bool:
    with urllib.request.urlopen(url, timeout=3) as r:  # noqa: S310 (our own server)
        return bool(r.status == 200)


@dataclass
class Stack:
    """One stack: its state folder, its network, its secrets.

    Attributes:
        state: The state folder (``.stack/``).
        net: The hosts and their addresses.
    """

    state: Path
    net: Net
    secrets: dict[str, str] = field(default_factory=dict, repr=False)  # never in a test's failure output

    @classmethod
    def at(cls, state: Path, prefix: str = "rts", net: str = "10.231.7") -> Stack:
        """The stack whose state is in ``state`` (its recorded prefix and network win over the arguments)."""
        state = state.absolute()
        config = state / "stack.json"
        if config.is_file():
            doc = json.loads(config.read_text())
            prefix, net = doc["prefix"], doc["net"]
        s = cls(state, Net(prefix, net))
        secret_file = state / "secrets.json"
        if secret_file.is_file():
            s.secrets = json.loads(secret_file.read_text())
        return s

    # --- addresses and environments -------------------------------------------------------------------------
    @property
    def srv(self) -> str:
        return self.net.address("srv")

    @property
    def s3_url(self) -> str:
        return f"http://{self.srv}:{S3_PORT}"

    @property
    def mlflow_url(self) -> str:
        return f"http://{self.srv}:{MLFLOW_PORT}"

    @property
    def prefect_api(self) -> str:
        return f"http://{self.srv}:{PREFECT_PORT}/api"

    def _pg_url(self, db: str, driver: str) -> str:
        return f"postgresql+{driver}://{db}:{self.secrets[f'pg_{db}']}@127.0.0.1:{PG_PORT}/{db}"

    def pg_dsn(self, db: str) -> str:
        """A DSN for ``db`` from the machine's own namespace (tests read the stores with it)."""
        return f"postgresql://{db}:{self.secrets[f'pg_{db}']}@{self.srv}:{PG_PORT}/{db}"

    def client_env(self) -> dict[str, str]:
        """What a workspace, a worker or a user's shell needs to use the stack (``.stack/env``)."""
        return {
            "MLFLOW_TRACKING_URI": self.mlflow_url,
            "PREFECT_API_URL": self.prefect_api,
            # DVC's S3 remote (dvc-s3, botocore): the endpoint and the credentials come from the environment.
            "AWS_ACCESS_KEY_ID": self.secrets["dvc_key"],
            "AWS_SECRET_ACCESS_KEY": self.secrets["dvc_secret"],
            "AWS_ENDPOINT_URL_S3": self.s3_url,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_EC2_METADATA_DISABLED": "true",
            "RETRAIN_DVC_REMOTE": f"s3://{BUCKETS[1]}",
            "PREFECT_FLOWS_HEARTBEAT_FREQUENCY": "30",  # the zombie automation marks a run Crashed after 3 missed
        }

    def _base_env(self) -> dict[str, str]:
        keep = ("PATH", "HOME", "LANG", "LC_ALL", "TZ", "TMPDIR", "AWS_CA_BUNDLE")
        env = {k: v for k, v in os.environ.items() if k in keep}
        env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "/usr/bin:/bin")
        return env

    def write_env(self) -> Path:
        path = self.state / "env"
        lines = ["# retrain's local production stack: source this file (scripts/stack env prints it)"]
        lines += [f"export {k}={v}" for k, v in self.client_env().items()]
        path.write_text("\n".join(lines) + "\n")
        path.chmod(0o600)
        return path

    # --- processes ------------------------------------------------------------------------------------------
    def log(self, name: str) -> Path:
        return self.state / "logs" / f"{name}.log"

    def _spawn(self, name: str, host: str, args: list[str], env: dict[str, str]) -> int:
        self.log(name).parent.mkdir(parents=True, exist_ok=True)
        with open(self.log(name), "ab") as out:
            proc = subprocess.Popen(self.net.command(host, args), env=env, stdout=out, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True, cwd=self.state)
        (self.state / "run").mkdir(exist_ok=True)
        (self.state / "run" / f"{name}.pid").write_text(str(proc.pid))
        return proc.pid

    def _pid(self, name: str) -> int | None:
        f = self.state / "run" / f"{name}.pid"
        return int(f.read_text()) if f.is_file() else None

    def _stop_pid(self, name: str, sig: int = signal.SIGTERM, grace: float = 20.0) -> None:
        pid = self._pid(name)
        if pid is None:
            return
        for s, wait in ((sig, grace), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(pid, s)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                try:
                    os.killpg(pid, 0)
                except ProcessLookupError:
                    break
                time.sleep(0.2)
            else:
                continue
            break
        (self.state / "run" / f"{name}.pid").unlink(missing_ok=True)

    # --- PostgreSQL -----------------------------------------------------------------------------------------
    @property
    def _pg(self) -> Path:
        return self.state / "pg"

    def _pg_as_user(self, tool: str, *args: str, host: bool = False) -> subprocess.CompletedProcess[str]:
        cmd = ["runuser", "-u", self.secrets["pg_user"], "--", str(_pg_bindir() / tool), *args]
        proc = subprocess.run(self.net.command("srv", cmd) if host else cmd, capture_output=True, text=True,
                              check=False, cwd="/")
        if proc.returncode != 0:
            raise StackError(f"{tool} {' '.join(args[:3])}: {(proc.stderr or proc.stdout).strip()[-500:]}")
        return proc

    def _sql(self, statement: str) -> str:
        return self._pg_as_user("psql", "-h", str(self._pg / "run"), "-p", str(PG_PORT), "-U", "postgres", "-d",
                                "postgres", "-v", "ON_ERROR_STOP=1", "-tAc", statement).stdout.strip()

    def start_postgres(self) -> None:
        user = self.secrets["pg_user"]
        data, run = self._pg / "data", self._pg / "run"
        for d in (self._pg, run):
            d.mkdir(parents=True, exist_ok=True)
            shutil.chown(d, user)
        log = self.log("postgres")
        log.parent.mkdir(parents=True, exist_ok=True)
        log.touch()
        shutil.chown(log, user)
        if not (data / "PG_VERSION").is_file():
            self._pg_as_user("initdb", "-D", str(data), "-U", "postgres", "--auth-local=trust",
                             "--auth-host=scram-sha-256", "-E", "UTF8", "--no-locale")
            with open(data / "postgresql.conf", "a") as f:
                f.write(f"\nlisten_addresses = '127.0.0.1,{self.srv}'\nport = {PG_PORT}\n"
                        f"unix_socket_directories = '{run}'\nmax_connections = 200\n")
            with open(data / "pg_hba.conf", "a") as f:
                f.write(f"host all all {self.net.net}.0/24 scram-sha-256\n")
        self._pg_as_user("pg_ctl", "-D", str(data), "-l", str(log), "-w", "-t", "60", "start", host=True)
        for db in ("mlflow", "prefect"):
            if not self._sql(f"SELECT 1 FROM pg_roles WHERE rolname = '{db}'"):
                self._sql(f"CREATE ROLE {db} LOGIN PASSWORD '{self.secrets[f'pg_{db}']}'")
            if not self._sql(f"SELECT 1 FROM pg_database WHERE datname = '{db}'"):
                self._sql(f"CREATE DATABASE {db} OWNER {db}")

    def dump_database(self, db: str) -> bytes:
        """``pg_dump`` of ``db`` as plain SQL (what a canary-secret test searches)."""
        return self._pg_as_user("pg_dump", "-h", str(self._pg / "run"), "-p", str(PG_PORT), "-U", "postgres",
                                db).stdout.encode()

    def stop_postgres(self) -> None:
        if (self._pg / "data" / "postmaster.pid").is_file() and "srv" in self.net.hosts():
            with contextlib.suppress(StackError):
                self._pg_as_user("pg_ctl", "-D", str(self._pg / "data"), "-m", "fast", "-w", "stop", host=True)

    def start_postgres_again(self) -> None:
        """PostgreSQL back after ``stop_postgres`` (a fault test's outage)."""
        self._pg_as_user("pg_ctl", "-D", str(self._pg / "data"), "-l", str(self.log("postgres")), "-w", "-t", "60",
                         "start", host=True)

    def restart_postgres(self) -> None:
        """``pg_ctl restart`` (a fault test's outage: every connection is dropped)."""
        self._pg_as_user("pg_ctl", "-D", str(self._pg / "data"), "-l", str(self.log("postgres")), "-m", "fast",
                         "-w", "restart", host=True)

    # --- S3, MLflow, Prefect --------------------------------------------------------------------------------
    def start_s3(self) -> None:
        """moto on the server host's loopback, and the endpoint in front of it (``endpoint.py``)."""
        self._spawn("moto", "srv", [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(MOTO_PORT)],
                    self._base_env())
        self.start_endpoint()
        _until("the S3 endpoint (moto)", lambda: _http_ok(f"{self.s3_url}/"), 60, self.log("moto"))
        s3 = self.s3_client()
        have = {b["Name"] for b in s3.list_buckets().get("Buckets", [])}
        for bucket in BUCKETS:
            if bucket not in have:
                s3.create_bucket(Bucket=bucket)

    def start_endpoint(self) -> None:
        """The S3 endpoint up (again): the same buckets and objects as before it stopped."""
        self._spawn("s3", "srv", [sys.executable, "-m", "stack.endpoint", self.srv, str(S3_PORT), "127.0.0.1",
                                  str(MOTO_PORT)], {**self._base_env(), "PYTHONPATH": str(Path(__file__).parents[1])})
        _until("the S3 endpoint", lambda: _http_ok(f"{self.s3_url}/"), 30, self.log("s3"))

    def stop_endpoint(self) -> None:
        """An S3 outage: the endpoint refuses connections; moto keeps the data."""
        self._stop_pid("s3")

    def s3_client(self) -> Any:
        import boto3

        return boto3.client("s3", endpoint_url=self.s3_url, aws_access_key_id=self.secrets["dvc_key"],
                            aws_secret_access_key=self.secrets["dvc_secret"], region_name="us-east-1")

    def start_mlflow(self) -> None:
        env = {**self._base_env(), "MLFLOW_BACKEND_STORE_URI": self._pg_url("mlflow", "psycopg"),
               "MLFLOW_S3_ENDPOINT_URL": self.s3_url, "AWS_ACCESS_KEY_ID": self.secrets["mlflow_key"],
               "AWS_SECRET_ACCESS_KEY": self.secrets["mlflow_secret"], "AWS_DEFAULT_REGION": "us-east-1",
               "AWS_EC2_METADATA_DISABLED": "true",
               "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}  # no job runner: 7 more processes on 2 cores
        self._spawn("mlflow", "srv", [_bin("mlflow"), "server", "--artifacts-destination", f"s3://{BUCKETS[0]}/",
                                      "--host", self.srv, "--port", str(MLFLOW_PORT), "--workers", "1"], env)
        _until("the MLflow server", lambda: _http_ok(f"{self.mlflow_url}/health"), 180, self.log("mlflow"))

    def start_prefect(self) -> None:
        home = self.state / "prefect-server"
        env = {**self._base_env(), "PREFECT_HOME": str(home),
               "PREFECT_API_DATABASE_CONNECTION_URL": self._pg_url("prefect", "asyncpg"),
               "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_UI_API_URL": self.prefect_api}
        self._spawn("prefect", "srv", [_bin("prefect"), "server", "start", "--host", self.srv, "--port",
                                       str(PREFECT_PORT)], env)
        _until("the Prefect server", lambda: _http_ok(f"{self.prefect_api}/health"), 240, self.log("prefect"))
        self.prefect_cli("work-pool", "create", POOL, "--type", "process", "--overwrite")

    def prefect_cli(self, *args: str, cwd: Path | None = None) -> str:
        env = {**self._base_env(), **self.client_env(), "PREFECT_HOME": str(self.state / "prefect-client")}
        if cwd is not None:
            env["PWD"] = str(cwd)  # prefect.yaml's {{ $PWD }}: the workspace's path for the workers
        proc = subprocess.run([_bin("prefect"), "--no-prompt", *args], env=env, capture_output=True, text=True,
                              check=False, cwd=cwd, timeout=300)
        if proc.returncode != 0:
            raise StackError(f"prefect {' '.join(args[:2])}: {(proc.stdout + proc.stderr).strip()[-800:]}")
        return proc.stdout

    # --- workers and other hosts ----------------------------------------------------------------------------
    def host_env(self, host: str) -> dict[str, str]:
        """The environment of a process on ``host``: the client settings, a Prefect home of its own."""
        home = self.state / "hosts" / host / "prefect"
        home.mkdir(parents=True, exist_ok=True)
        return {**self._base_env(), **self.client_env(), "PREFECT_HOME": str(home),
                "YOLO_OFFLINE": "true", "DVC_NO_ANALYTICS": "1", "PYTHONUNBUFFERED": "1"}

    def workers(self, n: int) -> list[str]:
        """Exactly ``n`` workers of the pool ``retrain``, each on a host of its own (``w1``...); their hosts."""
        for host in self.net.hosts():
            if host.startswith("w") and int(host[1:]) > n:
                self._stop_pid(f"worker-{host}")
                self.net.remove_host(host)
        hosts = [f"w{i}" for i in range(1, n + 1)]
        for host in hosts:
            self.net.add_host(host)
            pid = self._pid(f"worker-{host}")
            if pid is not None and _alive(pid):
                continue
            self._spawn(f"worker-{host}", host, [_bin("prefect"), "worker", "start", "--pool", POOL, "--type",
                                                 "process", "--name", f"{self.net.prefix}-{host}"],
                        self.host_env(host))
        return hosts

    def popen(self, host: str, args: list[str], env: dict[str, str] | None = None, **kw: Any
              ) -> subprocess.Popen[Any]:
        """Start ``args`` on ``host`` (made if missing) with the host's environment (plus ``env``)."""
        self.net.add_host(host)
        return subprocess.Popen(self.net.command(host, args), env={**self.host_env(host), **(env or {})}, **kw)

    # --- the whole stack ------------------------------------------------------------------------------------
    def up(self) -> None:
        if os.geteuid() != 0:
            raise StackError("scripts/stack needs root: it makes network namespaces (ip netns) and runs PostgreSQL "
                             "as an unprivileged user")
        self.state.mkdir(parents=True, exist_ok=True)
        self.state.chmod(0o755)  # PostgreSQL's user must reach its folder inside
        (self.state / ".gitignore").write_text("*\n")
        (self.state / "stack.json").write_text(json.dumps({"prefix": self.net.prefix, "net": self.net.net}))
        if not self.secrets:
            self.secrets = {"pg_user": _pg_user(), **{k: secrets.token_urlsafe(24) for k in (
                "pg_mlflow", "pg_prefect", "mlflow_secret", "dvc_secret")},
                "mlflow_key": "mlflow-" + secrets.token_hex(6), "dvc_key": "dvc-" + secrets.token_hex(6)}
            path = self.state / "secrets.json"
            path.write_text(json.dumps(self.secrets))
            path.chmod(0o600)
        self.net.add_host("srv")
        try:
            self.start_postgres()
            self.start_s3()
            self.start_mlflow()
            self.start_prefect()
        except Exception:
            self.down()
            raise
        self.write_env()

    def down(self) -> None:
        """Stop everything, remove every host and the bridge, forget the state (S3 was in memory)."""
        for host in self.net.hosts():
            if host != "srv":
                self.net.kill(host)
        for name in ("prefect", "mlflow", "s3", "moto"):
            self._stop_pid(name)
        self.stop_postgres()
        self.net.remove_all()
        if self.state.is_dir():
            shutil.rmtree(self.state)

    def status(self) -> dict[str, bool]:
        checks = {"s3": f"{self.s3_url}/", "mlflow": f"{self.mlflow_url}/health",
                  "prefect": f"{self.prefect_api}/health"}
        out = {}
        for name, url in checks.items():
            try:
                out[name] = _http_ok(url)
            except Exception:
                out[name] = False
        try:
            out["postgres"] = self._sql("SELECT 1") == "1"
        except Exception:
            out["postgres"] = False
        for host in self.net.hosts():
            if host.startswith("w"):
                pid = self._pid(f"worker-{host}")
                out[f"worker {host}"] = pid is not None and _alive(pid)
        return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
