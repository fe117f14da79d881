"""Transparent huge pages for training: when they are asked for, how, and that the kernel then gives them."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from retrain.training import hugepages


def test_the_tunable_joins_the_users_own_tunables_and_a_set_one_is_left_alone():
    env = hugepages.with_tunable({"GLIBC_TUNABLES": "glibc.malloc.arena_max=2", "HOME": "/h"})
    assert env == {"GLIBC_TUNABLES": "glibc.malloc.arena_max=2:glibc.malloc.hugetlb=1", "HOME": "/h"}
    assert hugepages.with_tunable({})["GLIBC_TUNABLES"] == "glibc.malloc.hugetlb=1"
    assert hugepages.applied(env)
    assert hugepages.applied({"GLIBC_TUNABLES": "glibc.malloc.hugetlb=0"})  # the user's choice: not overridden
    assert not hugepages.applied({"GLIBC_TUNABLES": "glibc.malloc.hugetlb_x=1"})
    assert not hugepages.applied({})


def test_huge_pages_are_asked_for_only_where_the_kernel_wants_madvise_and_glibc_can(tmp_path: Path):
    sysfs = tmp_path / "enabled"
    sysfs.write_text("always [madvise] never\n")
    assert hugepages.thp_mode(sysfs) == "madvise"
    sysfs.write_text("[always] madvise never\n")
    assert hugepages.thp_mode(sysfs) == "always"
    assert hugepages.thp_mode(tmp_path / "missing") is None
    if sys.platform != "linux":
        pytest.skip("Linux only")
    assert hugepages.why_not("auto", "madvise", (2, 36)) is None
    assert "off" in str(hugepages.why_not("off", "madvise", (2, 36)))
    assert "'always'" in str(hugepages.why_not("auto", "always", (2, 36)))  # the heap gets them anyway
    assert "'never'" in str(hugepages.why_not("auto", "never", (2, 36)))
    assert "glibc 2.35" in str(hugepages.why_not("auto", "madvise", (2, 31)))  # no hugetlb tunable before 2.35


_CHILD = textwrap.dedent("""
    import os, sys
    from retrain.training import hugepages
    print("start", os.getpid(), flush=True)
    hugepages.reexec(sys.argv[1])
    block = bytearray(64 << 20)  # malloc'd (mmap'd by glibc at this size), every page touched below
    block[::4096] = b"x" * len(block[::4096])
    huge = [ln for ln in open("/proc/self/smaps_rollup") if ln.startswith("AnonHugePages:")][0].split()[1]
    print("done", os.getpid(), os.environ.get("GLIBC_TUNABLES", ""), huge, flush=True)
""")


@pytest.mark.skipif(hugepages.why_not("auto") is not None, reason=str(hugepages.why_not("auto")))
def test_reexec_keeps_the_pid_and_arguments_and_the_kernel_backs_malloc_with_huge_pages():
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    out = subprocess.run([sys.executable, "-c", _CHILD, "auto"], env=env, capture_output=True, text=True, check=True)
    lines = out.stdout.split()
    assert lines.count("start") == 2, out.stdout  # the script ran again from the top, in the same process
    pid = lines[1]
    assert lines[2:4] == ["start", pid] and lines[4:6] == ["done", pid], out.stdout
    assert lines[6] == "glibc.malloc.hugetlb=1" and int(lines[7]) > 0, out.stdout  # kB of anonymous huge pages

    off = subprocess.run([sys.executable, "-c", _CHILD, "off"], env=env, capture_output=True, text=True, check=True)
    lines = off.stdout.split()
    assert lines.count("start") == 1 and lines[2] == "done" and int(lines[-1]) == 0, off.stdout  # 4 KiB pages
