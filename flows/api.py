"""The Prefect API a flow run talks to: the configured server, or a local ephemeral one started reliably.

Without ``PREFECT_API_URL``, Prefect starts a temporary API server (a ``uvicorn`` subprocess) on the first client
call and waits ``server.ephemeral.startup_timeout_seconds`` (20 s) for it.  On a new ``PREFECT_HOME`` that server
first creates and migrates its sqlite database, which on a 2-core machine under load can take longer: the run died
with a bare ``RuntimeError``.  ``connect()`` starts that same server before the flow runs:

- under an exclusive lock on the ``PREFECT_HOME`` (``retrain-api.lock``), so only one process at a time creates or
  migrates a database there; the others wait and find it ready;
- with retrain's default timeout of 120 s (``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS`` still wins);
- through ``retrain.lifeline``, so the server dies with the process that started it, even when that is SIGKILLed
  (the kernel ties this to the starting thread: call ``connect()`` from the thread that outlives the flow run);
- and a failure is one line with the remedy (exit 75, nothing changed: nothing has run yet).

Prefect's own ``get_client()`` then finds the server running and uses it (one server per process, as before).

Prefect is imported inside the functions here, after ``defaults()``: Prefect reads its settings when it is
imported, and this module is what sets retrain's defaults first (``retrain.cli`` imports it at its top).
"""

from __future__ import annotations

import fcntl
import functools
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx

from retrain.errors import TransientError
from retrain.lifeline import PARENT_ENV as LIFELINE_PARENT

#: Seconds to wait for the local API to answer, unless ``PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS`` is set:
#: a new home's database takes seconds to create on 2 cores with one busy (``bench/RESULTS.md``, "measured in
#: development"), and Prefect's 20 s left too little margin.
STARTUP_TIMEOUT = 120
TIMEOUT_ENV = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
REMEDY = ("start a server with 'prefect server start' and set PREFECT_API_URL=http://127.0.0.1:4200/api, "
          f"or allow the local one more time ({TIMEOUT_ENV})")


class PrefectUnavailable(TransientError):
    """No Prefect API to run the flow against; nothing was changed."""


def defaults() -> None:
    """Retrain's defaults for Prefect, set before Prefect reads its settings (a user's own values win)."""
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")  # nothing leaves this machine:
    os.environ.setdefault("DO_NOT_TRACK", "1")  # nor the client's telemetry (and no notice about it in a terminal)
    os.environ.setdefault(TIMEOUT_ENV, str(STARTUP_TIMEOUT))


@functools.cache
def _server_class() -> Any:
    from prefect.server.api.server import SubprocessASGIServer

    class LifelineServer(SubprocessASGIServer):
        """Prefect's ephemeral server, started as ``python -m retrain.lifeline uvicorn ...``: it dies with us."""

        def _run_uvicorn_command(self) -> subprocess.Popen[Any]:
            import prefect
            from prefect.settings import get_current_settings

            env = {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
                   "PREFECT__SERVER_FINAL": "1", **get_current_settings().to_environment_variables(exclude_unset=True),
                   LIFELINE_PARENT: str(os.getpid())}
            return subprocess.Popen(
                [sys.executable, "-m", "retrain.lifeline", "uvicorn", "--app-dir", str(prefect.__module_path__.parent),
                 "--factory", "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
                 "--log-level", "error", "--lifespan", "on"], env=env)

    return LifelineServer


def _locked(path: Path, timeout: float) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + timeout
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                raise PrefectUnavailable(f"another process has been starting Prefect's local API under {path.parent} "
                                         f"for over {timeout:g} s; {REMEDY}") from None
            time.sleep(0.2)


def _check(url: str) -> None:
    try:
        response = httpx.get(f"{url.rstrip('/')}/health", timeout=15)
        response.raise_for_status()
    except httpx.HTTPError as e:
        raise PrefectUnavailable(f"the Prefect API at {url} does not answer ({type(e).__name__}: {e}); start it with "
                                 "'prefect server start', or unset PREFECT_API_URL to use a local one") from None


def whereabouts() -> str:
    """This host, and the address it reaches the Prefect API from (a worker's own address on a real network)."""
    from prefect.settings import PREFECT_API_URL

    where = socket.gethostname()
    url = PREFECT_API_URL.value()
    host = urlsplit(url).hostname if url else None
    if host:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:  # a UDP connect sends nothing
                s.connect((host, urlsplit(url).port or 80))
                where += f", {s.getsockname()[0]} -> {url}"
        except OSError:
            pass
    return where


def connect() -> str:
    """Make sure this process has a Prefect API before a flow runs; its URL.

    Returns:
        ``PREFECT_API_URL`` when set (after a health check), else the local ephemeral server's URL.

    Raises:
        PrefectUnavailable: The configured API does not answer, or the local one did not start in time.
    """
    defaults()
    from prefect.server.api.server import SubprocessASGIServer
    from prefect.settings import PREFECT_API_URL, PREFECT_HOME, PREFECT_SERVER_EPHEMERAL_ENABLED

    url = PREFECT_API_URL.value()
    if url:
        _check(url)
        return str(url)
    if not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        raise PrefectUnavailable(f"no Prefect API: PREFECT_API_URL is not set and the local one is off; {REMEDY}")
    server = _server_class()()  # registered as Prefect's one ephemeral server of this process
    if server.running:
        return str(server.api_url)
    timeout = int(os.environ.get(TIMEOUT_ENV) or STARTUP_TIMEOUT)
    home = Path(PREFECT_HOME.value()).expanduser()
    fd = _locked(home / "retrain-api.lock", 2 * timeout)  # a waiting one may wait for a whole start
    try:
        server.start(timeout=timeout)
    except (RuntimeError, OSError) as e:
        first = str(e).splitlines()[0] if str(e).strip() else type(e).__name__
        raise PrefectUnavailable(f"Prefect's local API (database under {home}) did not start within {timeout} s "
                                 f"({first[:200]}); {REMEDY}") from None
    finally:
        os.close(fd)
    if not isinstance(SubprocessASGIServer(), type(server)):  # Prefect's registry of servers changed shape
        raise PrefectUnavailable("Prefect's local API could not be shared with the flow (an unsupported Prefect "
                                 f"version); {REMEDY}")
    return str(server.api_url)
