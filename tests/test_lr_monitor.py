"""LearningRateMonitor: the record of step s shows the rate (and plateau scale) in effect at s,
the same for a dict optimizer and a ready one, without making the loop wait for the device."""

import csv

import numpy as np
import optax
import pytest
from conftest import RegressTrainer, TinyMLP, quiet

from flaxlight.callbacks import Callback, LearningRateMonitor, ModelCheckpoint
from flaxlight.optim import current_learning_rate

X0 = np.zeros((1, 4), np.float32)
# 0.1 for updates 1-12, 0.001 from update 13 on: the rate of the next update after step s is SCHEDULE(s).
SCHEDULE = optax.piecewise_constant_schedule(0.1, {12: 0.01})


def _trainer(tmp_path, optimizer_hparams, **kwargs):
    return RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=X0,
                          optimizer_hparams=optimizer_hparams, **quiet(tmp_path, **kwargs))


def _logged(tmp_path, key="train/lr"):
    with open(tmp_path / "run" / "metrics.csv") as f:
        return {int(row["step"]): float(row[key]) for row in csv.DictReader(f) if row.get(key)}


class StateAtStep(Callback):
    """What the optimizer state says right after each of its steps (a device read per step: a test only)."""

    def __init__(self, every):
        self.every_n_steps, self.rates, self.scales = every, {}, {}

    def on_step(self, trainer, step):
        self.rates[step] = float(current_learning_rate(trainer.state))
        scales = [s for s in _nodes(trainer.state.opt_state) if isinstance(s, optax.contrib.ReduceLROnPlateauState)]
        if scales:
            self.scales[step] = float(scales[0].scale)


def _nodes(tree):
    yield tree
    if isinstance(tree, (tuple, list)):
        for child in tree:
            yield from _nodes(child)


@pytest.mark.parametrize("every", [5, 10])
def test_a_ready_inject_hyperparams_optimizer_logs_the_rate_of_its_step_like_the_dict_form(tmp_path, regression_loaders,
                                                                                         every):
    """The rate was read from the live state when the record arrived, a log point late: the
    drop at update 13 showed at step 10 (every=5 and every=10)."""
    train, val, _ = regression_loaders  # 8 steps per epoch
    expected = {s: float(SCHEDULE(s)) for s in range(every, 33, every)}
    ready = StateAtStep(every)
    _trainer(tmp_path / "ready", optax.inject_hyperparams(optax.sgd)(learning_rate=SCHEDULE),
             callbacks=[LearningRateMonitor(), ready], log_every_n_steps=every).train_model(train, val, num_epochs=4)
    _trainer(tmp_path / "dict", {"optimizer": "sgd", "schedule": SCHEDULE},
             callbacks=[LearningRateMonitor()], log_every_n_steps=every).train_model(train, val, num_epochs=4)
    assert _logged(tmp_path / "ready") == pytest.approx(expected)
    assert _logged(tmp_path / "dict") == pytest.approx(expected)
    assert ready.rates == pytest.approx(expected)  # current_learning_rate(state) says the same


def test_the_plateau_scale_logged_at_a_step_is_the_one_in_the_state_at_that_step(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    state = StateAtStep(10)
    plateau = {"patience": 1, "factor": 0.5, "cooldown": 0}
    trainer = _trainer(tmp_path, {"optimizer": "sgd", "lr": 0.3, "schedule": "constant", "reduce_on_plateau": plateau},
                       callbacks=[LearningRateMonitor(), state], log_every_n_steps=10)
    trainer.train_model(train, val, num_epochs=6)
    scales = _logged(tmp_path, "train/lr_scale")
    assert sorted(scales) == [10, 20, 30, 40]
    assert scales == pytest.approx(state.scales, rel=1e-6) and scales[40] < scales[10]
    assert _logged(tmp_path) == pytest.approx({s: 0.3 * scale for s, scale in scales.items()}, rel=1e-6)


def test_a_ready_chain_with_a_plateau_logs_rate_times_scale_as_the_dict_form_does(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    state = StateAtStep(4)
    tx = optax.chain(optax.inject_hyperparams(optax.sgd)(learning_rate=SCHEDULE),
                     optax.contrib.reduce_on_plateau(patience=1, factor=0.5, cooldown=0))
    _trainer(tmp_path, tx, callbacks=[LearningRateMonitor(), state], log_every_n_steps=4).train_model(
        train, val, num_epochs=3)
    assert _logged(tmp_path, "train/lr_scale") == pytest.approx(state.scales, rel=1e-6)
    assert _logged(tmp_path) == pytest.approx({s: float(SCHEDULE(s)) * state.scales[s] for s in state.scales},
                                              rel=1e-6)


def test_a_log_point_delivered_early_by_a_checkpoint_still_gets_its_own_rate(tmp_path, regression_loaders):
    """A validation every log point saves a checkpoint, which flushes the running log before
    the monitor's on_step of that step has run."""
    train, val, _ = regression_loaders
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=SCHEDULE)
    _trainer(tmp_path, tx, callbacks=[ModelCheckpoint(every_n_steps=4), LearningRateMonitor()], log_every_n_steps=4,
             val_check_interval=4, check_val_every_n_epoch=None).train_model(train, val, num_epochs=3)
    assert _logged(tmp_path) == pytest.approx({s: float(SCHEDULE(s)) for s in range(4, 25, 4)})


def test_reading_the_rate_from_the_device_adds_no_wait_to_the_loop(tmp_path):
    """The values are taken at the step and copied in the background, as the metrics are: no
    read that waits for the device, none that jax.transfer_guard('disallow') would stop."""
    import jax
    from conftest import linear_data
    from test_speed_features import count_host_reads

    from flaxlight import ArrayLoader

    tx = optax.chain(optax.inject_hyperparams(optax.adam)(learning_rate=optax.linear_schedule(1e-2, 0.0, 1000)),
                     optax.contrib.reduce_on_plateau(patience=20))
    trainer = _trainer(tmp_path, tx, callbacks=[LearningRateMonitor()], log_every_n_steps=16)
    train = ArrayLoader(*linear_data(1024, 0), batch_size=8)  # 128 steps
    trainer.train_model(train, None, num_epochs=1)  # compiles everything
    with jax.transfer_guard_device_to_host("disallow"), count_host_reads() as reads:
        trainer.train_epoch(train)
    assert reads["wait"] == 0 and reads["implicit"] == 0, reads
    # Per log point, not per step (128 steps): 48 on the CPU; 66 on a GPU, where each point's
    # snapshot also starts a copy of the sums (on the CPU they are in host memory already).
    assert reads["copy"] + reads["read"] <= 8 * (128 // 16 + 2), reads
    trainer.logger.flush()
    assert sorted(_logged(tmp_path)) == list(range(16, 257, 16))


def test_an_accumulating_inject_hyperparams_optimizer_logs_the_next_updates_rate_at_every_step(
        tmp_path, regression_loaders):
    """optax.MultiSteps(inject_hyperparams(...)): at a step completing an update the monitor logged
    the previous update's rate (the zero-gradient probe only accumulated): sched(2) at step 6 for sched(3)."""
    train, val, _ = regression_loaders  # 8 steps per epoch: 4 updates of 2 batches
    schedule = optax.linear_schedule(0.1, 0.0, 100)
    ready = optax.MultiSteps(optax.inject_hyperparams(optax.sgd)(learning_rate=schedule), every_k_schedule=2)
    _trainer(tmp_path, ready.gradient_transformation(), callbacks=[LearningRateMonitor()],
             log_every_n_steps=3).train_model(train, val, num_epochs=3)
    logged = _logged(tmp_path)
    assert sorted(logged) == [3, 6, 9, 12, 15, 18, 21, 24]
    assert logged == pytest.approx({step: float(schedule(step // 2)) for step in logged})  # s // 2 updates made


@pytest.mark.parametrize("optimizer", ["dict", "ready"])
def test_logging_interval_epoch_logs_each_epochs_first_rate_once(tmp_path, regression_loaders, optimizer):
    """Lightning's logging_interval='epoch' was refused; now the rate of each epoch's first update is
    logged at the step before it, and nothing at the log points in between."""
    train, val, _ = regression_loaders  # 8 steps per epoch
    hparams = {"optimizer": "sgd", "schedule": SCHEDULE} if optimizer == "dict" else \
        optax.inject_hyperparams(optax.sgd)(learning_rate=SCHEDULE)
    _trainer(tmp_path, hparams, callbacks=[LearningRateMonitor(logging_interval="epoch")],
             log_every_n_steps=2).train_model(train, val, num_epochs=4)
    assert _logged(tmp_path) == pytest.approx({s: float(SCHEDULE(s)) for s in (0, 8, 16, 24)})
