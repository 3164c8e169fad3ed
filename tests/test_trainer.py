import csv
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from conftest import ClassifyTrainer, RegressTrainer, TinyMLP, linear_data, quiet

import flaxlight
from flaxlight import ArrayLoader, TrainerModule, make_eval_step, make_train_step


def _regressor(tmp_path, **kwargs):
    x0 = np.zeros((1, 4), np.float32)
    kwargs.setdefault("model_hparams", {"hidden_dims": [16], "output_dim": 1})
    kwargs.setdefault("optimizer_hparams", {"optimizer": "adam", "lr": 3e-2})
    return RegressTrainer(model_class=TinyMLP, exmp_input=x0, **quiet(tmp_path, **kwargs))


def test_train_model_learns_and_writes_the_run_directory(tmp_path, regression_loaders):
    train, val, test = regression_loaders
    trainer = _regressor(tmp_path, check_val_every_n_epoch=2)
    metrics = trainer.train_model(train, val, test_loader=test, num_epochs=6)
    assert metrics["test/loss"] < 0.05 and metrics["val/loss"] < 0.05
    assert {"train/loss", "val/loss", "test/loss", "epoch_time"} <= set(metrics)

    run = tmp_path / "run"
    hparams = yaml.safe_load((run / "hparams.yaml").read_text())
    assert hparams["model_class"].endswith("TinyMLP") and hparams["model_hparams"]["hidden_dims"] == [16]
    assert sorted(os.listdir(run / "metrics")) == [
        "best_eval.json", "eval_epoch_002.json", "eval_epoch_004.json", "eval_epoch_006.json", "test.json"]
    assert json.loads((run / "metrics" / "test.json").read_text())["test/loss"] == pytest.approx(metrics["test/loss"])
    rows = list(csv.DictReader(open(run / "metrics.csv")))
    epoch_rows = [r for r in rows if r["train/loss"]]
    assert [int(r["step"]) for r in epoch_rows] == [8, 16, 24, 32, 40, 48]  # 8 steps per epoch
    assert [r["epoch"] for r in epoch_rows] == ["1", "2", "3", "4", "5", "6"]
    assert len([r for r in rows if r["val/loss"]]) == 3
    assert len(os.listdir(run / "checkpoints")) == 1


def test_tensorboard_event_files_hold_the_scalars(tmp_path, regression_loaders):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    train, val, _ = regression_loaders
    trainer = _regressor(tmp_path, logger_params={"log_dir": str(tmp_path / "run"), "logger_type": ["csv", "tensorboard"]})
    trainer.train_model(train, val, num_epochs=2)
    events = EventAccumulator(str(tmp_path / "run"))
    events.Reload()
    assert [e.step for e in events.Scalars("train/loss")] == [8, 16]
    assert [e.step for e in events.Scalars("val/loss")] == [8, 16]


def test_running_train_metrics_are_logged_at_log_points(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = _regressor(tmp_path, log_every_n_steps=4)
    trainer.train_model(train, val, num_epochs=2)
    rows = list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))
    assert [int(r["step"]) for r in rows if r["train/loss_step"]] == [4, 8, 12, 16]


def test_default_log_dir_is_versioned_per_model(tmp_path):
    x0 = np.zeros((1, 4), np.float32)
    kwargs = dict(model_class=TinyMLP, model_hparams={}, optimizer_hparams={}, exmp_input=x0,
                  enable_progress_bar=False, enable_model_summary=False,
                  logger_params={"base_log_dir": str(tmp_path)})
    first, second = RegressTrainer(**kwargs), RegressTrainer(**kwargs)
    assert first.log_dir == str(tmp_path / "TinyMLP" / "version_0")
    assert second.log_dir == str(tmp_path / "TinyMLP" / "version_1")


def test_a_version_folder_nothing_was_written_into_is_given_back(tmp_path, regression_loaders):
    """A trainer built and dropped (a notebook cell run again) left an empty version_N folder each time."""
    import gc

    kwargs = dict(model_class=TinyMLP, model_hparams={}, optimizer_hparams={}, exmp_input=np.zeros((1, 4), np.float32),
                  enable_progress_bar=False, enable_model_summary=False, logger_params={"base_log_dir": str(tmp_path)})
    dropped = RegressTrainer(**kwargs)
    (tmp_path / "TinyMLP" / "notes.txt").write_text("the user's")  # beside the runs: never touched
    del dropped
    gc.collect()
    assert sorted(p.name for p in (tmp_path / "TinyMLP").iterdir()) == ["notes.txt"]
    trained = RegressTrainer(**kwargs)
    trained.train_model(*regression_loaders[:2], num_epochs=1)
    kept = trained.log_dir
    del trained
    gc.collect()
    assert os.path.isfile(os.path.join(kept, "hparams.yaml")) and os.listdir(os.path.join(kept, "checkpoints"))


def test_a_version_folder_another_trainer_was_given_is_not_given_back(tmp_path, regression_loaders):
    """Trainer B built on trainer A's version folder: dropping A removed the folder under B, whose
    train_model then failed on its lock file (review)."""
    import gc

    kwargs = dict(model_class=TinyMLP, model_hparams={}, optimizer_hparams={}, exmp_input=np.zeros((1, 4), np.float32),
                  enable_progress_bar=False, enable_model_summary=False)
    first = RegressTrainer(**kwargs, logger_params={"base_log_dir": str(tmp_path)})
    second = RegressTrainer(**kwargs, logger_params={"log_dir": first.log_dir})
    del first
    gc.collect()
    second.train_model(*regression_loaders[:2], num_epochs=1)
    assert os.path.isfile(os.path.join(second.log_dir, "hparams.yaml"))


def test_best_model_is_restored_for_testing(tmp_path, regression_loaders):
    train, val, test = regression_loaders

    class WorseOverTime(RegressTrainer):  # claims epoch 1 was the best: the test must use epoch 1's weights
        def is_new_model_better(self, new, old):
            return old is None

    trainer = _regressor(tmp_path, model_hparams={"hidden_dims": [16], "output_dim": 1})
    trainer.__class__ = WorseOverTime
    trainer.create_jitted_functions()
    metrics = trainer.train_model(train, val, test_loader=test, num_epochs=3)
    assert int(trainer.state.step) == trainer.global_step == 24  # restored for the test only: the trainer goes on

    def saved(name):
        return json.loads((tmp_path / "run" / "metrics" / f"{name}.json").read_text())

    epoch_1, epoch_3 = saved("eval_epoch_001"), saved("eval_epoch_003")
    assert epoch_3["val/loss"] < epoch_1["val/loss"]  # later epochs were better; the rule keeps epoch 1
    assert saved("best_eval") == pytest.approx(epoch_1)  # best_eval.json holds epoch 1's validation
    assert metrics["val/loss"] == pytest.approx(epoch_1["val/loss"])
    rows = list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))
    train_loss = {int(r["step"]): float(r["train/loss"]) for r in rows if r["train/loss"]}
    assert train_loss[24] < train_loss[8]
    assert metrics["train/loss"] == pytest.approx(train_loss[8])  # epoch 1's train metrics, not the last epoch's
    assert metrics["test/loss"] == pytest.approx(saved("test")["test/loss"])
    best = WorseOverTime.load_from_checkpoint(trainer.log_dir, exmp_input=np.zeros((1, 4), np.float32))
    assert int(best.state.step) == 8  # the best (first) epoch's checkpoint is the one tested
    assert best.eval_model(test, log_prefix="test/")["test/loss"] == pytest.approx(metrics["test/loss"])
    assert trainer.eval_model(test, log_prefix="test/")["test/loss"] != pytest.approx(metrics["test/loss"])


def test_monitor_and_mode_choose_the_best_model(tmp_path):
    trainer = _regressor(tmp_path, monitor="val/mae", mode="min")
    assert trainer.is_new_model_better({"val/mae": 1.0}, {"val/mae": 2.0})
    assert not trainer.is_new_model_better({"val/mae": 3.0}, {"val/mae": 2.0})
    seed_default = _regressor(tmp_path)
    assert seed_default.is_new_model_better({"val/acc": 0.9, "val/loss": 9.0}, {"val/acc": 0.8, "val/loss": 1.0})
    with pytest.raises(KeyError, match="monitor="):
        seed_default.is_new_model_better({"val/mae": 1.0}, {"val/mae": 2.0})


def test_a_nan_monitored_value_ranks_below_every_number(tmp_path):
    nan = float("nan")
    for mode, good in (("max", 0.9), ("min", 0.1)):
        trainer = _regressor(tmp_path, monitor="val/score", mode=mode)
        assert trainer.is_new_model_better({"val/score": good}, {"val/score": nan})  # any number beats NaN
        assert not trainer.is_new_model_better({"val/score": nan}, {"val/score": good})
        assert trainer.is_new_model_better({"val/score": nan}, {"val/score": nan})  # unrankable: the newer
        assert trainer.is_new_model_better({"val/score": nan}, None)
    seed_default = _regressor(tmp_path)  # the seed's priority: val/loss (min)
    assert seed_default.is_new_model_better({"val/loss": 5.0}, {"val/loss": nan})


class _ScoreTrainer(RegressTrainer):
    """Adds ``score``, a function of the step (8 steps per epoch): NaN at the first validation, then
    -(step - 16)**2, best at epoch 2; ``ALWAYS_NAN`` makes it NaN at every validation."""

    ALWAYS_NAN = False

    def loss_fn(self, params, batch, *, train, rng, state):
        loss, (metrics, updates) = super().loss_fn(params, batch, train=train, rng=rng, state=state)
        step = state.step.astype(jnp.float32)
        nan = step <= 8 if not self.ALWAYS_NAN else True
        return loss, ({**metrics, "score": jnp.where(nan, jnp.nan, -(step - 16) ** 2)}, updates)


@pytest.mark.parametrize("chooser", ["trainer", "callback"])
def test_a_nan_first_validation_does_not_stay_the_best(tmp_path, regression_loaders, capsys, chooser):
    train, val, test = regression_loaders
    if chooser == "trainer":
        kwargs = {"monitor": "val/score", "mode": "max"}
    else:
        kwargs = {"callbacks": [flaxlight.callbacks.ModelCheckpoint(monitor="val/score", mode="max")]}
    trainer = _ScoreTrainer(model_class=TinyMLP, exmp_input=np.zeros((1, 4), np.float32), model_hparams={},
                            optimizer_hparams={"optimizer": "adam", "lr": 3e-2}, **quiet(tmp_path, **kwargs))
    metrics = trainer.train_model(train, val, num_epochs=3)
    assert [row["val/score"] for row in trainer.history][1:] == [0.0, -64.0]
    assert np.isnan(trainer.history[0]["val/score"])
    assert metrics["val/score"] == 0.0  # epoch 2's, not epoch 1's NaN
    best_eval = json.loads((tmp_path / "run" / "metrics" / "best_eval.json").read_text())
    assert best_eval["val/score"] == 0.0
    assert sorted(int(s) for s in os.listdir(tmp_path / "run" / "checkpoints")) == [16, 24]  # best and last
    tested = trainer.test(test)
    assert int(trainer.state.step) == trainer.global_step == 24  # the test restored the best for itself only
    loaded = _ScoreTrainer.load_from_checkpoint(str(tmp_path / "run"), exmp_input=np.zeros((1, 4), np.float32))
    assert int(loaded.state.step) == 16
    assert loaded.test(test)["test/loss"] == pytest.approx(tested["test/loss"])  # test() used epoch 2's model
    err = capsys.readouterr().err
    assert err.count("The monitored metric val/score is NaN at the validation of epoch 1 (step 8)") == 1
    assert "ranks below every number" in err


def test_a_monitored_value_nan_at_every_validation_makes_the_newest_the_best(tmp_path, regression_loaders, capsys):
    train, val, test = regression_loaders

    class AlwaysNaN(_ScoreTrainer):
        ALWAYS_NAN = True

    trainer = AlwaysNaN(model_class=TinyMLP, exmp_input=np.zeros((1, 4), np.float32),
                        model_hparams={}, optimizer_hparams={"optimizer": "adam", "lr": 3e-2},
                        **quiet(tmp_path, monitor="val/score", mode="max"))
    metrics = trainer.train_model(train, val, num_epochs=3)
    epoch_3 = json.loads((tmp_path / "run" / "metrics" / "eval_epoch_003.json").read_text())
    assert metrics["val/loss"] == pytest.approx(epoch_3["val/loss"]) and np.isnan(metrics["val/score"])
    best_eval = json.loads((tmp_path / "run" / "metrics" / "best_eval.json").read_text())
    assert best_eval["val/loss"] == pytest.approx(epoch_3["val/loss"])
    assert os.listdir(tmp_path / "run" / "checkpoints") == ["24"]
    tested = trainer.test(test)["test/loss"]
    assert tested == pytest.approx(trainer.test(test, which="last")["test/loss"])  # the newest validated model
    assert capsys.readouterr().err.count("The monitored metric val/score is NaN") == 1  # said once, not 3 times


@pytest.mark.parametrize("save_last", [False, True])
def test_a_checkpoint_monitor_nan_at_every_validation_keeps_the_newest_as_the_best(tmp_path, regression_loaders,
                                                                                    save_last):
    """ModelCheckpoint(monitor=...) never ranked a NaN: with save_last=False no checkpoint was written at
    all (which='best' failed with "saved no model yet"), while the trainer's records named the newest
    validation the best. One rule now ranks both: the newest of the NaN validations is the best."""
    train, val, test = regression_loaders

    class AlwaysNaN(_ScoreTrainer):
        ALWAYS_NAN = True

    checkpoint = flaxlight.callbacks.ModelCheckpoint(monitor="val/score", mode="max", save_last=save_last)
    trainer = AlwaysNaN(model_class=TinyMLP, exmp_input=np.zeros((1, 4), np.float32), model_hparams={},
                        optimizer_hparams={"optimizer": "adam", "lr": 3e-2}, **quiet(tmp_path, callbacks=[checkpoint]))
    metrics = trainer.train_model(train, val, num_epochs=3)
    assert os.listdir(tmp_path / "run" / "checkpoints") == ["24"]
    assert checkpoint.best_model_path == str(tmp_path / "run" / "checkpoints" / "24")
    assert np.isnan(checkpoint.best_model_score)
    loaded = AlwaysNaN.load_from_checkpoint(str(tmp_path / "run"), exmp_input=np.zeros((1, 4), np.float32),
                                            which="best")
    assert int(loaded.state.step) == 24
    assert loaded.test(test)["test/loss"] == pytest.approx(trainer.test(test)["test/loss"])
    assert metrics["val/loss"] == pytest.approx(trainer.history[-1]["val/loss"])  # the records name the same one


def test_seed_methods_work_on_their_own(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = _regressor(tmp_path)
    trainer.init_optimizer(num_epochs=2, num_steps_per_epoch=len(train))
    first = trainer.train_epoch(train)["train/loss"]
    second = trainer.train_epoch(train)["train/loss"]
    assert second < first
    assert set(trainer.eval_model(val, log_prefix="val/")) == {"val/loss"}
    state, metrics = trainer.train_step(trainer.state, next(iter(train)))
    assert float(metrics["loss"]) > 0 and int(state.step) == 2 * len(train) + 1


def test_create_functions_gives_full_control(tmp_path, regression_loaders):
    train, val, _ = regression_loaders

    def loss(params, batch, *, train, rng, state):
        x, y = batch
        pred, _ = state.apply_model(params, x, train=train, rng=rng)
        return jnp.mean(jnp.abs(pred - y)), {}

    class L1Trainer(TrainerModule):
        def create_functions(self):
            return make_train_step(loss), make_eval_step(loss)

    trainer = L1Trainer(model_class=TinyMLP, model_hparams={}, optimizer_hparams={"lr": 3e-2},
                        exmp_input=np.zeros((1, 4), np.float32), **quiet(tmp_path))
    assert trainer.train_model(train, val, num_epochs=5)["val/loss"] < 0.3


def test_batch_norm_dropout_classifier_and_bind_model(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 6)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int32)
    train = ArrayLoader(x[:200], y[:200], batch_size=32, shuffle=True)
    val = ArrayLoader(x[200:], y[200:], batch_size=50)
    trainer = ClassifyTrainer(model_class=TinyMLP,
                              model_hparams={"hidden_dims": [32], "output_dim": 2, "batch_norm": True, "dropout_prob": 0.1},
                              optimizer_hparams={"optimizer": "adamw", "lr": 1e-2}, exmp_input=x[:1],
                              **quiet(tmp_path, monitor="val/acc", mode="max"))
    metrics = trainer.train_model(train, val, num_epochs=8)
    assert metrics["val/acc"] > 0.9
    model = trainer.bind_model()  # the model as training left it: the last validation's, not the best's
    logits = model(x[200:], train=False)
    last = [row["val/acc"] for row in trainer.history if "val/acc" in row][-1]
    assert float((np.asarray(logits).argmax(-1) == y[200:]).mean()) == pytest.approx(last, abs=1e-6)


def test_debug_mode_runs_unjitted(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = _regressor(tmp_path, debug=True)
    assert not hasattr(trainer.train_step, "lower")  # a plain Python function: prints and breakpoints work
    trainer.init_optimizer(1, len(train))
    assert trainer.train_epoch(train)["train/loss"] > 0


def test_no_implicit_device_to_host_transfer_in_the_training_loop(tmp_path):
    train = ArrayLoader(*linear_data(2000, 0), batch_size=8)  # 250 steps
    trainer = _regressor(tmp_path, log_every_n_steps=50)
    trainer.init_optimizer(1, len(train))
    trainer.train_epoch(train)  # compile outside the guard
    with jax.transfer_guard_device_to_host("disallow"):
        metrics = trainer.train_epoch(train)
    assert metrics["train/loss"] >= 0


def test_plain_line_per_epoch_under_ci(tmp_path, regression_loaders, capsys, monkeypatch):
    monkeypatch.setenv("CI", "true")
    train, val, _ = regression_loaders
    _regressor(tmp_path, enable_progress_bar=True).train_model(train, val, num_epochs=2)
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("Epoch ")]
    assert len(lines) == 2 and "train/loss=" in lines[0] and "val/loss=" in lines[1]
