"""Loggers as a user sees them: files read back with each tool's own reader (TensorBoard's event
reader, W&B's record format, the MLflow client), the trainer's ``logger_params`` and ``loggers=``,
and the errors for missing extras."""

import csv
import glob
import io
import json
import os
import struct
import subprocess
import sys
import time

import numpy as np
import pytest
from conftest import FailAt, RegressTrainer, TinyMLP, quiet

import flaxlight
from flaxlight.loggers import CSVLogger, Logger, LoggerCollection, TensorBoardLogger, as_image


def _trainer(tmp_path, **kwargs):
    kwargs.setdefault("model_hparams", {"hidden_dims": [16], "output_dim": 1})
    kwargs.setdefault("optimizer_hparams", {"optimizer": "adam", "lr": 3e-2})
    return RegressTrainer(model_class=TinyMLP, exmp_input=np.zeros((1, 4), np.float32), **quiet(tmp_path, **kwargs))


class RecordingLogger(Logger):
    def __init__(self):
        self.calls = []

    def log_hyperparams(self, params):
        self.calls.append(("hparams", dict(params)))

    def log_metrics(self, metrics, step):
        self.calls.append(("metrics", step, dict(metrics)))

    def log_image(self, tag, image, step):
        self.calls.append(("image", tag, step, np.asarray(image).shape))

    def finalize(self, status):
        self.calls.append(("finalize", status))


class ImageTrainer(RegressTrainer):
    """Logs a small picture after each validation, as a reconstruction hook would."""

    def on_validation_epoch_end(self, epoch_idx, eval_metrics, val_loader):
        image = np.zeros((6, 10, 3), np.float32)
        image[:, :5, 0] = 1.0  # left half red
        self.log_image("val/picture", image)


@pytest.fixture
def wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb_default"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb_data"))


# ---------------------------------------------------------------------------- reading W&B runs back
def _wandb_records(run_dir):
    """The records of an offline run's ``run-<id>.wandb`` file, parsed with wandb's own protobuf.

    The file is ``:W&B`` + a 3-byte version, then LevelDB-log framing: 32 KiB blocks of chunks
    with a 7-byte header (crc32, little-endian length, type: 1 full, 2 first, 3 middle, 4 last).
    """
    from wandb.proto import wandb_internal_pb2

    (path,) = glob.glob(os.path.join(run_dir, "run-*.wandb"))
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    pos, block, pending = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if kind == 0 and length == 0:  # zero padding to the end of the block
            pos += left
            continue
        chunk = data[pos + 7:pos + 7 + length]
        if len(chunk) < length:  # W&B's service is still writing this record: read again later
            return
        pos += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record
            pending = b""


def _read_wandb_run(run_dir, timeout=30.0):
    """``{"run": RunRecord, "config": {...}, "history": [{key: value}], "exit_code": int}``.

    W&B's service process writes the file in the background, a moment after ``finish()``
    returns: read it again until its exit record is there.
    """
    deadline = time.monotonic() + timeout
    while True:
        run = _parse_wandb_run(run_dir)
        if run["exit_code"] is not None or time.monotonic() > deadline:
            return run
        time.sleep(0.05)


def _parse_wandb_run(run_dir):
    config, history, run, exit_code = {}, [], None, None
    for record in _wandb_records(run_dir):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run = record.run
            config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
        elif kind == "config":
            config.update({item.key: json.loads(item.value_json) for item in record.config.update})
        elif kind == "history":
            history.append({"/".join(item.nested_key) or item.key: json.loads(item.value_json)
                            for item in record.history.item})
        elif kind == "exit":
            exit_code = record.exit.exit_code
    return {"run": run, "config": config, "history": history, "exit_code": exit_code}


def _series(history, key):
    """``[(trainer/global_step, value)]`` for ``key`` in a W&B history."""
    return [(row["trainer/global_step"], row[key]) for row in history if key in row]


def _offline_runs(save_dir):
    return sorted(glob.glob(os.path.join(save_dir, "wandb", "offline-run-*")))


# ---------------------------------------------------------------------------- interface and TensorBoard
def test_as_image_normalises_and_explains_bad_shapes():
    assert as_image(np.ones((2, 3), np.float32)).dtype == np.uint8
    assert as_image(np.full((2, 3, 1), 0.5)).shape == (2, 3)
    assert as_image(np.full((2, 3, 3), 2.0)).max() == 255  # floats are clipped to [0, 1]
    with pytest.raises(ValueError, match=r"got shape \(3, 8, 8\).*transpose\(1, 2, 0\)"):
        as_image(np.zeros((3, 8, 8)))


def test_logger_collection_fans_out_images_and_the_base_ignores_them(tmp_path):
    first, second = RecordingLogger(), RecordingLogger()
    collection = LoggerCollection([CSVLogger(tmp_path), first, second])
    collection.log_image("x", np.zeros((2, 2)), step=3)
    collection.flush()  # the records are written on the collection's writer thread
    assert first.calls == second.calls == [("image", "x", 3, (2, 2))]
    Logger().log_image("x", np.zeros((2, 2)), step=3)  # the no-op default
    with pytest.raises(ValueError, match=r"transpose\(1, 2, 0\)"):  # refused at the call, whatever the loggers
        LoggerCollection([CSVLogger(tmp_path / "csv")]).log_image("x", np.zeros((3, 8, 8)), step=4)


def test_tensorboard_logger_writes_scalars_images_and_hparams(tmp_path):
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = TensorBoardLogger(tmp_path)
    logger.log_hyperparams({"seed": 3, "optimizer_hparams": {"lr": 0.1}})
    for step in (2, 4):
        logger.log_metrics({"train/loss": 1.0 / step}, step=step)
    picture = np.zeros((6, 10, 3), np.uint8)
    picture[:, :5, 0] = 255
    logger.log_image("val/picture", picture, step=4)
    logger.log_image("val/gray", np.linspace(0, 1, 24, dtype=np.float32).reshape(4, 6), step=4)
    logger.finalize("success")

    events = EventAccumulator(str(tmp_path), size_guidance={"images": 0, "tensors": 0})
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(2, 0.5), (4, 0.25)]
    (image,) = events.Images("val/picture")
    assert (image.step, image.width, image.height) == (4, 10, 6)
    pixels = np.asarray(Image.open(io.BytesIO(image.encoded_image_string)))
    assert pixels[0, 0].tolist() == [255, 0, 0] and pixels[0, -1].tolist() == [0, 0, 0]
    assert (events.Images("val/gray")[0].width, events.Images("val/gray")[0].height) == (6, 4)
    (text,) = events.Tensors("hparams/text_summary")
    assert b"lr: 0.1" in text.tensor_proto.string_val[0]


# ---------------------------------------------------------------------------- W&B
def test_wandb_logger_offline_run_holds_metrics_config_and_images(tmp_path, wandb_offline):
    from flaxlight.loggers import WandbLogger

    logger = WandbLogger(project="demo", name="first", save_dir=tmp_path / "run")
    assert logger.run_id is None and not (tmp_path / "run" / "wandb").exists()  # nothing until a record
    logger.log_hyperparams({"seed": 3, "optimizer_hparams": {"lr": 0.1}})
    logger.log_metrics({"train/loss": 0.5, "val/loss": 0.6}, step=8)
    logger.log_metrics({"train/loss_step": 0.7}, step=4)  # a late running value: kept, not dropped
    logger.log_image("val/picture", np.zeros((6, 10, 3), np.uint8), step=8)
    logger.finalize("success")
    logger.close()

    (run_dir,) = _offline_runs(tmp_path / "run")
    run = _read_wandb_run(run_dir)
    assert (run["run"].project, run["run"].display_name, run["run"].run_id) == ("demo", "first", logger.run_id)
    assert run["config"]["seed"] == 3 and run["config"]["optimizer_hparams"] == {"lr": 0.1}
    assert _series(run["history"], "train/loss") == [(8, 0.5)]
    assert _series(run["history"], "val/loss") == [(8, 0.6)]
    assert _series(run["history"], "train/loss_step") == [(4, 0.7)]
    assert _series(run["history"], "val/picture/_type") == [(8, "image-file")]
    assert glob.glob(os.path.join(run_dir, "files", "media", "images", "val", "picture_*.png"))
    assert run["exit_code"] == 0
    assert json.loads((tmp_path / "run" / "wandb_run.json").read_text())["id"] == logger.run_id


def test_wandb_resume_continues_the_same_run_id(tmp_path, wandb_offline):
    from flaxlight.loggers import WandbLogger

    first = WandbLogger(save_dir=tmp_path)
    for step in (1, 2, 3):
        first.log_metrics({"train/loss": float(step)}, step=step)
    first.finalize("interrupted")
    second = WandbLogger(save_dir=tmp_path)  # a new process after the crash: checkpoint at step 2
    second.resume_from_step(2)
    second.log_metrics({"train/loss": 30.0}, step=3)
    second.finalize("success")
    second.close()

    runs = [_read_wandb_run(d) for d in _offline_runs(tmp_path)]
    assert len(runs) == 2 and runs[0]["run"].run_id == runs[1]["run"].run_id == first.run_id
    assert runs[0]["exit_code"] == 1 and runs[1]["exit_code"] == 0
    assert _series(runs[1]["history"], "train/loss") == [(3, 30.0)]


def test_seed_logger_params_wandb_picks_wandb_and_keeps_csv(tmp_path, regression_loaders, wandb_offline):
    from flaxlight.loggers import WandbLogger

    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path, logger_params={"log_dir": str(tmp_path / "run"), "logger_type": "WandB",
                                                "project_name": "seed-project"})
    assert [type(lg) for lg in trainer.logger.loggers] == [CSVLogger, WandbLogger]
    trainer.train_model(train, val, num_epochs=2)
    trainer.logger.close()

    (run_dir,) = _offline_runs(tmp_path / "run")
    run = _read_wandb_run(run_dir)
    assert (run["run"].project, run["run"].display_name) == ("seed-project", "run")
    assert run["config"]["model_hparams"]["hidden_dims"] == [16]
    assert run["config"]["optimizer_hparams"]["lr"] == 0.03
    assert [step for step, _ in _series(run["history"], "train/loss")] == [8, 16]
    assert [step for step, _ in _series(run["history"], "val/loss")] == [8, 16]
    assert run["exit_code"] == 0
    assert (tmp_path / "run" / "metrics.csv").is_file()


def test_wandb_records_after_train_model_land_in_the_same_run(tmp_path, regression_loaders, wandb_offline):
    from flaxlight.loggers import WandbLogger

    train, val, _ = regression_loaders
    logger = WandbLogger(save_dir=tmp_path / "run")
    trainer = _trainer(tmp_path, loggers=[logger])
    trainer.train_model(train, val, num_epochs=2)
    trainer.log_image("val/sample", np.zeros((6, 10, 3), np.uint8))  # after the run, as a user does
    trainer.logger.log_metrics({"test/loss": 0.25}, step=trainer.global_step)
    trainer.logger.close()

    (run_dir,) = _offline_runs(tmp_path / "run")  # one run folder, not a second one for the late records
    run = _read_wandb_run(run_dir)
    assert run["run"].run_id == logger.run_id and run["exit_code"] == 0
    assert _series(run["history"], "test/loss") == [(16, 0.25)]
    assert _series(run["history"], "val/sample/_type") == [(16, "image-file")]
    assert [step for step, _ in _series(run["history"], "val/loss")] == [8, 16]


def test_wandb_failed_run_is_finished_at_once_with_exit_code_1(tmp_path, wandb_offline):
    from flaxlight.loggers import WandbLogger

    logger = WandbLogger(save_dir=tmp_path)
    logger.log_metrics({"train/loss": 1.0}, step=1)
    logger.finalize("failed")
    (run_dir,) = _offline_runs(tmp_path)
    assert _read_wandb_run(run_dir)["exit_code"] == 1


# ---------------------------------------------------------------------------- MLflow
def _mlflow_client(save_dir):
    from pathlib import Path

    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=Path(save_dir, "mlruns").as_uri())


def test_mlflow_logger_run_reads_back_with_the_mlflow_client(tmp_path):
    pytest.importorskip("mlflow")
    from flaxlight.loggers import MLflowLogger

    logger = MLflowLogger(experiment_name="demo", run_name="first", save_dir=tmp_path)
    logger.log_hyperparams({"seed": 3, "optimizer_hparams": {"optimizer": "adam", "lr": 0.1}})
    for step in (8, 16):
        logger.log_metrics({"train/loss": 1.0 / step, "val/acc": step / 16}, step=step)
    logger.log_image("val/picture", np.zeros((6, 10, 3), np.uint8), step=16)
    logger.finalize("success")

    client = _mlflow_client(tmp_path)
    run = client.get_run(logger.run_id)
    assert run.info.run_name == "first" and run.info.status == "FINISHED"
    assert client.get_experiment(run.info.experiment_id).name == "demo"
    assert run.data.params == {"seed": "3", "optimizer_hparams.optimizer": "adam", "optimizer_hparams.lr": "0.1"}
    assert [(m.step, m.value) for m in client.get_metric_history(logger.run_id, "train/loss")] == [(8, 0.125), (16, 0.0625)]
    assert [m.step for m in client.get_metric_history(logger.run_id, "val/acc")] == [8, 16]
    images = [f.path for f in client.list_artifacts(logger.run_id, "images")]
    assert any(p.endswith(".png") for p in images)


def test_mlflow_says_when_it_renames_a_metric_and_keeps_two_names_apart(tmp_path, caplog):
    """'f1(macro)' became 'f1_macro_' silently, and 'f1[macro]' went into the same MLflow series.
    The keys depend on the names only (not on their order: a resumed run keeps its series), and a
    name MLflow takes is never changed."""
    pytest.importorskip("mlflow")
    import hashlib
    import logging

    from flaxlight.loggers import MLflowLogger

    def key(name, bare):
        return f"{bare}_{hashlib.sha1(name.encode()).hexdigest()[:6]}"

    names = ["val/f1(macro)", "val/f1[macro]", "val/f1_macro_"]
    keys = {name: key(name, "val/f1_macro_") for name in names[:2]} | {"val/f1_macro_": "val/f1_macro_"}
    assert len(set(keys.values())) == 3
    for order, run in ((names, "a"), (names[::-1], "b")):
        logger = MLflowLogger(save_dir=tmp_path / run)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="flaxlight"):
            for step in (1, 2):
                logger.log_metrics({name: 0.25 * (names.index(name) + 1) for name in order}, step=step)
        logger.finalize("success")
        said = sorted(r.getMessage() for r in caplog.records if "MLflow does not take" in r.getMessage())
        assert said == sorted(f"MLflow does not take the characters of metric {name!r}: it is logged there as "
                              f"{keys[name]!r}." for name in names[:2])
        client = _mlflow_client(tmp_path / run)
        for name in names:
            history = [m.value for m in client.get_metric_history(logger.run_id, keys[name])]
            assert history == [0.25 * (names.index(name) + 1)] * 2, (run, name)


def test_mlflow_resume_keeps_the_run_and_its_params(tmp_path, caplog):
    pytest.importorskip("mlflow")
    from flaxlight.loggers import MLflowLogger

    first = MLflowLogger(save_dir=tmp_path)
    first.log_hyperparams({"lr": 0.1})
    for step in (1, 2, 3):
        first.log_metrics({"train/loss": float(step)}, step=step)
    first.finalize("interrupted")
    client = _mlflow_client(tmp_path)
    assert client.get_run(first.run_id).info.status == "KILLED"

    second = MLflowLogger(save_dir=tmp_path)
    second.resume_from_step(2)
    second.log_hyperparams({"lr": 0.1})  # the same value again: fine
    second.log_hyperparams({"lr": 0.2})  # params cannot change in MLflow: kept, with a warning
    second.log_metrics({"train/loss": 30.0}, step=3)
    second.finalize("success")
    assert second.run_id == first.run_id
    run = client.get_run(first.run_id)
    assert run.info.status == "FINISHED" and run.data.params == {"lr": "0.1"}
    assert [m.step for m in client.get_metric_history(first.run_id, "train/loss")] == [1, 2, 3, 3]
    assert "cannot change" in caplog.text


def test_mlflow_resume_of_a_vanished_run_starts_a_new_one(tmp_path, caplog):
    pytest.importorskip("mlflow")
    from flaxlight.loggers import MLflowLogger

    logger = MLflowLogger(save_dir=tmp_path)
    (tmp_path / "mlflow_run.json").write_text(json.dumps({"run_id": "0" * 32, "tracking_uri": logger.tracking_uri}))
    logger.resume_from_step(5)
    logger.log_metrics({"train/loss": 1.0}, step=6)
    logger.finalize("success")
    assert logger.run_id != "0" * 32 and "starting a new run" in caplog.text
    assert [m.step for m in _mlflow_client(tmp_path).get_metric_history(logger.run_id, "train/loss")] == [6]


def test_trainer_loggers_kwarg_adds_loggers_beside_csv(tmp_path, regression_loaders):
    pytest.importorskip("mlflow")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from flaxlight.loggers import MLflowLogger

    train, val, _ = regression_loaders
    recorder = RecordingLogger()
    mlflow_logger = MLflowLogger(experiment_name="exp", save_dir=tmp_path / "mlflow")
    trainer = ImageTrainer(
        model_class=TinyMLP, exmp_input=np.zeros((1, 4), np.float32), model_hparams={"hidden_dims": [16]},
        optimizer_hparams={"optimizer": "adam", "lr": 3e-2}, loggers=[mlflow_logger, recorder],
        **quiet(tmp_path, logger_params={"log_dir": str(tmp_path / "run"), "logger_type": "tensorboard"}),
    )
    assert [type(lg) for lg in trainer.logger.loggers] == [CSVLogger, TensorBoardLogger, MLflowLogger, RecordingLogger]
    assert "loggers" not in trainer.config  # logger objects are not hyperparameters
    trainer.train_model(train, val, num_epochs=2)

    assert [c[0] for c in recorder.calls].count("hparams") == 1
    assert recorder.calls[-1] == ("finalize", "success")
    assert ("image", "val/picture", 16, (6, 10, 3)) in recorder.calls
    assert (tmp_path / "run" / "metrics.csv").is_file()
    client = _mlflow_client(tmp_path / "mlflow")
    run = client.get_run(mlflow_logger.run_id)
    assert run.info.status == "FINISHED" and run.data.params["model_hparams.hidden_dims"] == "[16]"
    assert [m.step for m in client.get_metric_history(mlflow_logger.run_id, "train/loss")] == [8, 16]
    events = EventAccumulator(str(tmp_path / "run"), size_guidance={"images": 0})
    events.Reload()
    assert [(i.step, i.width, i.height) for i in events.Images("val/picture")] == [(8, 10, 6), (16, 10, 6)]


# ---------------------------------------------------------------------------- bad input
def test_missing_packages_name_the_extra_to_install_and_make_no_run_folder(tmp_path, monkeypatch):
    from flaxlight.loggers.mlflow import MLflowLogger
    from flaxlight.loggers.wandb import WandbLogger

    monkeypatch.setitem(sys.modules, "wandb", None)
    monkeypatch.setitem(sys.modules, "mlflow", None)
    with pytest.raises(ImportError, match=r"pip install 'flaxlight\[wandb\]'"):
        WandbLogger(save_dir=tmp_path)
    with pytest.raises(ImportError, match=r"pip install 'flaxlight\[mlflow\]'"):
        MLflowLogger(save_dir=tmp_path)
    for kind, extra in (("wandb", "wandb"), ("MLflow", "mlflow")):
        with pytest.raises(ImportError, match=rf"flaxlight\[{extra}\]"):
            _trainer(tmp_path, logger_params={"log_dir": str(tmp_path / kind), "logger_type": kind})
        assert not (tmp_path / kind).exists()  # refused before the run folder is made


def test_bad_loggers_and_logger_types_are_rejected_before_a_run_folder_is_made(tmp_path):
    with pytest.raises(TypeError, match="Logger instances; got dict"):
        _trainer(tmp_path, loggers=[{"type": "csv"}], logger_params={"base_log_dir": str(tmp_path / "runs")})
    with pytest.raises(ValueError, match="Unknown logger_type 'neptune'.*csv, tensorboard, wandb, mlflow"):
        _trainer(tmp_path, logger_params={"log_dir": str(tmp_path / "run"), "logger_type": ["csv", "Neptune"]})
    assert not (tmp_path / "runs").exists() and not (tmp_path / "run").exists()


def test_importing_flaxlight_loggers_imports_neither_wandb_nor_mlflow():
    code = ("import sys, flaxlight, flaxlight.loggers as L; "
            "assert 'wandb' not in sys.modules and 'mlflow' not in sys.modules, 'imported'; "
            "assert L.WandbLogger.__name__ == 'WandbLogger' and L.MLflowLogger.__name__ == 'MLflowLogger'")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]


def test_tensorboard_hparams_tab_gets_the_hyperparameters_and_the_best_metrics(tmp_path, regression_loaders):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path)
    best = trainer.train_model(train, val, num_epochs=3)

    events = EventAccumulator(str(tmp_path / "run"), size_guidance={"tensors": 0})
    events.Reload()
    content = events.PluginTagToContent("hparams")
    assert {"_hparams_/experiment", "_hparams_/session_start_info"} <= set(content)
    session = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"])
    hparams = session.session_start_info.hparams
    assert hparams["optimizer_hparams.lr"].number_value == pytest.approx(0.03)
    assert hparams["model_hparams.hidden_dims"].string_value == "[16]"
    experiment = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/experiment"]).experiment
    assert "best/val/loss" in {info.name.tag for info in experiment.metric_infos}
    (point,) = events.Scalars("best/val/loss")
    assert point.value == pytest.approx(best["val/loss"]) and point.step == trainer.global_step


def test_tensorboard_has_one_epoch_point_per_epoch(tmp_path, regression_loaders):
    """The epoch's train and val records both carry `epoch`: TensorBoard got two equal points per step."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train, val, _ = regression_loaders  # 8 steps per epoch
    _trainer(tmp_path).train_model(train, val, num_epochs=3)
    events = EventAccumulator(str(tmp_path / "run"), size_guidance={"scalars": 0})
    events.Reload()
    assert [(point.step, point.value) for point in events.Scalars("epoch")] == [(8, 1.0), (16, 2.0), (24, 3.0)]
    assert [point.step for point in events.Scalars("val/loss")] == [8, 16, 24]


def test_a_run_stopped_between_an_epochs_training_and_its_validation_resumes_to_one_epoch_point_per_epoch(
        tmp_path, regression_loaders):
    """SIGTERM after epoch 2's training: its checkpoint (step 16) comes before the validation,
    which the resume runs; the new event file wrote `epoch` at step 16 again, beside the one the
    interrupted run wrote with the epoch's train record (the purge hides steps after 16 only)."""
    import signal

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    class TermAfterTraining(flaxlight.Callback):
        def on_train_epoch_end(self, trainer, epoch, metrics):
            if epoch == 2:
                os.kill(os.getpid(), signal.SIGTERM)

    train, val, _ = regression_loaders  # 8 steps per epoch
    with pytest.raises(SystemExit):
        _trainer(tmp_path, callbacks=[TermAfterTraining()]).train_model(train, val, num_epochs=3)
    _trainer(tmp_path).train_model(train, val, num_epochs=3, resume=True)
    events = EventAccumulator(str(tmp_path / "run"), size_guidance={"scalars": 0})
    events.Reload()
    assert [(point.step, point.value) for point in events.Scalars("epoch")] == [(8, 1.0), (16, 2.0), (24, 3.0)]
    assert [point.step for point in events.Scalars("val/loss")] == [8, 16, 24]


def test_continuing_a_metrics_csv_whose_last_line_was_cut_rewrites_it_whole(tmp_path):
    import csv

    from flaxlight.loggers import CSVLogger

    (tmp_path / "metrics.csv").write_text("step,train/loss\n1,0.5\n2,0.2")  # no newline: the last write was cut
    logger = CSVLogger(tmp_path)
    logger.continue_run()
    logger.log_metrics({"train/loss": 0.1}, step=3)
    logger.flush()
    with open(tmp_path / "metrics.csv", newline="") as f:
        assert [(r["step"], r["train/loss"]) for r in csv.DictReader(f)] == [("1", "0.5"), ("2", "0.2"), ("3", "0.1")]



def test_a_new_column_rewrites_metrics_csv_from_what_it_holds_now_and_atomically(tmp_path, monkeypatch):
    """A new column made the logger rewrite metrics.csv (mode "w") from the rows it had read or
    written itself: rows another writer had appended since were lost, and an exit during the
    rewrite could leave the file empty."""
    import csv

    (tmp_path / "metrics.csv").write_text("step,train/loss\n1,0.5\n")
    logger = CSVLogger(tmp_path)
    logger.continue_run()  # a loaded trainer's copy of the rows
    with open(tmp_path / "metrics.csv", "a") as f:
        f.write("2,0.4\n3,0.3\n")  # the run's own process appended since
    logger.log_metrics({"test/loss": 0.9}, step=3)  # a new column: the header must widen
    logger.flush()
    with open(tmp_path / "metrics.csv", newline="") as f:
        rows = list(csv.reader(f))
    assert rows == [["step", "train/loss", "test/loss"], ["1", "0.5", ""], ["2", "0.4", ""], ["3", "0.3", ""],
                    ["3", "", "0.9"]]
    before = (tmp_path / "metrics.csv").read_bytes()

    def exit_midway(self, rows):
        raise KeyboardInterrupt  # the process ends while the rewrite writes

    logger.log_metrics({"test_shifted/loss": 1.5}, step=3)
    monkeypatch.setattr(csv.DictWriter, "writerows", exit_midway)
    with pytest.raises(KeyboardInterrupt):
        logger.flush()
    assert (tmp_path / "metrics.csv").read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == [
        "metrics.csv"]  # the old file whole, no temporary file left


# ---------------------------------------------------------------------------- a run's loggers are its own
def test_resuming_a_run_reopens_its_own_wandb_and_mlflow_runs_when_the_loggers_have_no_save_dir(
        tmp_path, regression_loaders, wandb_offline, monkeypatch):
    """Logger objects without save_dir kept their run ids in the current directory: after another
    run B trained from there, resuming run A appended A's records to B's W&B and MLflow runs."""
    from mlflow.tracking import MlflowClient

    from flaxlight.loggers import MLflowLogger, WandbLogger

    train, val, _ = regression_loaders
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    uri = (tmp_path / "mlruns").as_uri()  # one store for both runs, as a team's server would be

    def trainer(name, **kwargs):
        loggers = [MLflowLogger(experiment_name="shared", run_name=name, tracking_uri=uri),
                   WandbLogger(project="shared", name=name)]
        return _trainer(tmp_path, loggers=loggers, logger_params={"log_dir": str(tmp_path / name)}, **kwargs)

    with pytest.raises(RuntimeError, match="data error"):
        trainer("a", callbacks=[FailAt(11)]).train_model(train, val, num_epochs=2)  # checkpoint at step 8
    other = trainer("b")
    other.train_model(train, val, num_epochs=2)
    other.logger.close()
    resumed = trainer("a")
    resumed.train_model(train, val, num_epochs=2, resume=True)
    resumed.logger.close()

    client = MlflowClient(tracking_uri=uri)
    runs = client.search_runs([client.get_experiment_by_name("shared").experiment_id])
    assert sorted((run.info.run_name, run.info.status) for run in runs) == [("a", "FINISHED"), ("b", "FINISHED")]
    for run in runs:
        assert [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")] == [8, 16], run.info.run_name
    assert not os.listdir(tmp_path / "cwd")  # nothing of either run in the current directory
    runs = {name: [_read_wandb_run(d) for d in _offline_runs(tmp_path / name)] for name in "ab"}
    assert [r["run"].run_id for r in runs["a"]] == [resumed.loggers[2].run_id] * 2  # A's id, twice (resumed)
    assert runs["b"][0]["run"].run_id != resumed.loggers[2].run_id
    assert [step for step, _ in _series(runs["a"][1]["history"], "train/loss")] == [16]
    assert [step for step, _ in _series(runs["b"][0]["history"], "train/loss")] == [8, 16]


def test_a_csv_logger_on_the_runs_metrics_csv_replaces_the_built_in_one(tmp_path, regression_loaders):
    """loggers=[CSVLogger(log_dir)] added a second writer on metrics.csv: rows were duplicated."""
    import csv

    train, val, _ = regression_loaders
    run = tmp_path / "run"
    mine = CSVLogger(run, flush_every_n_records=1)
    trainer = _trainer(tmp_path, loggers=[mine, TensorBoardLogger(run)],
                       logger_params={"log_dir": str(run), "logger_type": "tensorboard"})
    trainer.train_model(train, val, num_epochs=3)
    with open(run / "metrics.csv", newline="") as f:
        rows = [(r["step"], r["train/loss"], r["val/loss"]) for r in csv.DictReader(f)]
    assert len(rows) == len(set(rows)) == 6  # train and val rows of 3 epochs, each once
    assert [type(lg) for lg in trainer.logger.loggers] == [CSVLogger, TensorBoardLogger]  # one of each
    assert trainer.logger.loggers[0] is mine  # yours, with your settings

    with pytest.raises(ValueError, match=r"Two loggers write the metrics file .*metrics\.csv"):
        _trainer(tmp_path, loggers=[CSVLogger(tmp_path / "x"), CSVLogger(tmp_path / "x")])


def test_tensorboard_hyperparameters_logged_again_are_added_to_the_earlier_ones(tmp_path):
    """A second log_hyperparams replaced the HParams tab's settings (W&B, MLflow and Lightning merge)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    logger = TensorBoardLogger(tmp_path)
    logger.log_hyperparams({"seed": 3, "optimizer_hparams": {"lr": 0.1, "optimizer": "adam"}})
    logger.log_hyperparams({"data": {"n_train": 256}, "optimizer_hparams": {"lr": 0.2}})  # e.g. from a callback
    logger.log_best_metrics({"val/loss": 0.5}, step=10)
    logger.finalize("success")

    events = EventAccumulator(str(tmp_path), size_guidance={"tensors": 0})
    events.Reload()
    session = plugin_data_pb2.HParamsPluginData.FromString(
        events.PluginTagToContent("hparams")["_hparams_/session_start_info"]).session_start_info
    assert {key: value.number_value or value.string_value for key, value in session.hparams.items()} == {
        "seed": 3, "optimizer_hparams.lr": 0.2, "optimizer_hparams.optimizer": "adam", "data.n_train": 256}
    text = events.Tensors("hparams/text_summary")[-1].tensor_proto.string_val[0].decode()
    assert "seed: 3" in text and "lr: 0.2" in text and "n_train: 256" in text


def test_records_after_a_failed_run_reopen_its_wandb_run_once_and_it_ends_failed_as_mlflow_says(
        tmp_path, regression_loaders, wandb_offline):
    """Each record after a failed run (test(), log_metrics) reopened and finished the W&B run (one
    run folder per record); a loaded failed run's W&B part ended with exit code 0, MLflow's FAILED."""
    train, val, test = regression_loaders
    run = tmp_path / "run"
    trainer = _trainer(tmp_path, callbacks=[FailAt(11)],
                       logger_params={"log_dir": str(run), "logger_type": ["wandb", "mlflow"]})
    with pytest.raises(RuntimeError, match="data error"):
        trainer.train_model(train, val, num_epochs=2)
    trainer.test(test)
    for i in range(3):
        trainer.log_metrics({"post/x": float(i)}, step=100 + i)
    trainer.logger.close()

    runs = [_read_wandb_run(d) for d in _offline_runs(run)]
    assert len(runs) == 2 and [r["exit_code"] for r in runs] == [1, 1]  # the run, then one for the late records
    assert [step for step, _ in _series(runs[1]["history"], "post/x")] == [100, 101, 102]
    assert _series(runs[1]["history"], "test/loss")

    loaded = RegressTrainer.load_from_checkpoint(run, exmp_input=np.zeros((1, 4), np.float32),
                                                 enable_progress_bar=False)
    loaded.test(test)
    loaded.logger.close()
    runs = [_read_wandb_run(d) for d in _offline_runs(run)]
    assert len(runs) == 3 and runs[2]["exit_code"] == 1 and _series(runs[2]["history"], "test/loss")
    assert len({r["run"].run_id for r in runs}) == 1
    assert _mlflow_client(run).get_run(loaded.loggers[2].run_id).info.status == "FAILED"


def test_the_flaxlight_view_docstring_example_runs(tmp_path, regression_loaders):
    """The module docstring's callback logged from on_log without a guard: RecursionError."""
    import csv
    import doctest

    import flaxlight.view

    namespace = {"flaxlight": flaxlight}
    for example in doctest.DocTestParser().get_examples(flaxlight.view.__doc__):
        exec(example.source, namespace)
    (callback_class,) = [v for v in namespace.values() if isinstance(v, type) and issubclass(v, flaxlight.Callback)
                         and v is not flaxlight.Callback]
    train, _, _ = regression_loaders
    _trainer(tmp_path, callbacks=[callback_class()], log_every_n_steps=4).train_model(train, None, num_epochs=1)
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["step"], r["epoch_seen"]) for r in rows if r["epoch_seen"]] == [("4", "1.0"), ("8", "1.0")]


def test_lightning_names_trainer_loggers_and_the_loggers_own_attributes(tmp_path, wandb_offline):
    """trainer.loggers is the list; each logger says where it writes; Lightning-only arguments and
    typos fail when the logger is built, not at the first record in the background."""
    pytest.importorskip("mlflow")
    from flaxlight.loggers import MLflowLogger, WandbLogger

    trainer = _trainer(tmp_path, logger_params={"log_dir": str(tmp_path / "run"),
                                                "logger_type": ["tensorboard", "wandb", "mlflow"]})
    csv_logger, tb, wandb_logger, mlflow_logger = trainer.loggers
    assert [type(lg) for lg in trainer.loggers] == [CSVLogger, TensorBoardLogger, WandbLogger, MLflowLogger]
    assert {lg.save_dir for lg in trainer.loggers} == {trainer.log_dir} == {csv_logger.log_dir, tb.log_dir}
    assert wandb_logger.version is None and mlflow_logger.version is None  # no run before a record
    assert type(mlflow_logger.experiment).__name__ == "MlflowClient"
    with pytest.raises(AttributeError, match=r"trainer\.loggers\[2\] \(WandbLogger\)"):
        trainer.logger.experiment
    assert not (tmp_path / "run" / "wandb").exists()  # asking did not start a W&B run

    with pytest.raises(TypeError, match=r"log_model=.*Lightning.*does not upload checkpoints"):
        WandbLogger(log_model="all")
    with pytest.raises(TypeError, match=r"unknown argument 'projct'\. Did you mean 'project'\?"):
        WandbLogger(projct="x")
    assert WandbLogger(version="abc123").run_id == "abc123"  # Lightning's other name for id
    with pytest.raises(ValueError, match="id='a' and version='b'"):
        WandbLogger(id="a", version="b")


def test_one_wandb_or_mlflow_logger_object_given_to_two_trainers_is_refused(tmp_path, wandb_offline,
                                                                            regression_loaders):
    from flaxlight.loggers import MLflowLogger, WandbLogger

    train, val, _ = regression_loaders
    for name, logger in (("mlflow", MLflowLogger(experiment_name="x", tracking_uri=(tmp_path / "mlruns").as_uri())),
                         ("wandb", WandbLogger(project="x"))):
        unused = _trainer(tmp_path, loggers=[logger], logger_params={"log_dir": str(tmp_path / f"{name}-unused")})
        first = _trainer(tmp_path, loggers=[logger], logger_params={"log_dir": str(tmp_path / name)})  # none started yet
        first.train_model(train, val, num_epochs=1)
        _trainer(tmp_path, loggers=[logger], logger_params={"log_dir": str(tmp_path / name)})  # the same run: fine
        with pytest.raises(ValueError, match=r"already logs the run in .*Give each trainer a logger object"):
            _trainer(tmp_path, loggers=[logger], logger_params={"log_dir": str(tmp_path / f"{name}-second")})
        del unused
        logger.close()


class _SamplesSeen(flaxlight.Callback):
    """Logs each epoch's loss against the examples seen (32 per step), a step of its own."""

    def on_train_epoch_end(self, trainer, epoch, metrics):
        trainer.log_metrics({"samples/train_loss": metrics["train/loss"]}, step=trainer.global_step * 32)


def _samples_points(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with open(run / "metrics.csv") as f:
        rows = [(int(r["step"]), float(r["samples/train_loss"]), r.get("trainer/global_step"))
                for r in csv.DictReader(f) if r.get("samples/train_loss")]
    events = EventAccumulator(str(run), size_guidance={"scalars": 0})
    events.Reload()
    return rows, [(e.step, round(e.value, 5)) for e in events.Scalars("samples/train_loss")]


def test_a_resume_keeps_the_records_logged_before_its_checkpoint_with_a_later_step_of_their_own(
        tmp_path, regression_loaders):
    """A record logged at step 8 with step=256 was dropped from metrics.csv and purged from
    TensorBoard by a resume from checkpoint 13 (kept only rows whose step column was <= 13)."""
    from conftest import SigtermAt

    train, val, _ = regression_loaders
    logged = {"logger_type": ["tensorboard"]}
    _trainer(tmp_path / "whole", callbacks=[_SamplesSeen(), flaxlight.callbacks.LearningRateMonitor()],
             log_every_n_steps=3, logger_params={**logged, "log_dir": str(tmp_path / "whole")}).train_model(
        train, val, num_epochs=3)
    with open(tmp_path / "whole" / "metrics.csv") as f:  # train/lr: logged at its (late) log point's own step
        assert not [row for row in csv.DictReader(f) if row["train/lr"] and row["trainer/global_step"]]
    cut = {**logged, "log_dir": str(tmp_path / "cut")}
    with pytest.raises(SystemExit):  # SIGTERM at step 13: the record of step 8 (step=256) is already written
        _trainer(tmp_path, callbacks=[_SamplesSeen(), SigtermAt(13)], logger_params=cut).train_model(
            train, val, num_epochs=3)
    _trainer(tmp_path, callbacks=[_SamplesSeen()], logger_params=cut).train_model(train, val, num_epochs=3,
                                                                                  resume=True)
    rows, scalars = _samples_points(tmp_path / "cut")
    assert rows == _samples_points(tmp_path / "whole")[0]
    assert [(step, position) for step, _, position in rows] == [(256, "8"), (512, "16"), (768, "24")]
    assert scalars == _samples_points(tmp_path / "whole")[1] and [step for step, _ in scalars] == [256, 512, 768]


def test_the_csv_position_column_appears_only_with_a_step_of_ones_own(tmp_path):
    """metrics.csv keeps its columns for runs that log with the trainer's step."""
    csv_logger = CSVLogger(tmp_path)
    csv_logger.log_metrics({"train/loss": 1.0}, step=8)
    csv_logger.flush()
    assert (tmp_path / "metrics.csv").read_text().splitlines()[0] == "step,train/loss"
    csv_logger.log_metrics({"samples/loss": 0.5}, step=flaxlight.loggers.csv.LoggedStep(512, global_step=16))
    csv_logger.log_metrics({"train/loss": 0.4}, step=17)
    csv_logger.flush()
    assert (tmp_path / "metrics.csv").read_text().splitlines() == [
        "step,train/loss,samples/loss,trainer/global_step", "8,1.0,,", "512,,0.5,16", "17,0.4,,"]
    again = CSVLogger(tmp_path)
    again.resume_from_step(16)  # logged at 16: kept, whatever its step
    assert (tmp_path / "metrics.csv").read_text().splitlines()[1:] == ["8,1.0,,", "512,,0.5,16"]


class _DataSize(flaxlight.Callback):
    """Logs a number once at the start, at step 0 (a row whose step is 0)."""

    def on_fit_start(self, trainer):
        trainer.log_metrics({"data/train_examples": 256.0})


def test_a_tensorboard_run_with_a_row_at_step_0_resumes(tmp_path, regression_loaders):
    """A row at step 0 (logged from on_fit_start) made the TensorBoard resume fail with a TypeError
    (its step read as None) once records logged ahead of their step were looked for."""
    from conftest import SigtermAt

    train, val, _ = regression_loaders
    logged = {"logger_type": ["tensorboard"], "log_dir": str(tmp_path / "run")}
    with pytest.raises(SystemExit):
        _trainer(tmp_path, callbacks=[_DataSize(), SigtermAt(13)], logger_params=logged).train_model(
            train, val, num_epochs=3)
    trainer = _trainer(tmp_path, callbacks=[_DataSize()], logger_params=logged)
    trainer.train_model(train, val, num_epochs=3, resume=True)
    assert trainer.current_epoch == 3
    with open(tmp_path / "run" / "metrics.csv") as f:
        assert [row["step"] for row in csv.DictReader(f) if row["data/train_examples"]][0] == "0"
