"""Best-model checkpoints and load_from_checkpoint, for both constructor styles."""

import numpy as np
import pytest
from conftest import RegressTrainer, TinyMLP, linear_data, quiet

import flaxlight
from flaxlight import TrainerModule


class NamedHparamsTrainer(RegressTrainer):
    """The seed's pattern: model hyperparameters are constructor arguments."""

    def __init__(self, hidden_dims, output_dim, **kwargs):
        super().__init__(model_class=TinyMLP, model_hparams={"hidden_dims": hidden_dims, "output_dim": output_dim},
                         **kwargs)


X0 = np.zeros((1, 4), np.float32)


def test_load_from_checkpoint_with_model_class_constructor(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8, 8]},
                             optimizer_hparams={"lr": 1e-2}, exmp_input=X0, **quiet(tmp_path))
    trainer.train_model(train, val, num_epochs=2)
    expected = trainer.eval_model(val, log_prefix="val/")

    loaded = RegressTrainer.load_from_checkpoint(trainer.log_dir, exmp_input=X0, enable_progress_bar=False)
    assert loaded.eval_model(val, log_prefix="val/") == pytest.approx(expected, rel=1e-6)
    assert int(loaded.state.step) == int(trainer.state.step)
    assert loaded.state.opt_state is None  # inference only until init_optimizer is called


def test_load_from_checkpoint_flattens_model_hparams_for_the_seed_pattern(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = NamedHparamsTrainer(hidden_dims=[8], output_dim=1, optimizer_hparams={"lr": 1e-2},
                                  exmp_input=X0, **quiet(tmp_path))
    trainer.train_model(train, val, num_epochs=2)
    loaded = NamedHparamsTrainer.load_from_checkpoint(trainer.log_dir, exmp_input=X0)
    assert loaded.model_hparams == {"hidden_dims": [8], "output_dim": 1}
    assert loaded.eval_model(val) == pytest.approx(trainer.eval_model(val), rel=1e-6)
    # the loaded trainer can keep training
    loaded.init_optimizer(1, len(train))
    assert loaded.train_epoch(train)["train/loss"] > 0


def test_batch_stats_survive_the_checkpoint(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8], "batch_norm": True},
                             optimizer_hparams={"lr": 1e-2}, exmp_input=X0, **quiet(tmp_path))
    trainer.train_model(train, val, num_epochs=2)
    loaded = RegressTrainer.load_from_checkpoint(trainer.log_dir, exmp_input=X0)
    np.testing.assert_array_equal(loaded.state.batch_stats["BatchNorm_0"]["mean"],
                                  trainer.state.batch_stats["BatchNorm_0"]["mean"])


def test_load_from_checkpoint_explains_a_wrong_directory(tmp_path):
    with pytest.raises(FileNotFoundError, match="hparams.yaml"):
        RegressTrainer.load_from_checkpoint(tmp_path, exmp_input=X0)
    (tmp_path / "hparams.yaml").write_text("model_class: x.Y\nmodel_hparams: {}\n")
    with pytest.raises(FileNotFoundError, match="No checkpoint"):
        TrainerModule.load_from_checkpoint(tmp_path, exmp_input=X0)


@pytest.mark.filterwarnings("ignore:Specifying a key will be required:UserWarning")  # optax's, on noisy_sgd
def test_an_optimizer_state_holding_a_typed_prng_key_checkpoints_and_resumes_exactly(tmp_path, regression_loaders):
    """optax.noisy_sgd keeps a ``jax.random.key`` in its state: saved as its raw data, restored as
    a key of the same implementation, and a resumed run equals an uninterrupted one bitwise."""
    import jax

    train, val, _ = regression_loaders

    def make(log_dir):
        hparams = {"optimizer": "noisy_sgd", "lr": 1e-2, "schedule": "constant"}  # the same at any run length
        return RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8], "output_dim": 1},
                              optimizer_hparams=hparams, exmp_input=X0, seed=0,
                              **quiet(tmp_path, logger_params={"log_dir": str(tmp_path / log_dir)}))

    straight = make("straight")
    straight.train_model(train, val, num_epochs=3)
    first = make("resumed")
    first.train_model(train, val, num_epochs=2)
    resumed = make("resumed")
    resumed.train_model(train, val, num_epochs=3, resume=True)
    keys = [leaf for leaf in jax.tree.leaves(resumed.state.opt_state)
            if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key)]
    assert keys, "noisy_sgd's state holds a typed key"
    for a, b in zip(jax.tree.leaves(straight.state.params), jax.tree.leaves(resumed.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_run_whose_optimizer_took_a_function_loads_for_inference_and_asks_for_it_to_train(tmp_path,
                                                                                         regression_loaders):
    """hparams.yaml records a schedule or weight-decay mask function by name only: loading for
    inference works, loading with the optimizer asks for optimizer_hparams again (a recorded
    mask string was taken as 'decay everything' before), and a string mask is refused."""
    import jax
    import optax

    train, val, _ = regression_loaders
    for key, function in (("weight_decay_mask", lambda p: jax.tree.map(lambda a: a.ndim > 1, p)),
                          ("schedule", optax.linear_schedule(1e-2, 0.0, 16))):
        hparams = {"optimizer": "sgd", "lr": 1e-2, "weight_decay": 0.1, key: function}
        if key == "schedule":
            del hparams["lr"]  # the schedule function is the rate (an lr next to it is refused)
        trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, optimizer_hparams=hparams,
                                 exmp_input=X0, **quiet(tmp_path, logger_params={"log_dir": str(tmp_path / key)}))
        trainer.train_model(train, val, num_epochs=2)
        loaded = RegressTrainer.load_from_checkpoint(trainer.log_dir, exmp_input=X0)
        np.testing.assert_array_equal(loaded.predict(train), trainer.predict(train, which="best"))
        with pytest.raises(ValueError, match=rf"optimizer_hparams\['{key}'\] was a function .* pass the optimizer"):
            RegressTrainer.load_from_checkpoint(trainer.log_dir, exmp_input=X0, which="last", with_optimizer=True)
        RegressTrainer.load_from_checkpoint(trainer.log_dir, exmp_input=X0, which="last", with_optimizer=True,
                                            optimizer_hparams=hparams)
    with pytest.raises(ValueError, match="weight_decay_mask'] must be a function"):
        flaxlight.optim.make_optimizer({"weight_decay": 0.1, "weight_decay_mask": "all"}, 10)


def _csv_rows(run):
    import csv

    with open(run / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_a_loaded_runs_test_adds_to_its_records_and_tests_the_checkpoint_it_loaded(tmp_path, regression_loaders):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    train, val, _ = regression_loaders
    run = tmp_path / "run"
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, optimizer_hparams={"lr": 1e-2},
                             exmp_input=X0, monitor="val/loss", mode="max",  # the best is the first, worst epoch
                             **quiet(tmp_path, logger_params={"log_dir": str(run), "logger_type": ["csv", "mlflow"]}))
    trainer.train_model(train, val, num_epochs=3)
    last_metrics, rows = trainer.eval_model(val, log_prefix="test/"), _csv_rows(run)

    loaded = RegressTrainer.load_from_checkpoint(run, exmp_input=X0, which="last", enable_progress_bar=False)
    assert loaded.test(val) == pytest.approx(last_metrics, rel=1e-6)  # the loaded (last) model, not the best
    assert loaded.global_step == trainer.global_step
    loaded.logger.flush()
    after = _csv_rows(run)
    assert [{k: v for k, v in r.items() if v} for r in after[:-1]] == [{k: v for k, v in r.items() if v} for r in rows]
    assert float(after[-1]["test/loss"]) == pytest.approx(last_metrics["test/loss"], rel=1e-6)
    client = MlflowClient(tracking_uri=(run / "mlruns").as_uri())
    (only,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert only.info.status == "FINISHED" and "test/loss" in only.data.metrics  # the same run, ended again
    assert loaded.test(val, which="best")["test/loss"] > last_metrics["test/loss"]  # asked for: the best (worst) one


def test_load_from_checkpoint_with_another_log_dir_loads_the_run_and_logs_there(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, optimizer_hparams={"lr": 1e-2},
                             exmp_input=X0, **quiet(tmp_path))
    trainer.train_model(train, val, num_epochs=2)
    rows = _csv_rows(tmp_path / "run")
    loaded = RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=X0,
                                                 logger_params={"log_dir": str(tmp_path / "eval")})
    assert loaded.log_dir == str(tmp_path / "eval") and loaded.global_step == trainer.global_step
    loaded.test(val)
    loaded.logger.flush()
    assert _csv_rows(tmp_path / "run") == rows and "test/loss" in _csv_rows(tmp_path / "eval")[0]


def test_a_model_checkpoints_monitor_is_the_trainers_best_unless_the_trainer_names_another(tmp_path, regression_loaders):
    import json

    train, val, _ = regression_loaders

    def trainer(**options):
        return RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, optimizer_hparams={"lr": 1e-2},
                              exmp_input=X0, **quiet(tmp_path, **options))

    worst = flaxlight.ModelCheckpoint(monitor="val/loss", mode="max")  # the first, worst epoch: not the default best
    fitted = trainer(callbacks=[worst])
    returned = fitted.train_model(train, val, num_epochs=3)
    assert returned["val/loss"] == max(row["val/loss"] for row in fitted.history)
    best_eval = json.loads((tmp_path / "run" / "metrics" / "best_eval.json").read_text())
    loaded = RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=X0)
    assert loaded.eval_model(val, log_prefix="val/")["val/loss"] == pytest.approx(best_eval["val/loss"], rel=1e-5)
    # Both given and different: test() and best_eval.json would describe two models (a warning before).
    with pytest.raises(ValueError, match=r"ModelCheckpoint\(monitor='val/loss', mode='max'\).*monitor='val/loss' "
                                         r"\(mode='min'\).*Give both the same monitor"):
        trainer(monitor="val/loss", mode="min", callbacks=[flaxlight.ModelCheckpoint(monitor="val/loss", mode="max")])


def test_a_max_steps_run_loaded_with_its_optimizer_keeps_its_schedule(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, optimizer_hparams={"lr": 1e-2},
                             exmp_input=X0, max_steps=12, **quiet(tmp_path))  # 8 steps per epoch: stops in epoch 2
    trainer.train_model(train, val, num_epochs=5)
    loaded = RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=X0, which="last", with_optimizer=True)
    assert [loaded.learning_rate(s) for s in (0, 6, 11)] == pytest.approx([trainer.learning_rate(s) for s in (0, 6, 11)])


def test_a_second_train_model_on_the_same_trainer_goes_on_with_the_runs_best(tmp_path, regression_loaders):
    """The second call used to start its ranking afresh: its own best, though worse than the first
    call's, became which="best" (Keras and Lightning keep the best across fit calls)."""
    train, val, _ = regression_loaders
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, optimizer_hparams={"lr": 1e-2},
                             exmp_input=X0, monitor="val/loss", mode="max", **quiet(tmp_path))  # best: the worst
    first = trainer.train_model(train, val, num_epochs=2)
    again = trainer.train_model(train, val, num_epochs=2)  # the run goes on: the first call's best stays
    assert again["val/loss"] == first["val/loss"]
    assert trainer.test(val)["test/loss"] == pytest.approx(first["val/loss"], rel=1e-5)


def test_resuming_with_another_monitor_ranks_the_new_validations_by_it(tmp_path, regression_loaders):
    train, val, _ = regression_loaders

    def run(mode, epochs, **kwargs):
        trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]},
                                 optimizer_hparams={"lr": 1e-2, "schedule": "constant"}, exmp_input=X0,
                                 **quiet(tmp_path, callbacks=[flaxlight.ModelCheckpoint(monitor="val/loss", mode=mode)]))
        return trainer, trainer.train_model(train, val, num_epochs=epochs, **kwargs)

    run("max", 2)  # the first epoch kept as best (the worst loss)
    with pytest.warns(RuntimeWarning, match=r"ranked this run's checkpoints by 'val/loss' \(max\) and now by "
                                            r"'val/loss' \(min\)"):
        trainer, returned = run("min", 4, resume=True)
    loaded = RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=X0)
    assert loaded.test(val)["test/loss"] == pytest.approx(returned["val/loss"], rel=1e-5)
    assert loaded.global_step in [row["step"] for row in trainer.history[2:]]  # one of the resumed run's


def test_a_loaded_trainer_writes_nothing_into_a_run_that_is_still_training(tmp_path, regression_loaders):
    """load_from_checkpoint(run) + test() while another process trained the run rewrote its
    metrics.csv from the copy read at the load: the rows written since were lost."""
    import os
    import subprocess
    import sys
    import warnings

    from flaxlight.runfiles import RunInUseError, RunLock

    train, val, test = regression_loaders
    run = tmp_path / "run"
    RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, optimizer_hparams={"lr": 1e-2},
                   exmp_input=X0, **quiet(tmp_path)).train_model(train, val, num_epochs=2)
    loaded = RegressTrainer.load_from_checkpoint(run, exmp_input=X0)
    # Killed below; it must outlive the test, which may take minutes on a busy machine.
    trainer_process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:  # it "trains" the run: it holds the run's lock
        (run / RunLock.FILE).write_text(f"{trainer_process.pid} {os.uname().nodename}")
        before = {path.name: path.read_bytes() for path in run.iterdir() if path.is_file()}
        with pytest.raises(RunInUseError, match=rf"training in process {trainer_process.pid} .*Nothing was written.*"
                                                r"logger_params=\{'log_dir': 'runs/eval'\}.*wait"):
            loaded.test(test)
        with pytest.raises(RunInUseError, match=f"training in process {trainer_process.pid}"):
            loaded.log_metrics({"custom": 1.0})
        assert {path.name: path.read_bytes() for path in run.iterdir() if path.is_file()} == before
        assert sorted(os.listdir(run / "metrics")) == ["best_eval.json", "eval_epoch_001.json", "eval_epoch_002.json"]
        elsewhere = RegressTrainer.load_from_checkpoint(run, exmp_input=X0,
                                                        logger_params={"log_dir": str(tmp_path / "eval")})
        assert "test/loss" in elsewhere.test(test) and "test/loss" in _csv_rows(tmp_path / "eval")[0]
    finally:
        trainer_process.kill()
        trainer_process.wait()
    with open(run / "metrics.csv", "a") as f:  # the training process wrote on after the load
        f.write("99," + "," * (len(_csv_rows(run)[0]) - 2) + "\n")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Taking over", RuntimeWarning)  # the process is gone
        result = loaded.test(test)  # on disk when test() returns
    rows = _csv_rows(run)
    assert [r["step"] for r in rows][-2:] == ["99", "16"] and float(rows[-1]["test/loss"]) == result["test/loss"]
    assert len(rows) == 1 + len(before["metrics.csv"].decode().splitlines()) and not (run / RunLock.FILE).exists()


def test_a_loaded_trainer_tested_into_a_new_folder_fine_tunes_there(tmp_path, regression_loaders, caplog):
    """load -> baseline test() -> train_model into the new log_dir raised FileExistsError over the
    metrics.csv the test had written; resume=True then warned "starting from scratch" and
    overwrite=True deleted the baseline's results."""
    import logging
    import warnings

    train, val, test = regression_loaders
    RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, optimizer_hparams={"lr": 1e-2},
                   exmp_input=X0, **quiet(tmp_path)).train_model(train, val, num_epochs=2)
    for how in ({}, {"resume": True}, {"overwrite": True}):
        tuned_dir = tmp_path / f"tuned{len(how) and list(how)[0]}"
        tuned = RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=X0, enable_progress_bar=False,
                                                    logger_params={"log_dir": str(tuned_dir)})
        baseline = tuned.test(test)["test/loss"]
        with warnings.catch_warnings(), caplog.at_level(logging.INFO, logger="flaxlight"):
            warnings.simplefilter("error", RuntimeWarning)  # no "starting from scratch"
            tuned.train_model(train, val, num_epochs=1, **how)
        assert tuned.global_step == 24  # went on from the loaded step 16
        rows = _csv_rows(tuned_dir)
        assert rows[0]["step"] == "16" and float(rows[0]["test/loss"]) == pytest.approx(baseline)
        assert any(r["val/loss"] for r in rows[1:]) and (tuned_dir / "metrics" / "test.json").is_file()
    assert "training goes on from the model loaded from" in caplog.text


def test_a_wrong_exmp_input_at_load_is_named_beside_the_different_model_message(tmp_path, regression_loaders):
    """exmp_input=x[0] (no batch axis) blamed the checkpoint ("saved from a different model") and the
    model hyperparameters only; the checkpoint was this very model's."""
    train, val, _ = regression_loaders
    RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, optimizer_hparams={"lr": 1e-2},
                   exmp_input=X0, **quiet(tmp_path)).train_model(train, val, num_epochs=1)
    with pytest.raises(ValueError) as raised:  # a flaxlight.checkpoint.ModelMismatchError
        RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=X0[0])
    message = str(raised.value)
    assert "saved from a different model" in message and "Dense_0/kernel: checkpoint (4, 8), model (1, 8)" in message
    assert "exmp_input is an array of shape (4,)" in message and "x[0] instead of x[:1]" in message


def test_one_checkpoint_of_a_run_loads_by_its_step_folder_or_load_model(tmp_path, regression_loaders):
    """load_from_checkpoint(".../checkpoints/<step>") failed with "No hparams.yaml"; load_model(step)
    restored the step but left global_step at the loaded one's, so test() logged at the wrong step;
    current_epoch said 1 after any load (it is the loaded checkpoint's epoch, as Lightning's)."""
    train, val, test = regression_loaders
    RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, optimizer_hparams={"lr": 1e-2},
                   exmp_input=X0, callbacks=[flaxlight.ModelCheckpoint(save_top_k=-1, every_n_epochs=1)],
                   **quiet(tmp_path)).train_model(train, val, num_epochs=3)
    run = tmp_path / "run"
    first = RegressTrainer.load_from_checkpoint(run / "checkpoints" / "8", exmp_input=X0)
    assert int(first.state.step) == first.global_step == 8 and first.log_dir == str(run) and first.current_epoch == 1
    by_step = first.test(test, name="first")
    loaded = RegressTrainer.load_from_checkpoint(run, exmp_input=X0, which="last")
    assert loaded.global_step == 24 and loaded.current_epoch == 3
    loaded.load_model(16)
    assert int(loaded.state.step) == loaded.global_step == 16 and loaded.current_epoch == 2
    loaded.load_model(8)
    assert int(loaded.state.step) == loaded.global_step == 8
    assert loaded.test(test, name="again")["test_again/loss"] == pytest.approx(by_step["test_first/loss"], rel=1e-6)
    assert [r["step"] for r in _csv_rows(run) if r.get("test_first/loss") or r.get("test_again/loss")] == ["8", "8"]
    with pytest.raises(FileNotFoundError, match=r"No checkpoint of step 9 in .*checkpoints: it holds steps 8, 16, 24"):
        RegressTrainer.load_from_checkpoint(run / "checkpoints" / "9", exmp_input=X0)


def test_loaded_trainers_test_again_and_again_into_one_eval_folder(tmp_path, regression_loaders, capsys):
    """The in-use message's advice, load_from_checkpoint(run, logger_params={'log_dir': eval}).test(),
    done a second time into the same eval folder (the eval script run again, the next checkpoint
    while the run trains) was refused: "already holds a run (metrics.csv)"."""
    import os

    train, val, test = regression_loaders
    RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, optimizer_hparams={"lr": 1e-2},
                   exmp_input=X0, **quiet(tmp_path)).train_model(train, val, num_epochs=2)
    results = []
    for which in ("best", "last", "best"):
        loaded = RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=X0, which=which,
                                                     logger_params={"log_dir": str(tmp_path / "eval")})
        results.append(loaded.test(test)["test/loss"])
    assert sorted(os.listdir(tmp_path / "eval" / "metrics")) == ["test.2.json", "test.3.json", "test.json"]
    assert [float(row["test/loss"]) for row in _csv_rows(tmp_path / "eval")] == pytest.approx(results)
    assert "metrics/test.json holds an earlier test's metrics: this one's (test/...) are saved to metrics/test.3.json" \
        in capsys.readouterr().err


def test_a_loaded_trainer_still_may_not_log_into_a_folder_holding_another_run(tmp_path, regression_loaders):
    import os

    train, val, test = regression_loaders
    for name in ("run", "other"):
        RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, optimizer_hparams={"lr": 1e-2},
                       exmp_input=X0, **quiet(tmp_path, logger_params={"log_dir": str(tmp_path / name)})).train_model(
            train, val, num_epochs=1)
    loaded = RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=X0,
                                                 logger_params={"log_dir": str(tmp_path / "other")})
    with pytest.raises(FileExistsError, match=r"other already holds a run \(hparams.yaml, metrics.csv, checkpoints/\)"):
        loaded.test(test)
    assert sorted(os.listdir(tmp_path / "other" / "metrics")) == ["best_eval.json", "eval_epoch_001.json"]


def test_load_model_from_a_callback_restores_weights_and_leaves_the_runs_step_count_alone(tmp_path, regression_loaders):
    """load_model(step) set global_step to the step loaded, also inside train_model: a callback
    rolling the weights back at epoch 3 sent the run back to step 8, and epochs 4 and 5 overwrote
    checkpoints 16 and 24 (and metrics.csv went 24, 16, 24)."""
    train, val, _ = regression_loaders
    restored = []

    class RollBack(flaxlight.Callback):
        def on_epoch_end(self, trainer, epoch):
            if epoch == 3:
                trainer.checkpointer.wait()
                trainer.load_model(8)
                restored.append((int(trainer.state.step), trainer.global_step))

    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, optimizer_hparams={"lr": 1e-2},
                             exmp_input=X0, **quiet(tmp_path, callbacks=[
                                 RollBack(), flaxlight.ModelCheckpoint(every_n_epochs=1, save_top_k=-1)]))
    trainer.train_model(train, val, num_epochs=5)
    trainer.checkpointer.wait()
    assert restored == [(8, 24)] and trainer.global_step == 40
    steps = trainer.checkpointer.all_steps()
    assert sorted(steps) == [8, 16, 24, 32, 40]
    assert [trainer.checkpointer.read_meta(step)["epoch"] for step in sorted(steps)] == [1, 2, 3, 4, 5]
    assert [int(row["step"]) for row in _csv_rows(tmp_path / "run")] == [8, 8, 16, 16, 24, 24, 32, 32, 40, 40]


def test_a_test_holds_the_runs_lock_only_while_writing_its_records(tmp_path, regression_loaders):
    """test() held the run's lock for the whole evaluation: a resume=True of the run in another
    process meanwhile (a restarted job) was refused with RunInUseError."""
    import os
    import subprocess
    import sys

    from flaxlight.runfiles import RunInUseError, RunLock

    train, val, test = regression_loaders
    run = tmp_path / "run"
    RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, optimizer_hparams={"lr": 1e-2},
                   exmp_input=X0, **quiet(tmp_path)).train_model(train, val, num_epochs=2)
    x, y = linear_data(64, 2)
    locked_during_evaluation, taken_by = [], []

    class Batches:  # the test's data; while it is read, another process may take the run
        def __iter__(self):
            locked_during_evaluation.append((run / RunLock.FILE).exists())
            if taken_by:
                (run / RunLock.FILE).write_text(f"{taken_by[0]} {os.uname().nodename}")
            return iter([(x[i:i + 32], y[i:i + 32]) for i in range(0, 64, 32)])

    loaded = RegressTrainer.load_from_checkpoint(run, exmp_input=X0)
    result = loaded.test(Batches())
    assert locked_during_evaluation == [False] and not (run / RunLock.FILE).exists()
    assert float(_csv_rows(run)[-1]["test/loss"]) == result["test/loss"]

    # Killed below; it must outlive the test, which may take minutes on a busy machine.
    restarted = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:  # it resumes the run while the test evaluates: the test's records are refused, its result said
        taken_by.append(restarted.pid)
        before = {path.name: path.read_bytes() for path in run.iterdir() if path.is_file()}
        with pytest.raises(RunInUseError, match=rf"training in process {restarted.pid} .*Nothing was written.* The "
                                                rf"test ran meanwhile; its metrics, not written: \{{'test/loss': "):
            loaded.test(Batches())
        after = {path.name: path.read_bytes() for path in run.iterdir() if path.is_file()}
        assert after.pop(RunLock.FILE) == f"{restarted.pid} {os.uname().nodename}".encode() and after == before
        assert not (run / "metrics" / "test.2.json").exists()
    finally:
        restarted.kill()
        restarted.wait()


# --- max_steps from a model past step 0: the schedule spans the steps that run --------------------------------
SGD = {"optimizer": "sgd", "lr": 0.1, "gradient_clip": None}  # warmup_cosine to 1% of lr: ends at 0.001


def _fixed_order_loader():
    return flaxlight.ArrayLoader(*linear_data(256, 0), batch_size=32, shuffle=False)  # 8 batches, the same each epoch


def _hand_sgd(params, batches, num_updates, apply_fn):
    """The fine-tune written with optax: sgd on a cosine schedule of ``num_updates`` updates."""
    import jax
    import jax.numpy as jnp
    import optax

    tx = optax.sgd(optax.cosine_decay_schedule(0.1, num_updates, alpha=0.01))
    opt_state = tx.init(params)
    grad = jax.jit(jax.grad(lambda p, x, y: jnp.mean((apply_fn({"params": p}, x) - y) ** 2)))
    for x, y in batches:
        updates, opt_state = tx.update(grad(params, x, y), opt_state, params)
        params = optax.apply_updates(params, updates)
    return params


def _copied(tree):
    import jax
    return jax.tree.map(np.array, tree)


def _assert_params_close(got, expected):
    import jax
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def _first_run(tmp_path):
    """16 steps (2 epochs of 8), checkpointed in tmp_path/run."""
    train = _fixed_order_loader()
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, optimizer_hparams=SGD,
                             exmp_input=X0, **quiet(tmp_path))
    trainer.train_model(train, None, num_epochs=2)
    return trainer, train


def test_a_fine_tune_with_max_steps_fits_its_schedule_to_the_steps_it_runs(tmp_path):
    """A model loaded at step 16 trained with max_steps=22 runs 6 steps: its schedule spanned 22 (ending at
    lr 0.083 instead of 0.001), and warmup_steps=10 passed the 'longer than the run' check."""
    first, train = _first_run(tmp_path)
    start = _copied(first.state.params)

    def fine_tune(name, **kwargs):
        return RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=X0, which="last", max_steps=22,
                                                   **quiet(tmp_path, logger_params={"log_dir": str(tmp_path / name)}),
                                                   **kwargs)

    tuned = fine_tune("fine_tune")
    tuned.train_model(train, None, num_epochs=5)
    assert int(tuned.state.step) == 22 and tuned.optimizer_plan.num_updates == 6
    assert float(flaxlight.current_learning_rate(tuned.state)) == pytest.approx(0.001, rel=1e-5)
    _assert_params_close(tuned.state.params, _hand_sgd(start, list(train)[:6], 6, tuned.state.apply_fn))
    warm = fine_tune("warmup", optimizer_hparams={**SGD, "warmup": 10})
    with pytest.raises(ValueError, match=r"'warmup_steps'\]=10 is longer than the run: 6 optimizer updates"):
        warm.train_model(train, None, num_epochs=5)


def test_a_second_train_model_call_with_max_steps_fits_its_schedule_to_the_steps_it_runs(tmp_path):
    train = _fixed_order_loader()
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, optimizer_hparams=SGD,
                             exmp_input=X0, max_steps=22, **quiet(tmp_path))
    trainer.train_model(train, None, num_epochs=2)  # 16 steps, below max_steps
    assert trainer.optimizer_plan.num_updates == 16
    after_first = _copied(trainer.state.params)  # the train step donates the state's buffers
    trainer.train_model(train, None, num_epochs=5)  # 6 more steps
    assert int(trainer.state.step) == 22 and trainer.optimizer_plan.num_updates == 6
    assert float(flaxlight.current_learning_rate(trainer.state)) == pytest.approx(0.001, rel=1e-5)
    _assert_params_close(trainer.state.params, _hand_sgd(after_first, list(train)[:6], 6, trainer.state.apply_fn))


def test_a_resumed_max_steps_fine_tune_ends_as_the_uninterrupted_one(tmp_path):
    """Crash at step 19 of a fine-tune from step 16 (max_steps=22), resumed by a new trainer and by the one that
    crashed (model at step 19, checkpoint at 18): both keep the fine-tune's 6-update schedule, bitwise."""
    from conftest import FailAt

    _first_run(tmp_path)
    train = _fixed_order_loader()

    def fine_tune(name, callbacks=()):
        return RegressTrainer.load_from_checkpoint(
            tmp_path / "run", exmp_input=X0, which="last", max_steps=22,
            **quiet(tmp_path, logger_params={"log_dir": str(tmp_path / name)},
                    callbacks=[flaxlight.ModelCheckpoint(every_n_steps=2), *callbacks]))

    def crash(name):
        crashed = fine_tune(name, callbacks=[FailAt(19)])
        with pytest.raises(RuntimeError, match="data error at step 19"):
            crashed.train_model(train, None, num_epochs=5)
        crashed.callbacks = [cb for cb in crashed.callbacks if not isinstance(cb, FailAt)]
        return crashed

    straight = fine_tune("straight")
    straight.train_model(train, None, num_epochs=5)
    crash("crashed")
    new = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, optimizer_hparams=SGD, exmp_input=X0,
                         max_steps=22, **quiet(tmp_path, logger_params={"log_dir": str(tmp_path / "crashed")},
                                                callbacks=[flaxlight.ModelCheckpoint(every_n_steps=2)]))
    new.train_model(train, None, num_epochs=5, resume=True)
    crashed = crash("crashed_again")
    crashed.train_model(train, None, num_epochs=5, resume=True)
    for resumed in (new, crashed):
        assert int(resumed.state.step) == 22 and resumed.optimizer_plan.num_updates == 6
        assert resumed.learning_rate(21) == pytest.approx(straight.learning_rate(21))
        for a, b in zip(jax_leaves(resumed.state), jax_leaves(straight.state), strict=True):
            np.testing.assert_array_equal(a, b)
    assert float(flaxlight.current_learning_rate(straight.state)) == pytest.approx(0.001, rel=1e-5)


def jax_leaves(state):
    import jax
    return [np.asarray(leaf) for leaf in jax.tree.leaves((state.params, state.opt_state))]
