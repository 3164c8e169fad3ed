"""Regression tests for behaviour that the older tests could not see (public API only).

Each test pins one promise whose breakage the rest of the suite would miss: the RNG key
survives a resume, ``save_top_k`` prunes, ``NaNGuard("skip")`` keeps the state of a bad step
with live optimizer moments, gradient accumulation averages, evaluation weights a short last
batch by its size, a resume keeps the best validation and ``EarlyStopping``'s count, and the
``train/*_step`` values are the means of their own interval.
"""

import csv
import json
import os
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import RegressTrainer, TinyMLP, linear_data, quiet

from flaxlight import ArrayLoader
from flaxlight.callbacks import EarlyStopping, ModelCheckpoint, NaNGuard

X0 = np.zeros((1, 4), np.float32)
CONSTANT_ADAM = {"optimizer": "adam", "lr": 1e-2, "schedule": "constant"}


def _trainer(tmp_path, trainer_class=RegressTrainer, model_hparams=None, **kwargs):
    kwargs.setdefault("optimizer_hparams", CONSTANT_ADAM)
    return trainer_class(model_class=TinyMLP, model_hparams=model_hparams or {"hidden_dims": [8]}, exmp_input=X0,
                         **quiet(tmp_path, **kwargs))


def _host(tree):
    return jax.device_get(tree)


def _assert_trees_equal(got, want):
    jax.tree.map(np.testing.assert_array_equal, _host(got), _host(want))


def _step_folders(log_dir):
    return sorted(int(name) for name in os.listdir(os.path.join(log_dir, "checkpoints")) if name.isdigit())


def _csv_rows(log_dir):
    with open(os.path.join(log_dir, "metrics.csv")) as f:
        return list(csv.DictReader(f))


def _read_json(path):
    with open(path) as f:
        return json.load(f)


def _without_time(metrics):
    return {k: v for k, v in metrics.items() if k != "epoch_time"}


# --------------------------------------------------------------------------- resume
def test_resume_restores_the_rng_key_not_the_seed(tmp_path, regression_loaders):
    """A resumed trainer built with another seed continues with the run's own key: same dropout masks."""
    train, val, _ = regression_loaders
    dropout = {"hidden_dims": [16], "dropout_prob": 0.3}

    straight = _trainer(tmp_path / "straight", model_hparams=dropout, seed=0)
    straight.train_model(train, val, num_epochs=2)

    first = _trainer(tmp_path / "run", model_hparams=dropout, seed=0)
    first.train_model(train, val, num_epochs=1)
    saved_key = _host(first.state.rng)
    resumed = _trainer(tmp_path / "run", model_hparams=dropout, seed=1)  # a different seed
    assert not np.array_equal(_host(resumed.state.rng), saved_key)  # the seed alone gives another key
    resumed.train_model(train, val, num_epochs=2, resume=True)

    np.testing.assert_array_equal(_host(resumed.state.rng), saved_key)
    assert int(resumed.state.step) == 16
    _assert_trees_equal(resumed.state.params, straight.state.params)  # bitwise: same dropout masks


class FirstIsBest(RegressTrainer):
    """Epoch 1 is the best model whatever comes later (the checkpoints of later epochs are then
    written at their epoch's end, not at its validation)."""

    def is_new_model_better(self, new_metrics, old_metrics):
        return old_metrics is None


def test_resume_keeps_the_best_validation_so_far(tmp_path, regression_loaders):
    """Best at epoch 1: a run stopped after epoch 2 and resumed to 4 returns and writes the same best."""
    train, val, _ = regression_loaders

    straight = _trainer(tmp_path / "straight", FirstIsBest)
    want = straight.train_model(train, val, num_epochs=4)

    _trainer(tmp_path / "run", FirstIsBest).train_model(train, val, num_epochs=2)
    got = _trainer(tmp_path / "run", FirstIsBest).train_model(train, val, num_epochs=4, resume=True)

    epoch_1 = _read_json(tmp_path / "straight" / "run" / "metrics" / "eval_epoch_001.json")
    assert want["val/loss"] == pytest.approx(epoch_1["val/loss"], rel=1e-6)  # the straight run's best is epoch 1
    assert _without_time(got) == pytest.approx(_without_time(want), rel=1e-6)
    best_file = "metrics/best_eval.json"
    assert _read_json(tmp_path / "run" / "run" / best_file) == pytest.approx(
        _read_json(tmp_path / "straight" / "run" / best_file), rel=1e-6)


def test_resumed_early_stopping_keeps_counting(tmp_path, regression_loaders):
    """Stopped mid-patience (wait=2 of 3) and resumed: it stops at the epoch a straight run stops at."""
    train, val, _ = regression_loaders

    def stopper():
        return EarlyStopping(monitor="val/loss", patience=3, min_delta=10.0)  # never improves after epoch 1

    # FirstIsBest: epoch 3's checkpoint is written at the epoch's end. (One written by a new best at
    # a validation's end makes today's resume run that validation again, and EarlyStopping counts it
    # twice: a separate issue this test keeps out of its way.)
    straight = _trainer(tmp_path / "straight", FirstIsBest, callbacks=[stopper()])
    straight.train_model(train, val, num_epochs=10)
    assert straight.current_epoch == 4 and int(straight.state.step) == 32

    first_stopper = stopper()
    _trainer(tmp_path / "run", FirstIsBest, callbacks=[first_stopper]).train_model(train, val, num_epochs=3)
    assert first_stopper.wait == 2  # mid-patience when the run ends
    second_stopper = stopper()
    resumed = _trainer(tmp_path / "run", FirstIsBest, callbacks=[second_stopper])
    resumed.train_model(train, val, num_epochs=10, resume=True)
    assert resumed.current_epoch == 4 and int(resumed.state.step) == 32
    assert second_stopper.wait == 3 and second_stopper.best_epoch == 1
    assert resumed.stop_reason is not None and "EarlyStopping" in resumed.stop_reason


# --------------------------------------------------------------------------- checkpoints
def test_save_top_k_keeps_only_the_k_best_checkpoints(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    checkpoint = ModelCheckpoint(monitor="val/loss", save_top_k=2, save_last=False)
    trainer = _trainer(tmp_path, callbacks=[checkpoint])
    trainer.train_model(train, val, num_epochs=5)

    metrics_dir = tmp_path / "run" / "metrics"
    val_losses = {8 * epoch: _read_json(metrics_dir / f"eval_epoch_{epoch:03d}.json")["val/loss"]
                  for epoch in range(1, 6)}
    assert [val_losses[s] for s in sorted(val_losses)] == sorted(val_losses.values(), reverse=True)  # improving
    two_best = sorted(val_losses, key=val_losses.get)[:2]
    assert two_best == [40, 32]
    assert _step_folders(tmp_path / "run") == [32, 40]
    assert [step for _, step in checkpoint.best] == two_best and checkpoint.best_step == 40


# --------------------------------------------------------------------------- NaNGuard
class NaNFromStep8(RegressTrainer):
    """The loss is NaN from the 8th optimizer update on (state.step counts the updates done before)."""

    def loss_fn(self, params, batch, *, train, rng, state):
        loss, aux = super().loss_fn(params, batch, train=train, rng=rng, state=state)
        return jnp.where(state.step >= 7, jnp.nan, loss), aux


def test_nan_guard_skip_keeps_the_state_with_live_adam_moments(tmp_path, regression_loaders):
    """The gradient of the NaN branch is zero, but Adam's momentum would still move the params:
    every skipped step must leave them exactly as after step 7."""
    train, _, _ = regression_loaders
    kwargs = dict(callbacks=[NaNGuard(action="skip")], enable_checkpointing=False)
    nan_run = _trainer(tmp_path / "nan", NaNFromStep8, **kwargs)
    nan_run.train_model(train, None, num_epochs=2)
    assert int(nan_run.state.step) == 16 and nan_run.nonfinite_steps == 9

    good_run = _trainer(tmp_path / "good", NaNFromStep8, max_steps=7, **kwargs)
    good_run.train_model(train, None, num_epochs=2)
    assert int(good_run.state.step) == 7 and good_run.nonfinite_steps == 0

    start = _trainer(tmp_path / "start", NaNFromStep8, **kwargs).state.params
    assert not np.allclose(jax.tree.leaves(good_run.state.params)[0], jax.tree.leaves(start)[0])  # it trained
    jax.tree.map(lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-7),
                 _host(nan_run.state.params), _host(good_run.state.params))


class NaNMetricOnOddSteps(RegressTrainer):
    """A metric that is NaN on some batches by its nature (0/0), with a finite loss and params."""

    def loss_fn(self, params, batch, *, train, rng, state):
        loss, (metrics, updates) = super().loss_fn(params, batch, train=train, rng=rng, state=state)
        return loss, ({**metrics, "ratio": jnp.where(state.step % 2 == 1, jnp.nan, 1.0)}, updates)


@pytest.mark.parametrize("guard", [None, "skip", "stop"])
def test_a_metric_that_is_nan_on_some_batches_does_not_damage_the_step(tmp_path, regression_loaders, guard):
    """Only the loss and the params make a step non-finite: the run trains every step, is not
    stopped, and saves its checkpoints (it saved none, skipped half its updates or stopped)."""
    train, val, _ = regression_loaders
    callbacks = [NaNGuard(action=guard)] if guard else []
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # "Not saving checkpoint ...: the loss or the parameters were NaN"
        trainer = _trainer(tmp_path / "run", NaNMetricOnOddSteps, callbacks=callbacks)
        trainer.train_model(train, val, num_epochs=2)
    assert trainer.nonfinite_steps == 0 and trainer.global_step == 2 * len(train)
    assert trainer.checkpointer.latest_step() == trainer.global_step
    plain = _trainer(tmp_path / "plain", enable_checkpointing=False)
    plain.train_model(train, val, num_epochs=2)
    _assert_trees_equal(trainer.state.params, plain.state.params)


# --------------------------------------------------------------------------- optimizer
def test_gradient_accumulation_averages_the_micro_batches(tmp_path):
    """Plain SGD (no clipping, no decay, constant rate): 4 micro-batches of 8 = one batch of 32."""
    x, y = linear_data(32, 0)
    sgd = {"optimizer": "sgd", "lr": 0.05, "schedule": "constant", "gradient_clip": None, "weight_decay": 0}

    def run(name, batch_size, **extra):
        trainer = _trainer(tmp_path / name, optimizer_hparams={**sgd, **extra}, enable_checkpointing=False)
        trainer.train_model(ArrayLoader(x, y, batch_size=batch_size), None, num_epochs=3)
        return trainer

    big = run("big", 32)
    micro = run("micro", 8, accumulate_grad_batches=4)
    assert int(big.state.step) == 3 and int(micro.state.step) == 12
    start = _trainer(tmp_path / "start").state.params
    assert not np.allclose(jax.tree.leaves(big.state.params)[0], jax.tree.leaves(start)[0])  # it trained
    jax.tree.map(lambda got, want: np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6),
                 _host(micro.state.params), _host(big.state.params))


# --------------------------------------------------------------------------- metrics
def test_eval_means_weight_a_short_last_batch_by_its_size(tmp_path):
    """70 examples in batches of 32, 32 and 6: the per-example mean, as one batch of 70 gives it."""
    x, y = linear_data(70, 2)
    x[64:] *= 5  # the short last batch's loss is far from the others'
    y[64:] *= 5
    trainer = _trainer(tmp_path)
    batched = trainer.eval_model(ArrayLoader(x, y, batch_size=32), log_prefix="test/")
    whole = trainer.eval_model(ArrayLoader(x, y, batch_size=70), log_prefix="test/")
    pred, _ = trainer.state.apply_model(trainer.state.params, x, train=False)
    by_hand = float(np.mean((np.asarray(pred) - y) ** 2))
    assert whole["test/loss"] == pytest.approx(by_hand, rel=1e-5)
    assert batched["test/loss"] == pytest.approx(whole["test/loss"], rel=1e-5)


def test_step_logs_are_means_of_their_own_interval(tmp_path, regression_loaders):
    """8 batches per epoch, a log point every 4: the two train/loss_step values of an epoch are the
    means of its halves, so their mean is the epoch's train/loss."""
    train, val, _ = regression_loaders
    _trainer(tmp_path, log_every_n_steps=4, optimizer_hparams={"optimizer": "adam", "lr": 3e-2}).train_model(
        train, val, num_epochs=2)
    rows = _csv_rows(tmp_path / "run")
    step_loss = {int(r["step"]): float(r["train/loss_step"]) for r in rows if r["train/loss_step"]}
    epoch_loss = {int(r["step"]): float(r["train/loss"]) for r in rows if r["train/loss"]}
    assert sorted(step_loss) == [4, 8, 12, 16] and sorted(epoch_loss) == [8, 16]
    for end in (8, 16):
        halves = step_loss[end - 4], step_loss[end]
        assert halves[0] != pytest.approx(halves[1], rel=1e-3)  # the loss moved within the epoch
        assert (halves[0] + halves[1]) / 2 == pytest.approx(epoch_loss[end], rel=1e-5)
