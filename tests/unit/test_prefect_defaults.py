"""Retrain's Prefect defaults: nothing leaves the machine, and a user's own values win."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from tests.helpers import REPO

SHOW = ("from flows.api import defaults; import os, json; defaults(); "
        "print(json.dumps({k: os.environ.get(k) for k in ('DO_NOT_TRACK', 'PREFECT_SERVER_ANALYTICS_ENABLED')}))")


def _defaults(**env: str) -> dict[str, str | None]:
    base = {k: v for k, v in os.environ.items() if k not in ("DO_NOT_TRACK", "PREFECT_SERVER_ANALYTICS_ENABLED")}
    out = subprocess.run([sys.executable, "-c", SHOW], cwd=REPO, env={**base, **env}, capture_output=True, text=True,
                         check=True).stdout
    return json.loads(out.splitlines()[-1])


def test_the_client_and_the_server_send_no_telemetry_unless_the_user_says_otherwise():
    # DO_NOT_TRACK also keeps Prefect from printing its telemetry notice in a terminal on a fresh PREFECT_HOME.
    assert _defaults() == {"DO_NOT_TRACK": "1", "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    assert _defaults(DO_NOT_TRACK="0", PREFECT_SERVER_ANALYTICS_ENABLED="true") == {
        "DO_NOT_TRACK": "0", "PREFECT_SERVER_ANALYTICS_ENABLED": "true"}
