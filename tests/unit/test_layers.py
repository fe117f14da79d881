"""The architecture as a contract: import-linter reads every import of the packages (those inside functions too)
and checks the layers, the stages' inputs and the absence of cycles declared in ``pyproject.toml``."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO


def test_the_import_contracts_hold():
    lint = Path(sys.executable).with_name("lint-imports")
    proc = subprocess.run([str(lint), "--no-cache"], cwd=REPO, capture_output=True, text=True, check=False)
    out = proc.stdout + proc.stderr
    print(out[-3000:])
    assert proc.returncode == 0, out[-6000:]
    for contract in ("One direction", "never read the registry", "No cycle"):
        assert contract in out, out
    assert "Contracts: 3 kept, 0 broken." in out, out
