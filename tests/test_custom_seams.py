"""A researcher's own parts: a TrainState subclass, a TrainStep's gradients, a constructor of their
own, their own rule for the best model, Linen collections."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import flaxlight
from conftest import FailAt, RegressTrainer, TinyMLP, linear_data, quiet
from flaxlight.state import TrainState


class EMAState(TrainState):
    ema: object = None
    updates_seen: object = None


class EMATrainer(RegressTrainer):
    """Keeps an EMA of the params and a counter of its own in the state (the seed's init_model seam)."""

    def init_model(self, exmp_input):
        super().init_model(exmp_input)
        s = self.state
        self.state = EMAState.create(apply_fn=s.apply_fn, params=s.params, tx=None, rng=s.rng,
                                     ema=s.params, updates_seen=jnp.zeros((), jnp.int32))  # ema shares the params' buffers

    def create_functions(self):
        train_step, eval_step = super().create_functions()

        def with_ema(state, batch):
            state, metrics = train_step(state, batch)
            ema = jax.tree.map(lambda e, p: 0.9 * e + 0.1 * p, state.ema, state.params)
            return state.replace(ema=ema, updates_seen=state.updates_seen + 1), metrics

        return with_ema, eval_step


def _ema_trainer(log_dir, **kwargs):
    x, _ = linear_data(8)
    return EMATrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]},
                      optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, exmp_input=x[:1],
                      **quiet(log_dir, logger_params={"log_dir": str(log_dir)}, **kwargs))


def _loaders():
    return (flaxlight.ArrayLoader(*linear_data(128, 0), batch_size=16, shuffle=True, seed=0),
            flaxlight.ArrayLoader(*linear_data(32, 1), batch_size=16))


def _equal(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


def test_a_train_state_subclass_trains_resumes_and_loads_with_its_own_fields(tmp_path):
    whole = _ema_trainer(tmp_path / "whole")
    whole.train_model(*_loaders(), num_epochs=3)
    assert type(whole.state) is EMAState and int(whole.state.updates_seen) == 24

    broken = _ema_trainer(tmp_path / "resumed", callbacks=[FailAt(13)])
    with pytest.raises(RuntimeError, match="data error at step 13"):
        broken.train_model(*_loaders(), num_epochs=3)
    resumed = _ema_trainer(tmp_path / "resumed")
    resumed.train_model(*_loaders(), num_epochs=3, resume=True)
    assert int(resumed.state.updates_seen) == 24
    assert _equal(resumed.state.params, whole.state.params) and _equal(resumed.state.ema, whole.state.ema)

    loaded = EMATrainer.load_from_checkpoint(whole.log_dir, exmp_input=linear_data(8)[0][:1], which="last")
    assert int(loaded.state.updates_seen) == 24 and _equal(loaded.state.ema, whole.state.ema)


def test_a_checkpoint_saved_without_a_new_state_field_loads_with_a_warning(tmp_path):
    x, _ = linear_data(8)
    plain = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]},
                           optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, exmp_input=x[:1], **quiet(tmp_path))
    plain.train_model(*_loaders(), num_epochs=1)
    with pytest.warns(RuntimeWarning, match="holds no ema, updates_seen .*keep their value"):
        loaded = EMATrainer.load_from_checkpoint(plain.log_dir, exmp_input=x[:1])
    assert _equal(loaded.state.params, plain.state.params) and int(loaded.state.updates_seen) == 0


class FreezeFirstLayer(flaxlight.TrainStep):
    def compute_gradients(self, state, batch, rng):
        (loss, aux), grads = super().compute_gradients(state, batch, rng)
        grads = {**grads, "Dense_0": jax.tree.map(jnp.zeros_like, grads["Dense_0"])}
        return (loss, aux), grads


class FrozenTrainer(RegressTrainer):
    def create_functions(self):
        step = FreezeFirstLayer(self.loss_fn)
        return step.step, step.eval_step


def test_an_overridden_compute_gradients_is_what_the_trainer_applies(tmp_path):
    x, _ = linear_data(8)
    trainer = FrozenTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]},
                            optimizer_hparams={"optimizer": "sgd", "lr": 0.1}, exmp_input=x[:1], **quiet(tmp_path))
    before = jax.tree.map(np.asarray, trainer.state.params)
    trainer.train_model(*_loaders(), num_epochs=1)
    after = trainer.state.params
    assert _equal(after["Dense_0"], before["Dense_0"]) and not _equal(after["Dense_1"], before["Dense_1"])


def test_overriding_backward_alone_is_refused_with_the_seam_to_use():
    class OwnBackward(flaxlight.TrainStep):
        def backward(self, batch, rng=None):
            return super().backward(batch, rng)

    with pytest.raises(TypeError, match="overrides backward.*Override compute_gradients"):
        OwnBackward(lambda params, batch, **kw: 0.0)


class KwargsOnly(RegressTrainer):
    """Sets an attribute of its own, passes everything on."""

    def __init__(self, **kwargs):
        self.temperature = 1.0
        super().__init__(**kwargs)


class NamesItsModel(RegressTrainer):
    """The seed's pattern with a model that takes no hyperparameters: the trainer names its model."""

    def __init__(self, **kwargs):
        super().__init__(model_class=TinyMLP, model_hparams={}, **kwargs)


@pytest.mark.parametrize("trainer_class", [KwargsOnly, NamesItsModel])
def test_load_from_checkpoint_rebuilds_a_model_without_hyperparameters(trainer_class, tmp_path):
    x, _ = linear_data(8)
    model = {} if trainer_class is NamesItsModel else {"model_class": TinyMLP, "model_hparams": {}}
    trainer = trainer_class(**model, optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, exmp_input=x[:1],
                            **quiet(tmp_path))
    trainer.train_model(*_loaders(), num_epochs=1)
    loaded = trainer_class.load_from_checkpoint(trainer.log_dir, exmp_input=x[:1])
    assert _equal(loaded.state.params, trainer.state.params)


def test_an_own_best_rule_next_to_a_checkpoint_monitor_is_refused(tmp_path):
    class LatestIsBest(RegressTrainer):
        def is_new_model_better(self, new_metrics, old_metrics):
            return True

    x, _ = linear_data(8)
    with pytest.raises(ValueError, match="LatestIsBest.is_new_model_better picks the best model.*Drop the callback's monitor"):
        LatestIsBest(model_class=TinyMLP, model_hparams={}, optimizer_hparams={"optimizer": "adam", "lr": 1e-2},
                     exmp_input=x[:1], callbacks=[flaxlight.callbacks.ModelCheckpoint(monitor="val/loss")],
                     **quiet(tmp_path))


def test_an_own_rule_that_agrees_with_the_trainers_monitor_and_a_rule_never_asked_are_accepted(tmp_path):
    class Announcing(RegressTrainer):
        def is_new_model_better(self, new_metrics, old_metrics):
            return super().is_new_model_better(new_metrics, old_metrics)

    class Unused:
        def is_new_model_better(self, new_metrics, old_metrics):
            return True

    class MixedIn(RegressTrainer, Unused):  # the trainer's own rule comes first: the mixin's is never asked
        pass

    x, _ = linear_data(8)
    for trainer_class, monitor in ((Announcing, {"monitor": "val/loss", "mode": "min"}), (MixedIn, {})):
        trainer_class(model_class=TinyMLP, model_hparams={}, optimizer_hparams={"optimizer": "adam", "lr": 1e-2},
                      exmp_input=x[:1], callbacks=[flaxlight.callbacks.ModelCheckpoint(monitor="val/loss")],
                      **quiet(tmp_path / trainer_class.__name__, **monitor))


class Counting(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        seen = self.variable("counters", "seen", lambda: jnp.zeros((), jnp.int32))
        if train and not self.is_initializing():
            seen.value += x.shape[0]
        return nn.Dense(1)(x)


def test_a_linen_collection_flaxlight_does_not_keep_is_named_with_the_fix(tmp_path):
    x, _ = linear_data(8)
    trainer = RegressTrainer(model_class=Counting, model_hparams={}, optimizer_hparams={"optimizer": "adam", "lr": 1e-2},
                             exmp_input=x[:1], **quiet(tmp_path))
    with pytest.raises(ValueError, match="reads the variable collection 'counters'.*self.variable\\('batch_stats', 'seen'"):
        trainer.train_model(*_loaders(), num_epochs=1)
