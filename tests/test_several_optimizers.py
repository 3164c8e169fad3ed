"""Steps of your own that update more than once per batch (a GAN's two optimizers, alternating
updates), several learning rates, and the errors such steps meet: what a user sees in
global_step, checkpoints, metrics.csv, train/lr and the messages."""

import csv
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import RegressTrainer, SigtermAt, TinyMLP, linear_data, quiet

import flaxlight
from flaxlight.callbacks import LearningRateMonitor, ModelCheckpoint

X0 = np.zeros((1, 4), np.float32)


class TwoUpdates(RegressTrainer):
    """Two optimizer updates per batch (TrainStep.step twice): state.step advances by 2 per batch."""

    def create_functions(self):
        step = flaxlight.TrainStep(self.loss_fn)

        def train_step(state, batch):
            state, metrics = step.step(state, batch)
            state, _ = step.step(state, batch)
            return state, metrics

        return train_step, step.eval_step


def _train(log_dir, cls=TwoUpdates, resume=False, num_epochs=3, optimizer_hparams=None, **options):
    trainer = cls(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=X0,
                  optimizer_hparams=optimizer_hparams or {"optimizer": "adam", "lr": 1e-2, "schedule": "constant"},
                  **quiet(log_dir, logger_params={"log_dir": str(log_dir)}, log_every_n_steps=4, **options))
    train = flaxlight.ArrayLoader(*linear_data(256, 0), batch_size=32, shuffle=True, seed=0)  # 8 batches an epoch
    val = flaxlight.ArrayLoader(*linear_data(64, 1), batch_size=32)
    trainer.train_model(train, val, num_epochs=num_epochs, resume=resume)
    return trainer


def _csv_steps(log_dir):
    with open(log_dir / "metrics.csv") as f:
        return [row["step"] for row in csv.DictReader(f)]


def _csv_column(log_dir, key):
    with open(log_dir / "metrics.csv") as f:
        return {int(row["step"]): float(row[key]) for row in csv.DictReader(f) if row.get(key)}


# ---------------------------------------------------------------------- 1. batches, not updates
@pytest.mark.parametrize("max_steps", [20, None])
def test_a_resumed_run_of_two_updates_per_batch_counts_batches_as_the_uninterrupted_one(tmp_path, max_steps):
    """The resume took state.step (40 updates after 20 batches) for global_step: with max_steps=20 it
    stopped at once, trained none of the 8 remaining batches and saved the step-12 state as checkpoint
    24; without max_steps its records and checkpoints jumped from 12 to 28."""
    options = {"max_steps": max_steps} if max_steps else {}
    reference = _train(tmp_path / "ref", **options)
    with pytest.raises(SystemExit):
        _train(tmp_path / "run", callbacks=[SigtermAt(12)], **options)
    resumed = _train(tmp_path / "run", resume=True, **options)
    batches = max_steps or 24
    assert reference.global_step == resumed.global_step == batches
    assert int(resumed.state.step) == 2 * batches
    assert resumed.checkpointer.all_steps() == reference.checkpointer.all_steps()
    assert _csv_steps(tmp_path / "run") == _csv_steps(tmp_path / "ref")
    jax.tree.map(np.testing.assert_array_equal, resumed.state.params, reference.state.params)


def test_loading_or_resuming_a_finished_run_of_two_updates_per_batch_gives_its_batch_count(tmp_path, capsys):
    trained = _train(tmp_path / "run", max_steps=20, callbacks=[ModelCheckpoint(every_n_epochs=1, save_top_k=-1)])
    assert trained.checkpointer.all_steps() == [8, 16, 20]
    loaded = TwoUpdates.load_from_checkpoint(tmp_path / "run", exmp_input=X0, which="last")
    assert loaded.global_step == 20 and int(loaded.state.step) == 40
    loaded.test(flaxlight.ArrayLoader(*linear_data(64, 2), batch_size=32))
    assert _csv_steps(tmp_path / "run")[-1] == "20"  # the test's record is at the run's step
    capsys.readouterr()
    again = _train(tmp_path / "run", resume=True, max_steps=20, callbacks=[ModelCheckpoint(every_n_epochs=1, save_top_k=-1)])
    assert "Nothing to train" in capsys.readouterr().err and again.global_step == 20
    trained.load_model(16)  # flaxlight's load_model: the checkpoint's step
    assert trained.global_step == 16 and int(trained.state.step) == 32


def test_a_second_train_model_call_goes_on_from_the_batches_of_the_first(tmp_path):
    """As a step of one update per batch: the second call's steps are the first's plus its batches."""
    def twice(cls, name):
        trainer = _train(tmp_path / name, cls=cls, num_epochs=1)
        trainer.train_model(flaxlight.ArrayLoader(*linear_data(256, 0), batch_size=32), None, num_epochs=1)
        return trainer, _csv_steps(tmp_path / name)

    (one, one_steps), (two, two_steps) = twice(RegressTrainer, "one"), twice(TwoUpdates, "two")
    assert one.global_step == two.global_step == 16 and int(two.state.step) == 32
    assert two_steps == one_steps


# ---------------------------------------------------------------------- 4. the schedule and train/lr
def test_train_lr_shows_the_rate_the_optimizer_used_and_a_schedule_that_runs_out_is_said(tmp_path, capsys):
    """sgd with a linear decay flaxlight sized to 16 batches: the 32 updates ran it out after epoch 1,
    while train/lr showed the schedule at the batch count (never used)."""
    hparams = {"optimizer": "sgd", "lr": 0.1, "schedule": "linear", "end_lr_factor": 0.0, "gradient_clip": None}
    schedule = optax.linear_schedule(0.1, 0.0, 16)
    trainer = _train(tmp_path, num_epochs=2, optimizer_hparams=hparams, callbacks=[LearningRateMonitor()])
    assert trainer.one_update_per_batch is False and trainer.learning_rate() is None  # the schedule counts updates
    said = capsys.readouterr().err
    assert "made 16 optimizer updates in 8 batches (2 per batch" in said
    assert "sized for one update per batch (16 updates), so it ends after about 1/2 of the run" in said
    assert "super().init_optimizer(num_epochs, 2 * num_steps_per_epoch)" in said
    logged = _csv_column(tmp_path, "train/lr")
    assert sorted(logged) == [4, 8, 12, 16]
    assert logged == pytest.approx({step: float(schedule(2 * step)) for step in logged})  # 0 from step 8 on

    class Sized(TwoUpdates):  # what the message says to write
        def init_optimizer(self, num_epochs, num_steps_per_epoch):
            super().init_optimizer(num_epochs, 2 * num_steps_per_epoch)

    _train(tmp_path / "sized", cls=Sized, num_epochs=2, optimizer_hparams=hparams, callbacks=[LearningRateMonitor()])
    assert "ends after" not in capsys.readouterr().err
    spans = optax.linear_schedule(0.1, 0.0, 32)
    logged = _csv_column(tmp_path / "sized", "train/lr")
    assert logged == pytest.approx({step: float(spans(2 * step)) for step in logged}) and logged[12] > 0


# ---------------------------------------------------------------------- 3. several learning rates
class Net(flaxlight.TrainerModule):
    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        pred, updates = state.apply_model(params, x, train=train, rng=rng)
        return jnp.mean((pred - y) ** 2), ({}, updates)


def _labels(params):
    return {name: "head" if name == "Dense_1" else "body" for name in params}


def test_two_learning_rates_of_one_multi_transform_are_logged_one_series_each(tmp_path):
    """Only the first group's rate was logged, as an unnamed train/lr: the other's appeared nowhere.
    The groups are given out of label order (jit hands the state back sorted): each keeps its own."""
    head = optax.linear_schedule(1e-3, 0.0, 24)
    tx = optax.multi_transform({"head": optax.inject_hyperparams(optax.adam)(learning_rate=head),
                                "body": optax.inject_hyperparams(optax.adam)(learning_rate=1e-2)}, _labels)
    _train(tmp_path, cls=Net, optimizer_hparams=tx, callbacks=[LearningRateMonitor()])
    assert "train/lr" not in open(tmp_path / "metrics.csv").readline().strip().split(",")
    logged_body, logged_head = _csv_column(tmp_path, "train/lr/body"), _csv_column(tmp_path, "train/lr/head")
    assert logged_head == pytest.approx({step: float(head(step)) for step in range(4, 25, 4)}, abs=1e-9)
    assert logged_body == pytest.approx({step: 1e-2 for step in range(4, 25, 4)})


class DState(flaxlight.TrainState):
    d_opt_state: Any = None


class SecondOptimizer(Net):
    """A second optimizer (a GAN's discriminator's), its state in a field of the TrainState: it
    updates the head at 1e-3 while state.tx (1e-2) updates the body."""

    d_tx = optax.multi_transform({"head": optax.inject_hyperparams(optax.sgd)(learning_rate=1e-3),
                                  "body": optax.set_to_zero()}, _labels)

    def init_model(self, exmp_input):
        super().init_model(exmp_input)
        s = self.state
        self.state = DState.create(apply_fn=s.apply_fn, params=s.params, tx=None, rng=s.rng,
                                   d_opt_state=self.d_tx.init(s.params))

    def create_functions(self):
        step = flaxlight.TrainStep(self.loss_fn)

        def train_step(state, batch):
            _, grads = step.compute_gradients(state, batch, flaxlight.state.step_key(state))
            updates, d_opt_state = self.d_tx.update(grads, state.d_opt_state, state.params)
            state = state.replace(params=optax.apply_updates(state.params, updates), d_opt_state=d_opt_state)
            return step.step(state, batch)

        return train_step, step.eval_step


def test_a_second_optimizers_state_in_a_field_is_logged_under_the_fields_name(tmp_path):
    only_body = optax.multi_transform({"body": optax.inject_hyperparams(optax.adam)(learning_rate=1e-2),
                                       "head": optax.set_to_zero()}, _labels)
    _train(tmp_path, cls=SecondOptimizer, optimizer_hparams=only_body, callbacks=[LearningRateMonitor()])
    assert _csv_column(tmp_path, "train/lr/opt_state") == pytest.approx({s: 1e-2 for s in range(4, 25, 4)})
    assert _csv_column(tmp_path, "train/lr/d_opt_state") == pytest.approx({s: 1e-3 for s in range(4, 25, 4)})


def test_lightnings_logging_interval_is_taken_or_refused_with_flaxlights_way():
    LearningRateMonitor(logging_interval="step")
    LearningRateMonitor(logging_interval=None)
    LearningRateMonitor(logging_interval="epoch")
    with pytest.raises(ValueError, match=r"logging_interval='hour'.*expected None or 'step'.*or 'epoch'"):
        LearningRateMonitor(logging_interval="hour")
    with pytest.raises(ValueError, match=r"log_momentum=True\) is Lightning's"):
        LearningRateMonitor(log_momentum=True)


# ---------------------------------------------------------------------- 2. the first-batch check
class Generator(flaxlight.TrainerModule):
    """The model is a generator fed latent z (shape (B, 2)); batches are real data (shape (B, 4))."""

    def create_functions(self):
        def loss(params, state, x):
            z = jax.random.normal(flaxlight.state.step_key(state), (x.shape[0], 2))
            fake, _ = state.apply_model(params, z, train=True)
            return jnp.mean((fake.mean(0) - x.mean(0)) ** 2)

        def train_step(state, batch):
            value, grads = jax.value_and_grad(loss)(state.params, state, batch[0])
            return state.apply_gradients(grads=grads, value=value), {"loss": value}

        def eval_step(state, batch):
            return {"loss": loss(state.params, state, batch[0])}

        return train_step, eval_step


def _generator(tmp_path, cls=Generator):
    return cls(model_class=TinyMLP, model_hparams={"hidden_dims": [8], "output_dim": 4},
               optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, exmp_input=np.zeros((1, 2), np.float32),
               **quiet(tmp_path))


def test_a_step_of_yours_feeding_the_model_something_else_than_the_batch_is_accepted(tmp_path):
    """It was refused ('Pass an exmp_input taken from your loader'), never naming check_batches=False."""
    x, y = linear_data(64, 0)
    result = _generator(tmp_path).train_model((x, y), (x, y), num_epochs=1, batch_size=32)
    assert np.isfinite(result["train/loss"]) and np.isfinite(result["val/loss"])


def test_a_step_of_yours_that_fails_on_a_mismatched_batch_says_so_under_the_mismatch(tmp_path):
    class Broken(Generator):
        def create_functions(self):
            def train_step(state, batch):
                fake, _ = state.apply_model(state.params, batch[0], train=True)  # (B, 4) into a model of z (B, 2)
                return state, {"loss": fake.mean()}
            return train_step, super().create_functions()[1]

    x, y = linear_data(64, 0)
    with pytest.raises(ValueError) as raised:
        _generator(tmp_path, Broken).train_model((x, y), None, num_epochs=1, batch_size=32)
    message = str(raised.value)
    assert "Element 0 of the first batch of train_loader has shape (32, 4)" in message
    assert "Tracing Broken's train step (create_functions) on this batch failed too" in message
    assert "check_batches=False" in message


# ---------------------------------------------------------------------- 5. what a train step returns
@pytest.mark.parametrize("returns, got", [(lambda state, metrics: state, "got TrainState"),
                                          (lambda state, metrics: (metrics, state), "got (dict, TrainState)")])
def test_a_train_step_returning_other_than_state_and_metrics_is_told_what_to_return(tmp_path, returns, got):
    """Returning the state alone failed with 'cannot unpack non-iterable TrainState object'."""
    class StateOnly(RegressTrainer):
        def create_functions(self):
            step = flaxlight.TrainStep(self.loss_fn)

            def train_step(state, batch):
                return returns(*step.step(state, batch))

            return train_step, step.eval_step

    with pytest.raises(TypeError, match=r"The train step must return \(state, metrics\)") as raised:
        _train(tmp_path, cls=StateOnly)
    assert got in str(raised.value) and "`return state, {'loss': loss}`" in str(raised.value)


# ---------------------------------------------------------------------- review: the batch count kept
def _trainer_of(log_dir, cls=TwoUpdates, **options):
    return cls(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=X0,
               optimizer_hparams={"optimizer": "adam", "lr": 1e-2, "schedule": "constant"},
               **quiet(log_dir, logger_params={"log_dir": str(log_dir)}, log_every_n_steps=4, **options))


def _loaders():
    return (flaxlight.ArrayLoader(*linear_data(256, 0), batch_size=32, shuffle=True, seed=0),
            flaxlight.ArrayLoader(*linear_data(64, 1), batch_size=32))


def test_a_next_train_model_after_a_failed_epoch_counts_batches(tmp_path):
    """A failure at batch 12, then train_model again on the trainer: it went on from state.step (24)."""
    from conftest import FailAt
    trainer = _trainer_of(tmp_path / "run", callbacks=[FailAt(12)])
    with pytest.raises(RuntimeError, match="data error at step 12"):
        trainer.train_model(*_loaders(), num_epochs=3)
    trainer.callbacks = [cb for cb in trainer.callbacks if not isinstance(cb, FailAt)]
    trainer.train_model(*_loaders(), num_epochs=3)
    assert trainer.global_step == 12 + 24 and int(trainer.state.step) == 2 * 36


def test_a_test_between_two_train_model_calls_keeps_the_batch_count(tmp_path):
    """test() restored the best checkpoint for itself and left the trainer counting from state.step."""
    trainer = _trainer_of(tmp_path / "run", callbacks=[ModelCheckpoint(monitor="val/loss", mode="max")])
    trainer.train_model(*_loaders(), num_epochs=2)
    trainer.test(_loaders()[1])
    trainer.train_model(*_loaders(), num_epochs=1)
    assert trainer.global_step == 24 and _csv_steps(tmp_path / "run")[-1] == "24"


def test_a_second_optimizers_rate_is_logged_in_a_second_train_model_call_too(tmp_path):
    """A dict optimizer with a schedule and a second optimizer in a field: the second call logged one
    train/lr (the schedule's) and the field's rate disappeared (review)."""
    trainer = _trainer_of(tmp_path / "run", cls=SecondOptimizer, callbacks=[LearningRateMonitor()])
    trainer.train_model(*_loaders(), num_epochs=1)
    trainer.train_model(*_loaders(), num_epochs=1)
    rates = _csv_column(tmp_path / "run", "train/lr/d_opt_state")
    assert rates == pytest.approx({s: 1e-3 for s in (4, 8, 12, 16)})


def test_a_one_update_step_of_yours_has_its_rates_from_the_schedule_without_reading_the_state(tmp_path):
    """Before its first epoch's end a step of yours is not known to make one update per batch: the
    monitor read the optimizer state at every log point of the run (7 ms each for 300 leaves; review).
    Once the epoch counted one update per batch, it reads nothing at log points."""
    class OneUpdate(RegressTrainer):
        def create_functions(self):
            step = flaxlight.TrainStep(self.loss_fn)
            return (lambda state, batch: step.step(state, batch)), step.eval_step  # the user's own function

    monitor = LearningRateMonitor()
    trainer = _trainer_of(tmp_path / "run", cls=OneUpdate, callbacks=[monitor])
    trainer.train_model(*_loaders(), num_epochs=2)
    assert monitor.every_n_steps is None  # no on_step reads: the rates come from the host schedule
    assert _csv_column(tmp_path / "run", "train/lr") == pytest.approx({s: 1e-2 for s in range(4, 17, 4)})
