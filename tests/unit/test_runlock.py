"""One run at a time per workspace: the flock, the owner's record, a killed owner."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from retrain.errors import WorkspaceBusy
from retrain.paths import Paths
from retrain.runlock import run_lock

HOLD = """\
import os, signal, sys, time
from retrain.paths import Paths
from retrain.runlock import run_lock
with run_lock(Paths.at(sys.argv[1]), {"flow_run_id": "run-a"}, 0):
    print("held", flush=True)
    if sys.argv[2] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)
"""


def test_a_killed_owner_leaves_the_lock_free_and_its_record_for_the_next_run(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-c", HOLD, str(tmp_path), "kill"], capture_output=True, text=True)
    assert proc.returncode == -9 and proc.stdout == "held\n"
    with run_lock(Paths.at(tmp_path), {"flow_run_id": "run-b"}, timeout=0) as previous:
        assert previous["flow_run_id"] == "run-a" and previous["pid"] != os.getpid()
    with run_lock(Paths.at(tmp_path), {}, timeout=0) as previous:
        assert previous == {}  # run-b exited cleanly: no record left


def test_a_second_run_waits_then_gives_up_naming_the_owner(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path), "hold"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        seen: list[dict] = []
        with pytest.raises(WorkspaceBusy, match=f"pid {holder.pid} .*flow run run-a.*gave up after 0.5 s"), \
                run_lock(Paths.at(tmp_path), {}, timeout=0.5, on_wait=seen.append, poll=0.1):
            pass
        assert seen and seen[0]["pid"] == holder.pid  # told once, with who holds it
    finally:
        holder.kill()
        holder.wait()
    with run_lock(Paths.at(tmp_path), {}, timeout=0):  # free again once the holder is gone
        pass


def test_dvc_locks_left_by_a_killed_dvc_are_repaired_only_while_no_dvc_works_here(tmp_path: Path) -> None:
    import fcntl
    import json

    from retrain.runlock import repair_dvc_locks

    tmp = tmp_path / ".dvc" / "tmp"
    tmp.mkdir(parents=True)
    rw = tmp / "rwlock"
    assert repair_dvc_locks(tmp_path) == []  # nothing there
    # An entry of a live dvc is kept; one whose pid now belongs to a program that is not dvc is dropped.
    dvc_like = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "dvc", "repro"])
    try:
        doc = {"read": {"data/batches": [{"pid": dvc_like.pid, "cmd": "dvc repro"}]},
               "write": {"data/master": {"pid": os.getpid(), "cmd": "dvc repro"}}}
        rw.write_text(json.dumps(doc))
        [line] = repair_dvc_locks(tmp_path)
        assert "dropped entries" in line
        assert json.loads(rw.read_text()) == {"read": doc["read"], "write": {}}
    finally:
        dvc_like.kill()
        dvc_like.wait()
    # A file cut short mid-write is removed, but not while a dvc command holds DVC's repository lock.
    rw.write_text('{"read": {"data/ba')
    with open(tmp / "lock", "w") as held:
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        assert repair_dvc_locks(tmp_path) == [] and rw.exists()
    [line] = repair_dvc_locks(tmp_path)
    assert "unreadable" in line and not rw.exists()


MOUNTINFO = """\
22 27 0:21 / /proc rw,relatime - proc proc rw
27 1 259:1 / / rw,relatime - ext4 /dev/root rw
40 27 0:50 / /srv/shared rw,relatime - nfs4 nas:/export rw,vers=4.2,hard,proto=tcp,local_lock=none
41 27 0:51 / /srv/nolock rw,relatime - nfs nas:/export rw,vers=3,nolock,local_lock=all
42 41 0:52 / /srv/nolock/inner rw,relatime - nfs4 nas:/other rw,vers=4.1,local_lock=none
43 27 0:53 / /mnt/remote\\040dir rw,relatime - fuse.sshfs me@host:/w rw,user_id=0
"""


@pytest.mark.parametrize(("path", "refused"), [
    ("/home/me/detector", None),  # a local disk: one host, its flock is the kernel's
    ("/srv/shared/detector", None),  # NFSv4 with server-side locks
    ("/srv/nolock/detector", "mounted with nolock, local_lock=all"),
    ("/srv/nolock/inner/detector", None),  # the deepest mount decides
    ("/mnt/remote dir/detector", "fuse.sshfs"),
])
def test_a_workspace_whose_locks_other_hosts_cannot_see_is_refused(path: str, refused: str | None):
    from retrain.runlock import lock_scope_problem

    problem = lock_scope_problem(Path(path), MOUNTINFO)
    if refused is None:
        assert problem is None, problem
    else:
        assert problem is not None and refused in problem and "another host" in problem, problem
