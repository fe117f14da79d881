"""One training as two nodes: `torchrun` on hosts n0 and n1 (network namespaces), gloo over the bridge.

Both nodes work in the same workspace folder (a shared file system); rank 0 alone writes the checkpoints, the
candidate, the report and the MLflow run (on the stack's MLflow server).
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from stack.services import Stack
from tests.helpers import load_json, run_cli, set_train_params
from tests.topology.conftest import client_env, stack_workspace

pytestmark = [pytest.mark.topology, pytest.mark.slow]


def torchrun(stack: Stack, rank: int, port: int = 29517) -> list[str]:
    """The launch a user runs on each machine (README: training across nodes)."""
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
            "--node-rank", str(rank), "--master-addr", stack.net.address("n0"), "--master-port", str(port),
            "-m", "retrain", "train"]


def test_two_nodes_train_one_candidate_over_the_link(stack: Stack, tmp_path: Path) -> None:
    import mlflow

    from retrain.data.sample import generate

    paths = stack_workspace(stack, tmp_path, "ws-ddp")
    set_train_params(paths.root, num_nodes=2, strategy="ddp", devices=1, accelerator="cpu", threads=1, epochs=2)
    env = client_env(stack, tmp_path / "prefect")
    generate(tmp_path / "samples", batches=1, images_per_batch=16, seed=0)
    run_cli("ingest", tmp_path / "samples" / "batch-1", cwd=paths.root, env=env, check=True)
    for stage in ("merge", "validate"):
        run_cli(stage, cwd=paths.root, env=env, check=True)

    logs = [tmp_path / f"n{r}.log" for r in (0, 1)]
    procs = []
    for rank, log in enumerate(logs):
        with open(log, "w") as out:  # gloo must use the link, not the loopback its hostname resolves to
            procs.append(stack.popen(f"n{rank}", torchrun(stack, rank), env={"GLOO_SOCKET_IFNAME": "eth0"},
                                     cwd=paths.root, stdout=out, stderr=subprocess.STDOUT))
    try:
        codes = [p.wait(timeout=900) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    texts = [log.read_text() for log in logs]
    assert codes == [0, 0], "\n---\n".join(t[-3000:] for t in texts)
    shards = [re.search(rf"rank {r} of 2 reads (\d+) of the (\d+) training images", t) for r, t in enumerate(texts)]
    assert all(shards), [t[-3000:] for t in texts]
    n = int(shards[0].group(2))  # type: ignore[union-attr]
    assert [int(m.group(1)) for m in shards] == [-(-n // 2)] * 2, shards  # type: ignore[union-attr]

    report = load_json(paths.train_report)
    assert report["epochs"] == 2 and (paths.candidate / "model.pt").is_file()
    assert "candidate" in texts[0] and "candidate" not in texts[1].split("rank 1 of 2")[-1]  # rank 1 wrote none
    client = mlflow.MlflowClient(tracking_uri=stack.mlflow_url)
    experiment = client.get_experiment_by_name("retrain-ws-ddp")
    assert experiment is not None
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [report["mlflow_run_id"]]
    shutil.rmtree(paths.checkpoints, ignore_errors=True)
