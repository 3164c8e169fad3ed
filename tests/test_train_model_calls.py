"""A second ``train_model`` call on the same trainer goes on with the run's best (as Keras' and
Lightning's checkpoint callbacks across ``fit`` calls) and never overwrites the first call's
per-epoch validation files; ``resume=True`` afterwards agrees."""

import csv
import json
import os

import numpy as np
import pytest

import flaxlight
from conftest import RegressTrainer, TinyMLP, linear_data, quiet

X, Y = linear_data(256, 0)
XV, YV = linear_data(64, 1)


def _trainer(tmp_path, callbacks, lr=1e-2):
    return RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [16]},
                          optimizer_hparams={"optimizer": "adam", "lr": lr}, exmp_input=X[:1],
                          callbacks=[cb() for cb in callbacks], **quiet(tmp_path))


def _metrics(tmp_path):
    folder = tmp_path / "run" / "metrics"
    return {name: json.loads((folder / name).read_text()) for name in sorted(os.listdir(folder))}


def _steps(tmp_path):
    return sorted(int(name) for name in os.listdir(tmp_path / "run" / "checkpoints") if name.isdigit())


@pytest.mark.parametrize("callbacks", [[], [lambda: flaxlight.ModelCheckpoint(monitor="val/loss", mode="min")]],
                         ids=["trainer_rule", "checkpoint_monitor"])
def test_a_worse_second_call_leaves_the_runs_best_and_the_first_calls_files(tmp_path, callbacks):
    """The second call started "best" afresh: its worse model became which="best", best_eval.json
    and load_from_checkpoint's, and its epochs 1, 2 overwrote the first call's eval_epoch files."""
    trainer = _trainer(tmp_path, callbacks)
    first = trainer.train_model((X, Y), (XV, YV), num_epochs=3, batch_size=32)
    after_first = _metrics(tmp_path)
    best_step = RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=X[:1],
                                                    logger_params={"log_dir": str(tmp_path / "a")}).global_step
    best_outputs = trainer.predict(XV, batch_size=64, which="best")

    second = trainer.train_model((X, -Y), (XV, YV), num_epochs=2, batch_size=32)  # learns the wrong sign: worse
    assert [row["val/loss"] for row in second.history] > [first["val/loss"]] * 2
    assert second["val/loss"] == first["val/loss"]  # the run's best, as Keras' ModelCheckpoint.best
    files = _metrics(tmp_path)
    assert sorted(files) == ["best_eval.json"] + [f"eval_epoch_{epoch:03d}.json" for epoch in range(1, 6)]
    assert {name: files[name] for name in after_first} == after_first  # nothing of the first call rewritten
    assert files["eval_epoch_005.json"]["val/loss"] == pytest.approx(second.history[-1]["val/loss"])
    np.testing.assert_array_equal(trainer.predict(XV, batch_size=64, which="best"), best_outputs)
    assert best_step in _steps(tmp_path)
    loaded = RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=X[:1],
                                                 logger_params={"log_dir": str(tmp_path / "b")})
    assert loaded.global_step == best_step

    resumed = _trainer(tmp_path, callbacks)  # another process continuing the run: its best is still the first's
    third = resumed.train_model((X, -Y), (XV, YV), num_epochs=3, batch_size=32, resume=True)
    assert third["val/loss"] == first["val/loss"]
    files = _metrics(tmp_path)
    assert sorted(files)[-1] == "eval_epoch_006.json" and files["best_eval.json"] == after_first["best_eval.json"]
    np.testing.assert_array_equal(resumed.predict(XV, batch_size=64, which="best"), best_outputs)


def test_a_better_second_call_becomes_the_runs_best(tmp_path):
    trainer = _trainer(tmp_path, [], lr=1e-3)
    first = trainer.train_model((X, Y), (XV, YV), num_epochs=1, batch_size=32)
    second = trainer.train_model((X, Y), (XV, YV), num_epochs=3, batch_size=32)
    assert second["val/loss"] < first["val/loss"]
    assert _metrics(tmp_path)["best_eval.json"]["val/loss"] == pytest.approx(second["val/loss"])
    loaded = RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=X[:1],
                                                 logger_params={"log_dir": str(tmp_path / "b")})
    assert loaded.global_step == max(_steps(tmp_path)) == 4 * 8


def test_rewinding_into_the_second_call_keeps_the_files_before_it_and_drops_the_later_ones(tmp_path):
    """A rewind dropped the validation files after its checkpoint by the call's own epoch number:
    back to the second call's first epoch, it dropped every file after eval_epoch_001."""
    every = [lambda: flaxlight.ModelCheckpoint(save_top_k=-1)]  # every epoch's checkpoint kept
    trainer = _trainer(tmp_path, every)
    trainer.train_model((X, Y), (XV, YV), num_epochs=3, batch_size=32)
    trainer.train_model((X, -Y), (XV, YV), num_epochs=2, batch_size=32)
    before = _metrics(tmp_path)
    rewound = _trainer(tmp_path, every)
    rewound.train_model((X, -Y), (XV, YV), num_epochs=2, batch_size=32,
                        resume_from=tmp_path / "run" / "checkpoints" / "32")  # the second call's first epoch
    files = _metrics(tmp_path)
    assert sorted(files) == ["best_eval.json"] + [f"eval_epoch_{epoch:03d}.json" for epoch in range(1, 6)]
    assert [files[f"eval_epoch_{epoch:03d}.json"] for epoch in range(1, 5)] == \
        [before[f"eval_epoch_{epoch:03d}.json"] for epoch in range(1, 5)]
    assert files["eval_epoch_005.json"]["val/loss"] == pytest.approx(rewound.history[-1]["val/loss"])
    assert (tmp_path / "run" / "abandoned" / "after_step_32" / "metrics" / "eval_epoch_005.json").exists()


class _FirstIsBest(RegressTrainer):
    """The first validation is the run's best: best checkpoint 8, last 24 after three epochs."""

    def is_new_model_better(self, new_metrics, old_metrics):
        return old_metrics is None


def _rows(tmp_path):
    return list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))


def _first_is_best(tmp_path, name="run"):
    return _FirstIsBest(model_class=TinyMLP, model_hparams={"hidden_dims": [16]},
                        optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, exmp_input=X[:1],
                        **quiet(tmp_path, logger_params={"log_dir": str(tmp_path / name)}))


def _train_test_train(tmp_path, how, second_epochs=2):
    """Call 1 (3 epochs: best checkpoint 8, last 24), a test of the best (``trainer.test`` or the
    call's ``test_loader``), call 2; returns the trainer, call 1's files and last model's outputs."""
    trainer = _first_is_best(tmp_path)
    trainer.train_model((X, Y), (XV, YV), test_loader=(XV, YV) if how == "test_loader" else None, num_epochs=3,
                        batch_size=32)
    assert _steps(tmp_path) == [8, 24]
    if how == "test()":
        trainer.test((XV, YV), batch_size=64)
    first_files, first_last = _metrics(tmp_path), trainer.predict(XV, batch_size=64, which="last")
    trainer.train_model((X, Y), (XV, YV), num_epochs=second_epochs, batch_size=32)
    return trainer, first_files, first_last


# test() restored the best checkpoint's step (8) and epoch (1) into the trainer while global_step stayed
# the last (24): the next call counted steps 16, 24 again, replaced checkpoint 24 (the first call's
# last model) and eval_epoch_002/003.json, and wrote metrics.csv rows twice; a shorter next call left
# the first call's checkpoint 24 as "last", where resume=True went back to.
@pytest.mark.parametrize("how", ["test()", "test_loader"])
def test_a_call_after_a_test_keeps_the_first_calls_last_checkpoint(tmp_path, how):
    trainer, _, first_last = _train_test_train(tmp_path, how)
    assert _steps(tmp_path) == [8, 24, 40]  # the second call saved after the first's steps
    at_24 = RegressTrainer.load_from_checkpoint(tmp_path / "run" / "checkpoints" / "24", exmp_input=X[:1],
                                                logger_params={"log_dir": str(tmp_path / "a")})
    np.testing.assert_array_equal(at_24.predict(XV, batch_size=64), first_last)
    assert int(trainer.state.step) == trainer.global_step == 40


@pytest.mark.parametrize("how", ["test()", "test_loader"])
def test_a_call_after_a_test_rewrites_no_eval_file_of_the_first_call(tmp_path, how):
    trainer, first_files, _ = _train_test_train(tmp_path, how)
    files = _metrics(tmp_path)
    assert {name: files[name] for name in first_files} == first_files
    assert sorted(set(files) - set(first_files)) == ["eval_epoch_004.json", "eval_epoch_005.json"]


@pytest.mark.parametrize("how", ["test()", "test_loader"])
def test_a_call_after_a_test_writes_each_step_once_to_metrics_csv(tmp_path, how):
    trainer, _, _ = _train_test_train(tmp_path, how)
    assert [int(row["step"]) for row in _rows(tmp_path) if row["val/loss"]] == [8, 16, 24, 32, 40]
    assert [row["step"] for row in trainer.history] == [32, 40]


@pytest.mark.parametrize("how", ["test()", "test_loader"])
def test_last_after_a_test_and_a_shorter_call_is_that_calls_end(tmp_path, how):
    trainer, _, first_last = _train_test_train(tmp_path, how, second_epochs=1)
    second_end = trainer.predict(XV, batch_size=64)
    assert not np.array_equal(second_end, first_last)
    np.testing.assert_array_equal(trainer.predict(XV, batch_size=64, which="last"), second_end)


@pytest.mark.parametrize("how", ["test()", "test_loader"])
def test_resume_after_a_test_and_a_shorter_call_goes_on_from_that_calls_end(tmp_path, how):
    _train_test_train(tmp_path, how, second_epochs=1)
    resumed = _first_is_best(tmp_path)
    resumed.train_model((X, Y), (XV, YV), num_epochs=2, batch_size=32, resume=True)
    assert [row["step"] for row in resumed.history] == [32, 40]  # on from the second call's end (step 32)


def test_predict_after_train_model_is_the_same_with_or_without_a_test_loader(tmp_path):
    """train_model(..., test_loader=...) left the best checkpoint in the trainer: predict()
    gave the best model after it and the last model without it."""
    outputs = []
    for name, test_loader in (("plain", None), ("tested", (XV, YV))):
        trainer = _first_is_best(tmp_path, name)
        trainer.train_model((X, Y), (XV, YV), test_loader=test_loader, num_epochs=3, batch_size=32)
        outputs.append(trainer.predict(XV, batch_size=64))
        np.testing.assert_array_equal(outputs[-1], trainer.predict(XV, batch_size=64, which="last"))
        assert not np.array_equal(outputs[-1], trainer.predict(XV, batch_size=64, which="best"))
    np.testing.assert_array_equal(outputs[0], outputs[1])


class _PredictsAtTestEnd(flaxlight.Callback):
    def __init__(self):
        self.seen = []

    def on_test_end(self, trainer, metrics):
        self.seen.append((trainer.predict(XV, batch_size=64), trainer.global_step))


@pytest.mark.parametrize("how", ["test()", "test_loader"])
def test_on_test_end_sees_the_tested_model_and_the_trainer_is_put_back_after_it(tmp_path, how):
    """The state was put back before on_test_end: a callback predicting there used the last model
    next to the best checkpoint's test metrics (Lightning's on_test_end sees the tested model)."""
    heard = _PredictsAtTestEnd()
    trainer = _FirstIsBest(model_class=TinyMLP, model_hparams={"hidden_dims": [16]},
                           optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, exmp_input=X[:1], callbacks=[heard],
                           **quiet(tmp_path, logger_params={"log_dir": str(tmp_path / "run")}))
    trainer.train_model((X, Y), (XV, YV), test_loader=(XV, YV) if how == "test_loader" else None, num_epochs=3,
                        batch_size=32)
    if how == "test()":
        trainer.test((XV, YV), batch_size=64)
    (seen, step), = heard.seen
    np.testing.assert_array_equal(seen, trainer.predict(XV, batch_size=64, which="best"))  # checkpoint 8's
    assert step == 24 and trainer.global_step == int(trainer.state.step) == 24
    assert not np.array_equal(trainer.predict(XV, batch_size=64), seen)  # put back: the last model


def test_a_second_call_says_what_it_keeps_and_what_starts_again(tmp_path, capsys):
    """A notebook cell run again trained on with a new optimizer (its schedule restarted, Adam's
    moments reset), history and epochs from 1, without a word."""
    trainer = _trainer(tmp_path, [])
    trainer.train_model((X, Y), (XV, YV), num_epochs=1, batch_size=32)
    assert "train_model again" not in capsys.readouterr().err
    trainer.train_model((X, Y), (XV, YV), num_epochs=1, batch_size=32)
    said = capsys.readouterr().err
    assert "train_model again on this trainer: training goes on from its current model (step 8) with a new " \
           "optimizer" in said and "resume=True instead continues the run" in said
    trainer.train_model((X, Y), (XV, YV), num_epochs=3, batch_size=32, resume=True)
    assert "train_model again" not in capsys.readouterr().err


def test_an_edited_optimizer_hparams_is_said_and_recorded_at_the_next_call(tmp_path, capsys):
    """trainer.optimizer_hparams["lr"] = 0.5 between calls changed the rate used, but hparams.yaml,
    load_from_checkpoint(with_optimizer=True) and a later resume's comparison kept the old one."""
    import yaml

    trainer = _trainer(tmp_path, [])
    trainer.train_model((X, Y), (XV, YV), num_epochs=1, batch_size=32)
    trainer.optimizer_hparams["lr"] = 0.5
    capsys.readouterr()
    trainer.train_model((X, Y), (XV, YV), num_epochs=1, batch_size=32)
    said = capsys.readouterr().err
    assert "trainer.optimizer_hparams was edited (lr: 0.01 -> 0.5)" in said and "hparams.1.yaml" in said
    run = tmp_path / "run"
    assert yaml.safe_load((run / "hparams.yaml").read_text())["optimizer_hparams"]["lr"] == 0.5
    assert yaml.safe_load((run / "hparams.1.yaml").read_text())["optimizer_hparams"]["lr"] == 0.01
    loaded = RegressTrainer.load_from_checkpoint(run, exmp_input=X[:1], which="last", with_optimizer=True,
                                                 logger_params={"log_dir": str(tmp_path / "b")})
    assert loaded.optimizer_hparams["lr"] == 0.5
    trainer.train_model((X, Y), (XV, YV), num_epochs=3, batch_size=32, resume=True)  # nothing more to say
    assert "optimizer_hparams was edited" not in capsys.readouterr().err and not (run / "hparams.2.yaml").exists()


def test_an_edited_setting_of_the_train_step_is_refused(tmp_path):
    """The L2 term is applied by the train step, built once by __init__: an edit would not apply."""
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [16]},
                             optimizer_hparams={"optimizer": "sgd", "lr": 1e-2, "weight_decay": 1e-3,
                                                "weight_decay_mode": "l2"}, exmp_input=X[:1], **quiet(tmp_path))
    trainer.optimizer_hparams["weight_decay"] = 0.1
    with pytest.raises(ValueError, match=r"edited after the trainer was built \(weight_decay: 0.001 -> 0.1\), but the "
                                         r"train step applies"):
        trainer.train_model((X, Y), (XV, YV), num_epochs=1, batch_size=32)
    assert not (tmp_path / "run" / "hparams.yaml").exists()


def test_a_keyboard_interrupt_inside_train_model_says_what_is_saved(tmp_path, capsys):
    """A KeyboardInterrupt from a callback (or a second Ctrl-C) ended the run without a word: the
    trainer at step 24, the newest checkpoint 16."""

    class Raise(flaxlight.Callback):
        def on_train_epoch_end(self, trainer, epoch, metrics):
            if epoch == 3:
                raise KeyboardInterrupt

    trainer = _trainer(tmp_path, [Raise])
    with pytest.raises(KeyboardInterrupt):
        trainer.train_model((X, Y), (XV, YV), num_epochs=5, batch_size=32)
    said = capsys.readouterr().err
    assert trainer.global_step == 24 and _steps(tmp_path)[-1] == 16
    assert "KeyboardInterrupt at step 24 (epoch 3): train_model stopped, and step 24 is not saved" in said
    assert "The newest checkpoint is step 16: train_model(..., resume=True) continues from there" in said
