"""`retrain evaluate` / `promote` / `rollback` / `status` for real: DVC, MLflow (sqlite, and a real server over
HTTP), serving with `mlflow models serve`.

One model is trained (by `dvc repro`) on 2 generated batches of 40 images; the other candidates are that model
with some classes collapsed (their class-score biases pushed to -30: they never fire), which makes "better overall
but one class forgotten" exact rather than hoped for.  Every CLI call is a real process.
"""

from __future__ import annotations

import base64
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import pytest
import yaml

from retrain.detector.files import ModelFile, load_model_file, save_model_file
from retrain.paths import Paths
from tests.helpers import git, load_json, run_cli, run_dvc, set_params

NAME = "retrain-detector"
LINEAGE = {"data_version", "data_dvc_md5", "git_rev", "git_dirty", "params_hash", "train_params_hash",
           "parent_version", "warm_start", "train_run_id", "decision", "reasons", "classes", "metric.mAP50-95",
           "metric.mAP50", "metric.mAP75", "metric.AR100"}


def _fresh(trained: Path, dst: Path) -> Paths:
    """A copy of the trained workspace with an empty registry."""
    shutil.copytree(trained, dst, symlinks=True)
    for p in ("mlflow.db", "mlartifacts", ".cache/champion"):
        shutil.rmtree(dst / p, ignore_errors=True) if (dst / p).is_dir() else (dst / p).unlink(missing_ok=True)
    return Paths(dst)


def _collapsed(mf: ModelFile, classes: set[str]) -> ModelFile:
    """The model with ``classes`` never scoring above ~1e-13 (the class-score head's bias at -30)."""
    sd = {k: v.clone() for k, v in mf.state_dict.items()}
    idx = [mf.names.index(c) for c in classes]
    heads = [k for k in sd if ".cv3." in k and k.endswith(".bias") and sd[k].shape == (len(mf.names),)]
    assert len(heads) == 3, heads  # one class-score conv per detection scale
    for k in heads:
        sd[k][idx] = -30.0
    return ModelFile(sd, mf.yaml, mf.names, mf.imgsz, mf.meta)


def _round(paths: Paths, model: ModelFile, env: dict[str, str] | None = None) -> tuple[dict, dict]:
    """Put ``model`` in as the candidate, run `retrain evaluate` and `retrain promote`; return both reports."""
    save_model_file(paths.candidate / "model.pt", model)
    run_cli("evaluate", cwd=paths.root, env=env, check=True)
    proc = run_cli("promote", cwd=paths.root, env=env)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    return load_json(paths.eval_report), load_json(paths.promotion_report)


def _client(uri: str) -> Any:
    import mlflow

    return mlflow.MlflowClient(tracking_uri=uri, registry_uri=uri)


def _aliases(client: Any) -> dict[str, str]:
    return {k: str(v) for k, v in client.get_registered_model(NAME).aliases.items()}


def _uri(paths: Paths) -> str:
    return f"sqlite:///{paths.root / 'mlflow.db'}"


def test_first_model_is_promoted_only_above_min_map_with_every_lineage_tag(trained: Path, tmp_path: Path):
    paths = _fresh(trained, tmp_path / "ws")
    strong = load_model_file(paths.candidate / "model.pt")
    report = load_json(paths.eval_report)
    score = report["candidate"]["metrics"]["mAP50-95"]
    assert score > 0.02 and report["champion"] is None
    set_params(paths.root, "promote", min_map=round(score + 0.01, 4))
    _, refused = _round(paths, strong)
    assert refused["promoted"] is False and refused["version"] == "1"
    assert refused["reasons"] == [f"first model: mAP50-95 {score:.4f} is below min_map {score + 0.01:.4f}"]
    client = _client(_uri(paths))
    assert _aliases(client) == {"challenger": "1"}  # registered, not champion
    set_params(paths.root, "promote", min_map=round(score - 0.01, 4))
    _, promoted = _round(paths, strong)
    assert promoted["promoted"] is True and promoted["version"] == "2"
    assert _aliases(client) == {"challenger": "2", "champion": "2"}
    mv = client.get_model_version(NAME, "2")
    tags = {k.removeprefix("retrain."): v for k, v in mv.tags.items() if k.startswith("retrain.")}
    assert set(tags) >= LINEAGE, LINEAGE - set(tags)
    lock = yaml.safe_load((paths.root / "dvc.lock").read_text())
    master_md5 = next(o["md5"] for o in lock["stages"]["merge"]["outs"] if o["path"] == "data/master")
    train = load_json(paths.train_report)
    assert tags["data_dvc_md5"] == master_md5 and tags["data_version"] == train["data_version"]
    assert tags["git_rev"] == git("rev-parse", "HEAD", cwd=paths.root).strip()
    assert tags["parent_version"] == "none" and tags["decision"] == "promote"
    assert float(tags["metric.mAP50-95"]) == pytest.approx(score, abs=1e-6)
    assert tags["train_params_hash"] == train["params_hash"] and len(tags["params_hash"]) == 16
    assert tags["classes"] == ",".join(strong.names)
    # It carries its ONNX export, checked against PyTorch on the val images, and passed the serving check
    assert tags["onnx"] == "attached" and tags["onnx.parity.passed"] == "True" and tags["onnx.parity.split"] == "val"
    assert abs(float(tags["onnx.parity.map_onnx"]) - float(tags["onnx.parity.map_torch"])) <= 0.002
    [onnx] = list(Path(urlparse(client.get_model_version_download_uri(NAME, "2")).path).rglob("model.onnx"))
    assert tags["onnx.sha256"] == hashlib.sha256(onnx.read_bytes()).hexdigest()
    assert tags["serving_check"].startswith("passed: loaded from the registry, onnx answered"), tags["serving_check"]
    assert "retrain.serving_check" not in client.get_model_version(NAME, "1").tags  # not promoted: not checked
    runs = client.search_runs([client.get_experiment_by_name("retrain").experiment_id])
    assert mv.run_id in {r.info.run_id for r in runs}  # the version links to a run of this store


def test_better_promoted_worse_and_forgetful_refused_then_rollback(trained: Path, tmp_path: Path):
    paths = _fresh(trained, tmp_path / "ws")
    strong = load_model_file(paths.candidate / "model.pt")
    per_class = load_json(paths.eval_report)["candidate"]["metrics"]["per_class"]
    # X: the weakest class that still scores; a champion knowing only X is worse overall than "all but X".
    x = min((c for c, ap in per_class.items() if ap > 0.01), key=lambda c: per_class[c])
    assert per_class[x] < sum(per_class.values()) - per_class[x], per_class
    others = set(strong.names) - {x}

    _, first = _round(paths, _collapsed(strong, others))  # v1: knows only X
    assert first["promoted"] is True and first["version"] == "1"

    ev, forgot = _round(paths, _collapsed(strong, {x}))  # v2: better overall, X forgotten
    assert ev["delta"]["mAP50-95"] > 0.001 and ev["champion"]["version"] == "1"
    assert forgot["promoted"] is False and forgot["version"] == "2"
    assert any(r.startswith(f"forgetting: class {x} AP50-95 fell") for r in forgot["reasons"]), forgot["reasons"]
    assert not any(r.startswith("mAP50-95") for r in forgot["reasons"])  # refused by the guard alone

    ev, better = _round(paths, strong)  # v3: better, nothing forgotten
    assert better["promoted"] is True and better["parent_version"] == "1" and better["reasons"] == []
    lo, hi = ev["delta"]["ci"]
    assert lo <= ev["delta"]["mAP50-95"] <= hi

    ev, worse = _round(paths, _collapsed(strong, set(strong.names)))  # v4: detects nothing
    assert ev["candidate"]["metrics"]["mAP50-95"] == 0.0 and ev["candidate"]["metrics"]["detections"] == 0
    assert worse["promoted"] is False and worse["version"] == "4"
    assert any("below min_delta" in r for r in worse["reasons"])
    client = _client(_uri(paths))
    assert _aliases(client) == {"champion": "3", "challenger": "4"}
    assert client.get_model_version(NAME, "4").tags["retrain.decision"] == "reject"
    md = paths.eval_markdown.read_text()
    assert "| mAP50-95 | " in md and f"| {x} |" in md and "batch-2" in md
    assert {p.name for p in paths.eval_plots.iterdir()} == {"per_class_ap.png", "pr_curve.png"}

    assert (paths.reports / "history.png").is_file()  # drawn by v4's promotion (the flow's artifact shows it)
    status = run_cli("status", "--plot", cwd=paths.root, check=True).stdout
    assert f"{NAME}: champion version 3, challenger version 4" in status
    assert sum(line.endswith(" attached") for line in status.splitlines()) == 4  # each version's ONNX export
    # The quality history: one point per version, overall and per class, the promotions (1, 3) and the champion.
    assert "quality history of 4 version(s)" in status and (paths.reports / "history.png").stat().st_size > 10_000
    from retrain.registry.history import status as registry_status
    from retrain.registry.history_plot import figure, history

    h = history(registry_status(_uri(paths), NAME))
    assert h.versions == [1, 2, 3, 4] and h.promoted == [1, 3] and h.champion == 3
    assert h.overall == [float(client.get_model_version(NAME, str(v)).tags["retrain.metric.mAP50-95"])
                         for v in h.versions]
    assert set(h.per_class) == set(strong.names) and all(len(ys) == 4 for ys in h.per_class.values())
    assert h.per_class[x][1] == 0.0 and h.per_class[x][2] > 0  # v2 forgot X, v3 has it back
    overall = next(line for line in figure(h, NAME).axes[0].lines if line.get_label() == "overall")
    assert list(overall.get_xdata()) == [1, 2, 3, 4]
    # Each promotion logged the history to its version's MLflow run.
    run_id = client.get_model_version(NAME, "4").run_id
    assert [f.path for f in client.list_artifacts(run_id, "history")] == ["history/history.png"]
    unwritable = run_cli("status", "--plot", "--out", "reports/history.png/x.png", cwd=paths.root)
    assert unwritable.returncode == 1 and "Traceback" not in unwritable.stderr, unwritable.stderr
    assert "status --plot: cannot write" in unwritable.stderr, unwritable.stderr
    back = run_cli("rollback", cwd=paths.root, check=True).stdout
    assert f"{NAME}@champion: version 3 -> 1" in back
    assert _aliases(client)["champion"] == "1"
    again = run_cli("rollback", cwd=paths.root)  # v1 was the first champion
    assert again.returncode == 1 and "no previous one (use --to VERSION)" in again.stderr
    run_cli("rollback", "--to", "3", cwd=paths.root, check=True)
    assert _aliases(client)["champion"] == "3"
    history = json.loads(client.get_registered_model(NAME).tags["retrain.champion_history"])
    assert [(h["champion"], h["by"]) for h in history] == [("1", "promote"), ("3", "promote"), ("1", "rollback"),
                                                           ("3", "rollback")]
    bad = run_cli("rollback", "--to", "99", cwd=paths.root)
    assert bad.returncode == 1 and "has no version 99" in bad.stderr and "Traceback" not in bad.stderr


def test_promote_refuses_when_the_champion_or_the_candidate_changed_since_evaluation(trained: Path, tmp_path: Path):
    paths = _fresh(trained, tmp_path / "ws")
    strong = load_model_file(paths.candidate / "model.pt")
    _round(paths, strong)  # v1 champion
    run_cli("evaluate", cwd=paths.root, check=True)  # compares against v1
    client = _client(_uri(paths))
    client.delete_registered_model_alias(NAME, "champion")  # someone moves the champion meanwhile
    proc = run_cli("promote", cwd=paths.root)
    assert proc.returncode == 1 and "run 'retrain evaluate' again" in proc.stderr and "Traceback" not in proc.stderr
    client.set_registered_model_alias(NAME, "champion", "1")
    save_model_file(paths.candidate / "model.pt", _collapsed(strong, {strong.names[0]}))  # retrained, not evaluated
    proc = run_cli("promote", cwd=paths.root)
    assert proc.returncode == 1 and "evaluated another candidate" in proc.stderr and "Traceback" not in proc.stderr
    assert len(client.search_model_versions(f"name = '{NAME}'")) == 1  # nothing registered


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait(url: str, proc: subprocess.Popen[bytes], seconds: float = 120) -> None:
    end = time.time() + seconds
    while time.time() < end:
        assert proc.poll() is None, f"server exited {proc.returncode}"
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.5)
    raise AssertionError(f"{url} did not answer in {seconds} s")


def _server(args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    bindir = os.path.dirname(sys.executable)
    full = {**os.environ, "YOLO_OFFLINE": "true", "PATH": bindir + os.pathsep + os.environ["PATH"], **(env or {})}
    with log.open("wb") as f:
        return subprocess.Popen([sys.executable, "-m", "mlflow", *args], stdout=f, stderr=subprocess.STDOUT,
                                env=full, start_new_session=True)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    import signal

    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(20)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)


def test_promote_and_warm_evaluation_against_a_real_mlflow_server_over_http(trained: Path, tmp_path: Path):
    paths = _fresh(trained, tmp_path / "ws")
    strong = load_model_file(paths.candidate / "model.pt")
    port = _port()
    server = _server(["server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
                      "--backend-store-uri", f"sqlite:///{tmp_path / 'server.db'}",
                      "--artifacts-destination", str(tmp_path / "server-artifacts")], tmp_path / "server.log")
    try:
        _wait(f"http://127.0.0.1:{port}/health", server)
        env = {"MLFLOW_TRACKING_URI": f"http://127.0.0.1:{port}"}
        _, first = _round(paths, strong, env)
        assert first["promoted"] is True and first["tracking_uri"] == env["MLFLOW_TRACKING_URI"]
        ev, second = _round(paths, _collapsed(strong, set(strong.names)), env)  # champion downloaded over HTTP
        assert ev["champion"]["version"] == "1" and second["promoted"] is False
        client = _client(env["MLFLOW_TRACKING_URI"])
        assert _aliases(client) == {"champion": "1", "challenger": "2"}
        assert client.get_model_version(NAME, "2").tags["retrain.parent_version"] == "1"
        assert not (paths.root / "mlflow.db").exists()  # nothing went to the embedded default store
        assert any((tmp_path / "server-artifacts").rglob("model.pt"))  # artifacts went through the server
    finally:
        _stop(server)


def _huge_png(side: int = 30000) -> bytes:
    """A valid 1-bit PNG of side x side pixels, a few hundred kB (PIL's decompression-bomb limit must refuse it)."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\0" * (1 + (side + 7) // 8)  # filter byte + the bits of one row
    z = zlib.compressobj(9)
    data = b"".join(z.compress(row) for _ in range(side)) + z.flush()
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0))
            + chunk(b"IDAT", data) + chunk(b"IEND", b""))


def _invoke(port: int, rows: list[bytes], columns: tuple[str, ...] = ("image",)) -> tuple[int, Any]:
    """POST rows to the scoring server: (HTTP status, decoded JSON answer)."""
    import urllib.error

    body = {"dataframe_split": {"columns": list(columns), "data": [[base64.b64encode(r).decode()] for r in rows]},
            "params": {"conf": 0.001}}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_the_champion_serves_onnx_or_torch_and_answers_bad_input_with_one_400_naming_the_row(trained: Path,
                                                                                              tmp_path: Path):
    import mlflow
    import pandas as pd
    import ultralytics

    paths = _fresh(trained, tmp_path / "ws")
    _round(paths, load_model_file(paths.candidate / "model.pt"))
    names = set(load_model_file(paths.candidate / "model.pt").names)
    bus = (Path(ultralytics.__file__).parent / "assets" / "bus.jpg").read_bytes()
    uri = _uri(paths)
    with pytest.MonkeyPatch.context() as mp:  # the environment as a user's shell would set it; restored after
        mp.setenv("MLFLOW_TRACKING_URI", uri)
        model = mlflow.pyfunc.load_model(f"models:/{NAME}@champion")
        local = model.predict(pd.DataFrame({"image": [bus]}), params={"conf": 0.001})
        mp.setenv("RETRAIN_SERVE_BACKEND", "torch")
        eager = mlflow.pyfunc.load_model(f"models:/{NAME}@champion")
        pair = eager.predict(pd.DataFrame({"image": [bus, bus]}), params={"conf": 0.001})  # one batch of two
    assert "MLFLOW_REGISTRY_URI" not in os.environ and os.environ.get("MLFLOW_TRACKING_URI") != uri
    assert model.unwrap_python_model().backend == "onnx" and eager.unwrap_python_model().backend == "torch"
    assert len(local) > 0 and set(local["class_name"]) <= names and (local["image"] == 0).all()
    assert (local["x_max"] >= local["x_min"]).all() and local["x_max"].max() <= 810  # bus.jpg: 810 wide
    first, second = (pair[pair["image"] == i].drop(columns="image").reset_index(drop=True) for i in (0, 1))
    pd.testing.assert_frame_equal(first, second)  # each row of a batch answered as if alone
    # On onnxruntime, nothing of Lightning or the training code is imported to load the model and answer
    probe = ("import sys, mlflow, pandas as pd\n"
             "m = mlflow.pyfunc.load_model(sys.argv[1])\n"
             "m.predict(pd.DataFrame({'image': [open(sys.argv[2], 'rb').read()]}))\n"
             "print(m.unwrap_python_model().backend, sorted(k for k in sys.modules if 'lightning' in k\n"
             "      or k.startswith(('retrain.training', 'retrain.data.loading'))))")
    imports = subprocess.run([sys.executable, "-c", probe, f"models:/{NAME}@champion",
                              str(Path(ultralytics.__file__).parent / "assets" / "bus.jpg")], capture_output=True,
                             text=True, env={**os.environ, "MLFLOW_TRACKING_URI": uri, "YOLO_OFFLINE": "true"})
    assert imports.returncode == 0 and imports.stdout.splitlines()[-1] == "onnx []", imports.stdout + imports.stderr
    top = local.nlargest(5, "score")
    assert top["score"].to_numpy() == pytest.approx(first.nlargest(5, "score")["score"].to_numpy(), abs=1e-3)
    port = _port()
    server = _server(["models", "serve", "-m", f"models:/{NAME}@champion", "--env-manager", "local",
                      "-h", "127.0.0.1", "-p", str(port)], tmp_path / "serve.log", {"MLFLOW_TRACKING_URI": uri})
    try:
        _wait(f"http://127.0.0.1:{port}/ping", server, seconds=180)
        status, good = _invoke(port, [bus])
        assert status == 200 and len(good["predictions"]) == len(local) > 0
        assert {d["class_name"] for d in good["predictions"]} <= names
        assert good["predictions"][0]["score"] == pytest.approx(local["score"].iloc[0], abs=1e-5)
        bad = {"not an image": ([bus, b"hello, I am text"], ("image",), "image 1: not a decodable image"),
               "truncated JPEG": ([bus, bus[: len(bus) // 2]], ("image",), "image 1: not a decodable image"),
               "30000x30000 PNG": ([bus, _huge_png()], ("image",), "image 1: not a decodable image "
                                                                  "(DecompressionBombError"),
               "empty frame": ([bus, b""], ("image",), "image 1: not a decodable image (ValueError: no bytes)"),
               "no rows": ([], ("image",), "no images: the request has no rows"),
               "wrong column": ([bus], ("picture",), "image")}
        for what, (rows, columns, says) in bad.items():
            status, answer = _invoke(port, rows, columns)
            assert status == 400 and answer["error_code"] == "INVALID_PARAMETER_VALUE", (what, status, answer)
            assert says in answer["message"] and "Traceback" not in answer["message"], (what, answer["message"])
        assert _invoke(port, [bus]) == (200, good)  # still serving, the same answer
        assert server.poll() is None
    finally:
        _stop(server)


def test_a_version_the_registry_cannot_serve_back_never_becomes_champion(trained: Path, tmp_path: Path):
    """The store loses the ONNX file between registering and the alias move (as MLflow's artifact-location bugs with
    some stores do): the serving check, which downloads models:/name/N into a clean folder, stops the promotion."""
    paths = _fresh(trained, tmp_path / "ws")
    score = load_json(paths.eval_report)["candidate"]["metrics"]["mAP50-95"]
    set_params(paths.root, "promote", min_map=round(score - 0.01, 4))  # the gate passes
    flag = tmp_path / "at-the-point"
    env = {**os.environ, "YOLO_OFFLINE": "true", "RETRAIN_FAULT": "promote.after-register:stall",
           "RETRAIN_FAULT_FLAG": str(flag), "PATH": os.path.dirname(sys.executable) + os.pathsep + os.environ["PATH"]}
    proc = subprocess.Popen([sys.executable, "-m", "retrain", "promote"], cwd=paths.root, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 300
    while not flag.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.1)
    [onnx] = list((paths.root / "mlartifacts").rglob("model.onnx"))  # registered with its ONNX model ...
    onnx.unlink()  # ... which the store then loses
    flag.unlink()
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
    report = load_json(paths.promotion_report)
    assert report["promoted"] is False and report["version"] == "1" and report["champion"] is None
    [reason] = report["reasons"]
    assert reason.startswith("serving check: ") and "has no model.onnx" in reason, reason
    client = _client(_uri(paths))
    assert _aliases(client) == {"challenger": "1"}  # registered, never champion
    tags = client.get_model_version(NAME, "1").tags
    assert tags["retrain.serving_check"].startswith("failed: ") and tags["retrain.decision"] == "reject"


def test_registry_copy_moves_the_champion_to_another_store_and_back(trained: Path, tmp_path: Path):
    """A workspace moving to a team's tracking server takes its champion along (and back), from any folder."""
    paths = _fresh(trained, tmp_path / "ws")  # the same workspace, its registry empty: the "new server"
    source, target = f"sqlite:///{trained / 'mlflow.db'}", _uri(paths)
    elsewhere = tmp_path / "elsewhere"  # no mlflow.db here: MLflow's default registry must not be what is read
    elsewhere.mkdir()
    proc = run_cli("registry-copy", "--from", source, "-C", paths.root, cwd=elsewhere)
    assert proc.returncode == 0, proc.stderr
    assert f"{NAME}@champion in {target}: version 1 (registered; version 1 of {source})" in proc.stdout, proc.stdout
    assert not (elsewhere / "mlflow.db").exists()

    src, dst = _client(source), _client(target)
    assert _aliases(dst) == {"champion": "1", "challenger": "1"}
    copied = dst.get_model_version(NAME, "1").tags
    original = src.get_model_version(NAME, "1").tags
    assert copied["retrain.copied_from"] == f"{source} {NAME} version 1"
    kept = [f"retrain.{k}" for k in LINEAGE if k != "parent_version"]  # the parent is the target's champion
    assert {k: copied[k] for k in kept} == {k: original[k] for k in kept}
    assert copied["retrain.parent_version"] == "none"
    weights = (trained / "models" / "candidate" / "model.pt").read_bytes()
    assert copied["retrain.candidate_sha256"] == hashlib.sha256(weights).hexdigest()
    # Its ONNX export came along, the very file (sha256), and is what the copy serves
    assert copied["retrain.onnx"] == original["retrain.onnx"] == "attached"
    onnx = [p for p in (paths.root / "mlartifacts").rglob("model.onnx")]
    assert [hashlib.sha256(p.read_bytes()).hexdigest() for p in onnx] == [copied["retrain.onnx.sha256"]]

    # The next evaluation in the moved workspace is judged against the copied champion: the same weights.
    run_cli("evaluate", cwd=paths.root, check=True)
    evaluation = load_json(paths.eval_report)
    assert evaluation["champion"]["version"] == "1"
    assert evaluation["candidate"]["sha256"] == hashlib.sha256(weights).hexdigest()  # the copied weights again:
    assert evaluation["champion"]["metrics"] == evaluation["candidate"]["metrics"]  # so the very same scores

    # Again, and back: the weights are found where they are, nothing is registered twice.
    again = run_cli("registry-copy", "--from", source, "-C", paths.root, cwd=elsewhere, check=True)
    assert "version 1 (already there" in again.stdout, again.stdout
    back = run_cli("registry-copy", "--from", target, "--to", source, "-C", paths.root, cwd=elsewhere, check=True)
    assert f"{NAME}@champion in {source}: version 1 (already there" in back.stdout, back.stdout
    assert [str(v.version) for v in src.search_model_versions(f"name = '{NAME}'")] == ["1"]
    same = run_cli("registry-copy", "--from", target, "--to", target, "-C", paths.root, cwd=elsewhere)
    assert same.returncode == 1 and "same registry" in same.stderr, same.stderr


def test_a_rerun_promotion_is_never_restored_from_the_run_cache(trained: Path, tmp_path: Path):
    """DVC's run-cache restores a stale stage's outputs, without running it, when its deps, params and command match
    an earlier run.  promote writes the registry, which DVC does not see: a restored promotion.json would claim a
    write that never happened.  Here the params return to those of an earlier promotion after the champion moved;
    promote must run and write the registry again."""
    from dvc.repo import Repo
    from dvc.stage.cache import _can_hash

    paths = _fresh(trained, tmp_path / "ws")
    with Repo(str(paths.root)) as repo:  # the declaration: DVC can neither save nor restore these two stages
        stages = {s.name: s for s in repo.stage.collect(str(paths.root / "dvc.yaml"))}
        assert not _can_hash(stages["evaluate"]) and not _can_hash(stages["promote"])
        assert _can_hash(stages["validate"])  # while a stage with ordinary outputs could be restored
    set_params(paths.root, "promote", max_size_drop=0.5)  # a gate change: promote is stale and runs
    out = run_dvc("repro", "promote", cwd=paths.root)
    assert "Running stage 'promote'" in out, out
    client = _client(_uri(paths))
    assert _aliases(client)["champion"] == load_json(paths.promotion_report)["version"] == "1"
    client.delete_registered_model_alias(NAME, "champion")  # the champion moves (here: away)
    set_params(paths.root, "promote", max_size_drop=None)  # back to the params of the fixture's promotion
    out = run_dvc("repro", "promote", cwd=paths.root)
    assert "Running stage 'promote'" in out and "cached" not in out, out
    report = load_json(paths.promotion_report)
    assert report["promoted"] is True and report["version"] == "2"
    assert _aliases(client)["champion"] == "2"  # written by this run, not restored
