"""EarlyStopping with Lightning's semantics, against hand-computed sequences of scores."""

import math

import pytest
from conftest import RegressTrainer, TinyMLP, linear_data, quiet


from flaxlight.callbacks import EarlyStopping

NAN, INF = math.nan, math.inf


class Scripted:
    """The part of the trainer EarlyStopping uses, replaying one score per validation."""

    def __init__(self, nonfinite_steps=0):
        self.value, self.stop_reason = None, None
        self.nonfinite_steps, self.callbacks = nonfinite_steps, []  # steps whose loss was NaN/Inf

    def monitored_value(self, name, owner):
        return self.value

    def stop(self, reason):
        self.stop_reason = reason


def stopped_at(stopper, scores, nonfinite_steps=0):
    """The 1-based validation after which ``stopper`` stops (None: never), and the reason."""
    trainer = Scripted(nonfinite_steps)
    for epoch, score in enumerate(scores, start=1):
        trainer.value = score
        stopper.on_validation_end(trainer, epoch, {stopper.monitor: score})
        if trainer.stop_reason is not None:
            return epoch, trainer.stop_reason
    return None, None


@pytest.mark.parametrize("kwargs, scores, expected", [
    # patience counts validations in a row without improvement: the 3rd one stops (Lightning)
    (dict(patience=3), [1.0, 0.9, 0.95, 0.92, 0.91], 5),
    (dict(patience=3), [1.0, 0.9, 0.95, 0.8, 0.92, 0.91, 0.85], 7),  # an improvement resets the count
    (dict(patience=1), [1.0, 1.0], 2),  # equal is no improvement
    (dict(patience=0), [1.0, 0.5, 0.4], None),  # patience 0 stops only at a validation without improvement
    (dict(patience=2, min_delta=0.1), [1.0, 0.95, 0.92, 0.85], 3),  # 0.95, 0.92: not better by > 0.1
    (dict(patience=2, mode="max"), [0.5, 0.6, 0.6, 0.59], 4),
    (dict(patience=5), [1.0, INF], 2),  # check_finite (default): Inf stops at once
    (dict(patience=2, check_finite=False), [1.0, NAN, NAN], 3),  # NaN is then just no improvement
    (dict(patience=9, stopping_threshold=0.5), [1.0, 0.7, 0.5, 0.49], 4),  # better than 0.5 (strictly)
    (dict(patience=9, mode="max", stopping_threshold=0.9), [0.5, 0.95], 2),
    (dict(patience=9, divergence_threshold=10.0), [1.0, 5.0, 10.0, 10.5], 4),  # worse than 10 (strictly)
    (dict(patience=9), [1.0, 0.9, 0.8], None),
])
def test_stopping_matches_the_hand_computed_validation(kwargs, scores, expected):
    assert stopped_at(EarlyStopping(**kwargs), scores)[0] == expected


@pytest.mark.parametrize("kwargs, scores, message", [
    (dict(patience=2), [1.0, 1.1, 1.2], "did not improve by more than 0 for 2 validations in a row (best 1 at epoch 1)"),
    (dict(stopping_threshold=0.5), [0.4], "reached the stopping threshold 0.5"),
    (dict(divergence_threshold=3.0), [4.0], "passed the divergence threshold 3"),
])
def test_the_reason_says_what_happened(kwargs, scores, message):
    assert message in stopped_at(EarlyStopping(**kwargs), scores)[1]


@pytest.mark.parametrize("kwargs, scores, nonfinite_steps, expected", [
    (dict(patience=5), [1.0, NAN], 3, 2),  # the loss was NaN/Inf: a NaN is the model's, and stops at once
    (dict(patience=5, check_finite=False), [1.0, NAN], 3, None),
    (dict(patience=5), [1.0, NAN, 0.5, NAN], 0, None),  # a finite training's NaN: a 0/0, the run goes on
    (dict(patience=2), [1.0, NAN, NAN], 0, 3),  # ... counted as a validation without an improvement
    (dict(patience=2), [1.0, NAN, 0.9, NAN], 0, None),
])
def test_a_nan_stops_at_once_only_when_the_training_diverged(kwargs, scores, nonfinite_steps, expected):
    """Every NaN stopped the run at once: one validation that counted nothing for a masked metric
    (a task without labelled examples in it, a 0/0) ended the run."""
    assert stopped_at(EarlyStopping(**kwargs), scores, nonfinite_steps)[0] == expected


def test_a_nan_of_a_diverged_training_says_it_is_not_finite_and_a_finite_trainings_nan_is_said_once(caplog):
    assert "val/loss = nan is not finite (best 1 at epoch 1)" in stopped_at(EarlyStopping(), [1.0, NAN], 1)[1]
    with caplog.at_level("WARNING", logger="flaxlight"):
        stopped_at(EarlyStopping(patience=9), [1.0, NAN, 0.5, NAN])
    said = [record.getMessage() for record in caplog.records if "0/0" in record.getMessage()]
    assert len(said) == 1 and said[0].startswith("EarlyStopping: val/loss = nan at epoch 2, while the training's loss "
                                                 "is finite: a 0/0 (the validation counted nothing for it")


def test_patience_zero_stops_at_the_first_validation_without_improvement():
    assert stopped_at(EarlyStopping(patience=0), [1.0, 1.5])[0] == 2


def test_in_a_real_run_patience_3_stops_after_the_third_validation_without_improvement(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    stopper = EarlyStopping(monitor="val/loss", patience=3, min_delta=1e9)  # only the first validation improves
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=linear_data(1)[0],
                             optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, **quiet(tmp_path, callbacks=[stopper]))
    trainer.train_model(train, val, num_epochs=20)
    assert trainer.current_epoch == 4 and trainer.should_stop
    assert "for 3 validations in a row" in trainer.stop_reason


def _trainer(tmp_path, stopper):
    return RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=linear_data(1)[0],
                          optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, **quiet(tmp_path, callbacks=[stopper]))


def test_without_validation_a_train_metric_is_checked_after_each_epoch(tmp_path, regression_loaders):
    train, _, _ = regression_loaders
    trainer = _trainer(tmp_path, EarlyStopping(monitor="train/loss", patience=2, min_delta=1e9))
    trainer.train_model(train, None, num_epochs=20)
    assert trainer.current_epoch == 3 and "train/loss did not improve" in trainer.stop_reason


def test_a_validation_monitor_without_validation_data_is_an_error_before_training(tmp_path, regression_loaders):
    train, _, _ = regression_loaders
    trainer = _trainer(tmp_path, EarlyStopping(monitor="val/loss"))
    with pytest.raises(ValueError, match="monitors 'val/loss', but train_model got no validation data"):
        trainer.train_model(train, None, num_epochs=20)
    assert trainer.global_step == 0 and not (tmp_path / "run" / "hparams.yaml").exists()  # nothing written


@pytest.mark.parametrize("kwargs, message", [
    (dict(patience=-1), "patience must be an int >= 0"),
    (dict(patience=1.5), "patience must be an int >= 0"),
    (dict(min_delta=-0.1), "min_delta must be a number >= 0"),
    (dict(mode="lowest"), "mode must be 'min' or 'max'"),
])
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EarlyStopping(**kwargs)




@pytest.mark.parametrize("kwargs, message", [
    (dict(restore_best_weights=True),
     r"'restore_best_weights' \(a Keras one\): the run's best model is kept in its checkpoints: use "
     r"trainer.predict\(x, batch_size=256, which='best'\).*load_from_checkpoint\(log_dir, exmp_input=x\[:1\], "
     r"which='best'\).*trainer's monitor.*MyTrainer\(\.\.\., monitor='val/loss', mode='min'\)"),
    (dict(baseline=0.5), r"'baseline' \(a Keras one\): flaxlight has no baseline; stopping_threshold=X stops the run "
                         r"once the metric is better than X .*divergence_threshold=X once it is worse"),
    (dict(start_from_epoch=2), r"'start_from_epoch' \(a Keras one\): flaxlight has no start_from_epoch: patience "
                               r"counts the validations without improvement from the first one on"),
    (dict(verbose=1), r"'verbose' \(Lightning's and Keras'\): .*printed .*and kept in trainer.stop_reason; drop it"),
    (dict(strict=True), r"'strict' \(Lightning's\): flaxlight is always strict .*a monitor that is not logged is an "
                        r"error naming the metrics that are"),
    (dict(check_on_train_epoch_end=False), r"'check_on_train_epoch_end' \(Lightning's\): EarlyStopping checks after "
                                           r"each validation .*as Lightning's default \(None\) does: drop it"),
    (dict(log_rank_zero_only=True), r"'log_rank_zero_only' \(Lightning's\): the reason it stopped goes to the logging "
                                    r"logger 'flaxlight' of each process"),
])
def test_keras_and_lightning_keywords_say_what_to_write_instead(kwargs, message):
    with pytest.raises(TypeError, match=r"EarlyStopping\(\) got an unexpected keyword argument " + message):
        EarlyStopping(monitor="val/loss", patience=3, **kwargs)
    with pytest.raises(ValueError, match=r"got 'auto' \(Keras' 'auto' is not taken: 'max' for a score such as "
                                         r"'val/acc', 'min' for a loss\)"):
        EarlyStopping(mode="auto")
    # the signature configs check keys against is still EarlyStopping's own (no **kwargs)
    from flaxlight.config import ConfigError, _check_kwargs
    with pytest.raises(ConfigError, match="Did you mean 'callbacks\\[0\\].patience'"):
        _check_kwargs(EarlyStopping, {"patinece": 3}, "callbacks[0]", "EarlyStopping")


def test_a_stopper_listed_before_the_callback_that_logs_its_metric_reads_this_validations_value(
        tmp_path, regression_loaders):
    """EarlyStopping listed first read the metric before the callback after it logged it: at the
    first validation 'never logged', later the previous validation's value (one behind). As in
    Lightning (it decides in on_validation_end, after every on_validation_epoch_end), stoppers now
    hear of a validation's end after the other callbacks."""
    import flaxlight

    class Score(flaxlight.Callback):  # the documented pattern: a metric computed at a validation's end
        def __init__(self):
            self.scores = [5.0, 4.0, 3.0, 9.0, 9.0, 9.0, 9.0, 9.0]  # improves twice, then stalls

        def on_validation_end(self, trainer, epoch, metrics):
            trainer.log_metrics({"val/score": self.scores[epoch - 1]})

    train, val, _ = regression_loaders
    stopper = EarlyStopping(monitor="val/score", patience=2)
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=linear_data(1)[0],
                             optimizer_hparams={"optimizer": "adam", "lr": 1e-2},
                             **quiet(tmp_path, callbacks=[stopper, Score()]))  # the stopper listed first
    trainer.train_model(train, val, num_epochs=8)
    assert (stopper.best, stopper.best_epoch) == (3.0, 3)
    assert trainer.current_epoch == 5 and "for 2 validations in a row (best 3 at epoch 3)" in trainer.stop_reason


def _diverging_at_step_6(tmp_path, callback, log_every_n_steps):
    """A trainer validating every 8 steps (16 per epoch) whose step 6 gets a NaN input (loss and
    params NaN from there on), and its train and validation loaders."""
    import numpy as np

    import flaxlight

    x, y = linear_data(16 * 32, 0)
    x[5 * 32 + 3] = np.nan  # in the 6th batch
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=x[:1],
                             optimizer_hparams={"optimizer": "adam", "lr": 1e-2},
                             **quiet(tmp_path, callbacks=[callback], val_check_interval=8,
                                     log_every_n_steps=log_every_n_steps))
    return trainer, flaxlight.ArrayLoader(x, y, batch_size=32), flaxlight.ArrayLoader(*linear_data(64, 1), batch_size=32)


@pytest.mark.parametrize("log_every_n_steps", [50, 4])
def test_a_training_diverged_just_before_a_validation_within_the_epoch_stops_there(tmp_path, log_every_n_steps):
    """The non-finite steps were counted only at delivered log points and epoch ends: a NaN in the
    last log intervals before a val_check_interval validation was taken for a 0/0 of a finite
    training, and the diverged run went on to the epoch's end (step 16, or 32)."""
    trainer, train, val = _diverging_at_step_6(tmp_path, EarlyStopping(monitor="val/loss", patience=100),
                                               log_every_n_steps)
    trainer.train_model(train, val, num_epochs=2)
    assert trainer.global_step == 8 and trainer.nonfinite_steps == 3
    assert trainer.stop_reason == "EarlyStopping: val/loss = nan is not finite (best none yet)."
