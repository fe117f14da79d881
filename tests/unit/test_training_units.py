"""Training's pure parts and file safety: schedule, run fingerprint, cache choice, model files, warm start."""

from __future__ import annotations

import json
import os
import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from retrain.config import RuntimeParams, TrainParams
from retrain.data.loading import choose_cache
from retrain.detector.files import ModelFile, ModelFileError, load_model_file, save_model_file, warm_start
from retrain.detector.model import build_model
from retrain.training.callbacks import LAST, PREVIOUS
from retrain.training.module import _lr_lambda
from retrain.training.train import CheckpointError, find_resume, fingerprint


def test_lr_schedule_warms_up_then_decays_to_lrf():
    f = _lr_lambda(warmup=10, total=100, lrf=0.01, schedule="cosine")
    assert f(0) == pytest.approx(0.1) and f(9) == pytest.approx(1.0)
    assert f(10) == pytest.approx(1.0) and f(100) == pytest.approx(0.01)
    assert all(f(i) >= f(i + 1) for i in range(10, 100))
    lin = _lr_lambda(warmup=0, total=10, lrf=0.1, schedule="linear")
    assert lin(5) == pytest.approx(0.55)


def test_fingerprint_is_the_train_section_s_results_and_runtime_knobs_live_elsewhere():
    p = TrainParams()
    base = fingerprint("v1", p, {"kind": "scratch"})
    assert not {"workers", "threads", "cache", "hugepages"} & set(TrainParams.model_fields)  # runtime's, not train's
    assert fingerprint("v1", p.model_copy(update={"lr": 0.1}), {"kind": "scratch"})["params"] != base["params"]
    assert fingerprint("v2", p, {"kind": "scratch"})["data_version"] == "v2"


def test_cache_choice_uses_available_memory():
    small = [{"width": 320, "height": 240}] * 10
    assert choose_cache("auto", small, 320, 2) == "ram"
    huge = [{"width": 10_000, "height": 10_000}] * 100_000  # 30 TB decoded, even resized to 3200
    assert choose_cache("auto", huge, 3200, 2) == "disk"
    assert choose_cache("none", small, 320, 2) == "none"


def _ckpt(path: Path, meta: dict, epoch: int) -> None:
    torch.save({"retrain": meta, "epoch": epoch, "global_step": 10 * (epoch + 1), "state_dict": {}}, path)


def test_resume_falls_back_to_the_previous_checkpoint_when_the_last_is_truncated(tmp_path: Path):
    fp = fingerprint("v1", TrainParams(), {"kind": "scratch"})
    _ckpt(tmp_path / LAST, fp, 2)
    _ckpt(tmp_path / PREVIOUS, fp, 1)
    data = (tmp_path / LAST).read_bytes()
    (tmp_path / LAST).write_bytes(data[: len(data) // 2])
    path, meta = find_resume(tmp_path, fp)
    assert path == tmp_path / PREVIOUS and meta["data_version"] == "v1"
    assert list(tmp_path.glob("last.ckpt.damaged-*"))  # kept aside for a person to look at
    # Other params: not resumed.
    other = fingerprint("v1", TrainParams(lr=0.5), {"kind": "scratch"})
    assert find_resume(tmp_path, other) == (None, {})


def test_resume_refuses_silently_restarting_when_every_checkpoint_is_damaged(tmp_path: Path):
    (tmp_path / LAST).write_bytes(b"PK\x03\x04 not really a zip")
    with pytest.raises(CheckpointError, match="every checkpoint is damaged"):
        find_resume(tmp_path, fingerprint("v1", TrainParams(), {"kind": "scratch"}))


def test_model_file_round_trip_is_plain_data(tmp_path: Path):
    model = build_model("yolo11n.yaml", ("a", "b"))
    f = tmp_path / "model.pt"
    save_model_file(f, ModelFile(model.state_dict(), dict(model.yaml), ("a", "b"), 64, {"data_version": "x"}))
    assert torch.serialization.get_unsafe_globals_in_checkpoint(str(f)) == []
    back = load_model_file(f)
    assert back.names == ("a", "b") and back.imgsz == 64 and back.meta == {"data_version": "x"}
    rebuilt = back.build()
    assert all(torch.equal(v, rebuilt.state_dict()[k]) for k, v in model.state_dict().items())


class _Hostile:
    def __reduce__(self):
        return (os.system, (f"touch {os.environ['RETRAIN_CANARY']}",))


def test_a_hostile_pickle_is_refused_before_anything_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    canary = tmp_path / "canary"
    monkeypatch.setenv("RETRAIN_CANARY", str(canary))
    evil = tmp_path / "evil.pt"
    torch.save({"model": _Hostile()}, evil)
    with pytest.raises(ModelFileError, match="refused"):
        load_model_file(evil)
    plain = tmp_path / "evil.pkl"
    plain.write_bytes(pickle.dumps(_Hostile()))
    with pytest.raises(ModelFileError):
        load_model_file(plain)
    assert not canary.exists()


def test_an_ultralytics_checkpoint_loads_with_its_classes_only(tmp_path: Path):
    model = build_model("yolo11n.yaml", ("cat", "dog"))
    f = tmp_path / "ultra.pt"
    torch.save({"model": model, "train_args": {"imgsz": 96}, "epoch": 3}, f)  # the layout ultralytics saves
    back = load_model_file(f)
    assert back.names == ("cat", "dog") and back.imgsz == 96 and back.meta["source"] == "ultralytics"
    assert all(torch.equal(v, back.state_dict[k]) for k, v in model.state_dict().items())


def test_warm_start_onto_more_classes_transfers_matching_weights_and_old_class_rows():
    old = build_model("yolo11n.yaml", ("circle", "square", "triangle"))
    new = build_model("yolo11n.yaml", ("circle", "square", "triangle", "star"))
    fresh = {k: v.clone() for k, v in new.state_dict().items()}
    src = ModelFile(old.state_dict(), dict(old.yaml), ("circle", "square", "triangle"), 64, {})
    t = warm_start(new, src)
    sd, osd = new.state_dict(), old.state_dict()
    mismatched = [k for k in sd if osd[k].shape != sd[k].shape]
    assert mismatched and all(".cv3." in k for k in mismatched)  # only the class-logit convs differ
    assert t.transferred == len(sd) - len(mismatched) and t.total == len(sd)
    assert t.kept_classes == ("circle", "square", "triangle") and t.new_classes == ("star",)
    for k in mismatched:  # old classes' rows copied by name; the new class's row keeps its fresh init
        assert torch.equal(sd[k][:3], osd[k][:3]) and torch.equal(sd[k][3], fresh[k][3])


def _sample_master(root: Path):
    """One generated sample batch as a ``Master`` (every 3rd image in val), without ingest or merge."""
    import hashlib
    import json

    from retrain.data.master import Master
    from retrain.data.sample import generate

    (batch,) = generate(root, 1, 12, seed=0)
    doc = json.loads((batch.path / "annotations.json").read_text())
    for i, im in enumerate(doc["images"]):
        im["file_name"] = f"{batch.path.name}/images/{im['file_name']}"
        im["sha256"] = hashlib.sha256((root / im["file_name"]).read_bytes()).hexdigest()
        im["split"] = "val" if i % 3 == 0 else "train"
    cats = sorted(doc["categories"], key=lambda c: c["id"])
    return Master(doc, tuple(c["name"] for c in cats), tuple(c["id"] for c in cats), "v", root.resolve())


def test_persistent_loader_workers_draw_each_epoch_as_a_resumed_run_does(tmp_path: Path):
    """Epoch N's augmented batches depend on (seed, epoch) only: the same after epochs 0..N-1 as after a resume."""
    from retrain.config import AugmentParams
    from retrain.training.datamodule import MasterDataModule

    master = _sample_master(tmp_path)
    p = TrainParams(imgsz=64, batch=4, epochs=3, augment=AugmentParams(close_mosaic=1))
    runtime = RuntimeParams(workers=2, cache="ram")

    def epochs(which: list[int]) -> list[list[torch.Tensor]]:
        dm = MasterDataModule(master, p, runtime, tmp_path / "cache")
        dm.setup("fit")
        loader = dm.train_dataloader()
        assert loader.persistent_workers and loader.num_workers == 2
        out = []
        for e in which:
            loader.sampler.set_epoch(e)  # what Lightning does before each epoch, the first after a resume included
            out.append([b["img"].clone() for b in loader])
        return out

    unbroken = epochs([0, 1, 2])
    resumed = epochs([1, 2])
    for a, b in zip(unbroken[1:], resumed, strict=True):
        assert len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(torch.equal(x, y) for x, y in zip(unbroken[0], unbroken[1], strict=False))  # epochs do differ


def test_training_re_hashes_every_image_and_names_a_damaged_or_missing_one(tmp_path: Path):
    import hashlib

    from retrain.data.master import Master, verify_images
    from retrain.errors import ValidationFailed

    images = []
    for i in range(3):
        f = tmp_path / "batches" / "b" / "images" / f"{i}.jpg"
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_bytes(bytes([i]) * 100)
        images.append({"id": i + 1, "file_name": f"batches/b/images/{i}.jpg",
                       "sha256": hashlib.sha256(f.read_bytes()).hexdigest()})
    master = Master({"images": images, "annotations": [], "categories": []}, (), (), "v", tmp_path)
    assert verify_images(master) == 3
    damaged = tmp_path / "batches" / "b" / "images" / "1.jpg"
    damaged.write_bytes(b"\x01" * 99 + b"\x00")
    (tmp_path / "batches" / "b" / "images" / "2.jpg").unlink()
    with pytest.raises(ValidationFailed) as e:
        verify_images(master)
    lines = e.value.lines()
    assert lines[0].startswith("batches/b/images/1.jpg: [image-sha256] sha256 ")
    assert lines[1].startswith("batches/b/images/2.jpg: [image-sha256] cannot be read")
    assert "2 of 3 images differ from what was ingested; nothing was trained" in lines[-1]


def test_ddp_ranks_read_disjoint_shards_of_the_same_epoch_order_whatever_the_node():
    from retrain.data.loading import EpochSampler

    n, world = 17, 2
    for epoch in (0, 1, 5):
        shards = []
        for rank in range(world):
            s = EpochSampler(n, seed=3, shuffle=True, rank=rank, world=world)
            s.epoch = epoch  # what set_epoch does (without reseeding this test's process)
            shards.append([i for i, e, r in s])
            assert len(shards[-1]) == len(s) == 9
        a, b = (set(x) for x in shards)
        assert a | b == set(range(n)) and len(a & b) <= 1  # disjoint but for DistributedSampler-style padding
        again = EpochSampler(n, seed=3, shuffle=True, rank=1, world=world)
        again.epoch = epoch
        assert [i for i, _, _ in again] == shards[1]  # depends on (seed, epoch) only: a resumed run draws the same
    assert shards != [list(range(0, n, 2)), list(range(1, n, 2))]  # shuffled


def test_ddp_on_cpus_trains_in_one_memory_format_without_timing_each_rank(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch):
    from retrain.training import trainer

    def timed(*args: object) -> float:
        raise AssertionError("a DDP rank timed its own CPU")

    monkeypatch.setattr(trainer, "_step_seconds", timed)
    model = build_model("yolo11n.yaml", ["a"])
    cpu = TrainParams(accelerator="cpu")
    for p in (cpu.model_copy(update={"num_nodes": 2}), cpu.model_copy(update={"devices": 2})):
        assert trainer.use_channels_last(p, model, tmp_path / "fmt.json") is False
    monkeypatch.setenv("WORLD_SIZE", "2")  # torchrun's
    assert trainer.use_channels_last(cpu, model, tmp_path / "fmt.json") is False
    assert trainer.use_channels_last(cpu.model_copy(update={"channels_last": "on", "num_nodes": 2}), model) is True


def test_a_memory_format_timed_once_serves_every_workspace_on_the_machine(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch):
    from retrain.training import trainer

    timings: list[bool] = []

    def timed(model: object, imgsz: int, batch: int, channels_last: bool) -> float:
        timings.append(channels_last)
        return 0.1 if channels_last else 0.2  # channels_last wins

    monkeypatch.setattr(trainer, "_step_seconds", timed)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    machine = trainer.machine_cache()
    assert machine == tmp_path / "xdg" / "retrain" / "memory-format.json"
    model = build_model("yolo11n.yaml", ["a"])
    p = TrainParams(accelerator="cpu", imgsz=64)
    first, second = tmp_path / "ws1" / "fmt.json", tmp_path / "ws2" / "fmt.json"
    assert trainer.use_channels_last(p, model, first, machine) is True
    assert timings == [False, True]  # timed once, both formats
    assert trainer.use_channels_last(p, model, second, machine) is True
    assert timings == [False, True]  # another workspace: the machine's answer, not timed again
    assert json.loads(second.read_text()) == json.loads(first.read_text()) == json.loads(machine.read_text())
    # The workspace's own record wins (a resumed run keeps its format), even against an edited machine record.
    key = next(iter(json.loads(machine.read_text())))
    machine.write_text(json.dumps({key: False}))
    assert trainer.use_channels_last(p, model, first, machine) is True
    assert trainer.use_channels_last(p, model, tmp_path / "ws3" / "fmt.json", machine) is False
    machine.write_text("not json")  # a damaged record is timed again and rewritten
    assert trainer.use_channels_last(p, model, tmp_path / "ws4" / "fmt.json", machine) is True
    assert len(timings) == 4 and json.loads(machine.read_text()) == {key: True}


def _tiny_module(optimizer: Callable[[Any], torch.optim.Optimizer]) -> Any:
    """A one-layer LightningModule whose loss is its output squared; ``optimizer(module)`` makes its optimizer."""
    import pytorch_lightning as pl

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(4, 1)

        def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
            return self.layer(batch).pow(2).mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return optimizer(self)

    return Tiny()


@pytest.mark.parametrize("optimizer", ["AdamW", "SGD"])
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_the_optimizer_trains_with_gradient_clipping_in_every_precision(optimizer: str, precision: str):
    """Lightning's mixed-precision plugin refuses clipping with a fused optimizer (seen on the first CUDA run)."""
    import pytorch_lightning as pl

    from retrain.training.module import make_optimizer

    params = TrainParams(optimizer=optimizer, grad_clip=10.0)

    def optimizer(module: Any) -> torch.optim.Optimizer:
        return make_optimizer(params, [{"params": list(module.parameters())}], str(module.trainer.precision))

    trainer = pl.Trainer(accelerator="cpu", devices=1, precision=precision, gradient_clip_val=params.grad_clip,
                         max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    trainer.fit(_tiny_module(optimizer), torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4))
    assert trainer.global_step == 2
    fused = trainer.optimizers[0].defaults.get("fused")
    assert bool(fused) == (precision == "32-true"), trainer.optimizers[0].defaults


def test_precision_auto_picks_bf16_on_a_cpu_only_where_it_computes_bf16_natively():
    from retrain.training.trainer import cpu_flags, resolve_precision

    cpu = TrainParams(accelerator="cpu")
    assert resolve_precision(cpu, {"avx2": True, "avx512_f": True, "amx_tile": True, "amx_bf16": True}) == "bf16-mixed"
    assert resolve_precision(cpu, {"avx2": True, "avx512_f": True, "avx512_bf16": True}) == "bf16-mixed"
    # AVX-512 without BF16, or AVX2 only: oneDNN converts every bf16 operation to float32, slower than float32.
    assert resolve_precision(cpu, {"avx2": True, "avx512_f": True, "avx512_bf16": False}) == "32-true"
    assert resolve_precision(cpu, {"avx2": True}) == "32-true"
    assert resolve_precision(cpu.model_copy(update={"accelerator": "auto"}), {"amx_bf16": True}) == "bf16-mixed"
    # An explicit value wins, either way.
    assert resolve_precision(cpu.model_copy(update={"precision": "32-true"}), {"amx_bf16": True}) == "32-true"
    assert resolve_precision(cpu.model_copy(update={"precision": "bf16-mixed"}), {"avx2": True}) == "bf16-mixed"
    flags = cpu_flags()  # this machine's, as torch reads them
    assert flags and all(isinstance(v, bool) for v in flags.values()) and "avx2" in flags


def test_compile_auto_compiles_only_where_the_measured_saving_pays_for_the_compile():
    from retrain.training.compiled import FIRST_COMPILE_S, decide

    assert not decide("off", 10_000, None, False, 1.0).compile
    on = decide("on", 1, None, False, None)
    assert on.compile and on.measure
    # Not measured on this machine: measure only when a run is long enough that the best saving could pay.
    short = decide("auto", 100, None, False, eager_s=1.0)
    assert not short.compile and not short.measure and "not measured" in short.reason
    long = decide("auto", int(FIRST_COMPILE_S * 10), None, False, eager_s=1.0)
    assert long.compile and long.measure
    # Measured: steps x saving against the compile (from the cache when its artefacts are there).
    m = {"eager_s": 1.0, "compiled_s": 0.8, "compile_s": 180.0, "compile_s_cached": 8.0}
    assert not decide("auto", 500, m, cached=False).compile  # 500 x 0.2 = 100 s < 180 s
    assert decide("auto", 1000, m, cached=False).compile  # 200 s > 180 s
    assert decide("auto", 50, m, cached=True).compile and not decide("auto", 30, m, cached=True).compile
    slower = {"eager_s": 1.0, "compiled_s": 1.1, "compile_s": 180.0}
    assert not decide("auto", 10**6, slower, cached=True).compile and "eager" in decide("auto", 1, slower, True).reason
    failed = decide("auto", 10**6, {"failed": "InvalidCxxCompiler: ..."}, True)
    assert not failed.compile and "failed" in failed.reason
    # DDP: every rank would measure its own CPU; `on` compiles on every rank all the same.
    assert not decide("auto", 10**6, m, True, multi_process=True).compile
    assert decide("on", 1, None, False, multi_process=True).compile


class _Tiny(torch.nn.Module):
    """A network with ultralytics' ``loss(batch, preds)`` call shape, small enough to compile in seconds."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.bn(self.conv(x)))

    def loss(self, batch: dict[str, torch.Tensor], preds: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        value = preds.float().pow(2).mean() + batch["bboxes"].sum() * 0
        return value, value.detach()


def test_a_compile_failure_falls_back_to_eager_and_leaves_the_model_as_it_was(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch):
    """A real inductor compile with a C++ compiler that fails (as on a machine without a working toolchain)."""
    from retrain.training import compiled

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    torch.manual_seed(0)
    net = _Tiny()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    setting = compiled.Setting(imgsz=32, batch=2, classes=2)
    eager = compiled.eager_step_seconds(net, setting)
    with torch._inductor.config.patch({"cpp.cxx": (None, "/bin/false")}):
        got = compiled.compile_forward(net, setting, eager)
    assert got.forward is None and got.error, got
    assert all(torch.equal(before[k], v) for k, v in net.state_dict().items())  # BatchNorm's statistics too
    assert all(q.grad is None for q in net.parameters())
    table = tmp_path / "compile.json"
    entry = compiled.record(table, "k", None, eager, got, cached=False)
    assert "failed" in entry and not compiled.decide("auto", 10**6, compiled.read_known(table)["k"], True).compile
    # With the compiler back, the same network compiles, and its compiled forward computes what the eager one does.
    got = compiled.compile_forward(net, setting, eager)
    assert got.forward is not None and got.error is None and got.compile_s >= 0, got
    x = torch.rand(2, 3, 32, 32)
    assert torch.allclose(got.forward(x), net(x), atol=1e-5)
    entry = compiled.record(table, "k", None, eager, got, cached=False)
    assert set(entry) == {"eager_s", "compiled_s", "compile_s"}
    torch.compiler.reset()


def test_compiled_artefacts_go_to_the_workspace_cache_unless_the_user_chose_a_folder(tmp_path: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch):
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    from retrain.training.compiled import inductor_cache

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())  # what importing torch's compile stack left
    folder = inductor_cache(tmp_path / ".cache")
    isa = torch.backends.cpu.get_cpu_capability()
    assert folder.parent == (tmp_path / ".cache" / "inductor").resolve() and isa in folder.name and folder.is_dir()
    assert cache_dir() == str(folder)  # where inductor now writes
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert inductor_cache(tmp_path / ".cache") == tmp_path / "mine"


def test_a_run_that_stays_eager_leaves_torchs_compile_caches_where_they_were(tmp_path: Path,
                                                                            monkeypatch: pytest.MonkeyPatch):
    """``auto`` on a run too short to pay: the eager step is measured and kept, and inductor is not pointed anywhere
    (pointing it clears torch's memoised cache paths, for nothing)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from retrain.training import compiled

    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", default_cache_dir())
    where = compiled.inductor_folder(tmp_path / ".cache")
    assert not where.exists() and os.environ["TORCHINDUCTOR_CACHE_DIR"] == default_cache_dir()  # asking changes nothing
    p = TrainParams(accelerator="cpu", imgsz=32, batch=2)
    forward, info = compiled.choose(tmp_path / ".cache", "auto", p, _Tiny(), 2, False, steps=3)
    assert forward is None and not info["compiled"] and "not measured" in info["reason"], info
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == default_cache_dir() and not where.exists()
    (entry,) = compiled.read_known(tmp_path / ".cache" / "compile.json").values()
    assert set(entry) == {"eager_s"} and entry["eager_s"] > 0


@pytest.mark.parametrize(("every_s", "stop_after", "written"), [
    (0.0, None, [0, 1, 2, 3, 4, 5]),  # every epoch, as before the knob
    (60.0, None, [2, 5]),  # 25 s epochs: 75 s after the start, then the final epoch
    (60.0, 3, [2, 3]),  # an early stop in epoch 3: that epoch is the final one and is written
    (1000.0, None, [5]),
])
def test_last_checkpoint_is_written_once_per_interval_of_training_and_always_at_the_end(
        tmp_path: Path, every_s: float, stop_after: int | None, written: list[int]):
    """``runtime.checkpoint_every_s``: a real Lightning fit with a clock that moves 25 s an epoch; the epochs whose
    ``last.ckpt`` reached the disk are read from the checkpoint IO (the atomic one the runs use)."""
    import pytorch_lightning as pl

    from retrain.training.callbacks import AtomicCheckpointIO, LastCheckpoint

    now = [0.0]
    saved: list[int] = []

    class Recording(AtomicCheckpointIO):
        def save_checkpoint(self, checkpoint: dict, path: object, storage_options: object = None) -> None:
            super().save_checkpoint(checkpoint, path, storage_options)
            saved.append(int(checkpoint["epoch"]))

    class Clock(pl.Callback):  # runs before checkpoint callbacks (Lightning puts those last)
        def on_train_epoch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            now[0] += 25.0
            if stop_after is not None and trainer.current_epoch == stop_after:
                trainer.should_stop = True

    last = LastCheckpoint(every_s, dirpath=tmp_path, filename=Path(LAST).stem, monitor=None, save_top_k=1,
                          every_n_epochs=1, save_on_train_epoch_end=True, enable_version_counter=False)
    last.clock = lambda: now[0]
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=6, logger=False, callbacks=[Clock(), last],
                         plugins=[Recording()], enable_progress_bar=False, enable_model_summary=False)
    module = _tiny_module(lambda m: torch.optim.SGD(m.parameters(), lr=0.01))
    trainer.fit(module, torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=4))
    assert saved == written
    assert torch.load(tmp_path / LAST, weights_only=True)["epoch"] == written[-1]
