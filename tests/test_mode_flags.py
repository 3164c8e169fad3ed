"""The model's training/eval switch: every common name of the mode argument is set (Linen and NNX),
one flaxlight cannot set is said out loud, and models with per-layer (stacked) dropout keys train."""

import logging

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ClassifyTrainer, quiet
from flax import nnx

from flaxlight import ArrayLoader


def _data():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(192, 6)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int32)
    return ArrayLoader(x[:128], y[:128], batch_size=32, shuffle=True, seed=1), ArrayLoader(x[128:], y[128:],
                                                                                           batch_size=32), x


def _trainer(model_class, tmp_path, **kwargs):
    return ClassifyTrainer(model_class=model_class, model_hparams={}, exmp_input=np.zeros((1, 6), np.float32),
                           optimizer_hparams={"optimizer": "adam", "lr": 1e-2, "schedule": "constant"},
                           **quiet(tmp_path, **kwargs))


# --- Linen and NNX models whose mode argument is not named `train` (they trained in eval mode) ----

class LinenTraining(nn.Module):  # Keras' name
    @nn.compact
    def __call__(self, x, training: bool = False):
        x = nn.BatchNorm(use_running_average=not training, momentum=0.9)(nn.relu(nn.Dense(16)(x)))
        return nn.Dense(2)(nn.Dropout(0.5, deterministic=not training)(x))


class LinenDeterministic(nn.Module):  # Flax's own layers' name (the inverse)
    @nn.compact
    def __call__(self, x, deterministic: bool = True):
        x = nn.BatchNorm(use_running_average=deterministic, momentum=0.9)(nn.relu(nn.Dense(16)(x)))
        return nn.Dense(2)(nn.Dropout(0.5, deterministic=deterministic)(x))


class LinenRequiredTraining(nn.Module):  # the Flax "Linen to NNX" guide's: a required positional flag
    @nn.compact
    def __call__(self, x, training: bool):
        x = nn.BatchNorm(use_running_average=not training, momentum=0.9)(nn.relu(nn.Dense(16)(x)))
        return nn.Dense(2)(nn.Dropout(0.5, deterministic=not training)(x))


class NNXTraining(nnx.Module):  # an NNX module handing a Keras-style flag to its layers
    def __init__(self, *, rngs: nnx.Rngs):
        self.linear, self.norm = nnx.Linear(6, 16, rngs=rngs), nnx.BatchNorm(16, momentum=0.9, rngs=rngs)
        self.drop, self.head = nnx.Dropout(0.5, rngs=rngs), nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x, training: bool = False):
        x = self.norm(nnx.relu(self.linear(x)), use_running_average=not training)
        return self.head(self.drop(x, deterministic=not training))


@pytest.mark.parametrize("model_class", [LinenTraining, LinenDeterministic, LinenRequiredTraining, NNXTraining])
def test_a_mode_argument_named_training_or_deterministic_is_set(model_class, tmp_path, caplog):
    train, val, x = _data()
    trainer = _trainer(model_class, tmp_path)
    initial_stats = jax.device_get(trainer.state.batch_stats)
    with caplog.at_level(logging.WARNING, logger="flaxlight"):
        trainer.train_model(train, val, num_epochs=1)
    assert not [r for r in caplog.records if "unchanged" in r.getMessage()]  # the statistics move: no warning
    state = trainer.state
    moved = [not np.allclose(a, b) for a, b in zip(jax.tree.leaves(initial_stats), jax.tree.leaves(state.batch_stats))]
    assert all(moved)  # BatchNorm statistics updated by training (they stayed at mean 0 / var 1)

    first, _ = state.apply_model(state.params, x[:32], train=True, rng=jax.random.PRNGKey(1))
    second, _ = state.apply_model(state.params, x[:32], train=True, rng=jax.random.PRNGKey(2))
    evaluated, updates = state.apply_model(state.params, x[:32], train=False)
    assert not np.allclose(first, second)  # dropout in training: another key, another mask
    assert not np.allclose(first, evaluated) and updates == {}
    predicted = trainer.predict(x[:32], batch_size=8)
    np.testing.assert_allclose(predicted, trainer.predict(x[:32], batch_size=32), atol=1e-5)  # running statistics
    np.testing.assert_allclose(predicted, evaluated, atol=1e-5)  # eval mode: deterministic


def test_a_mode_argument_flaxlight_cannot_set_is_warned_about_or_refused(tmp_path):
    class LinenIsTraining(nn.Module):
        @nn.compact
        def __call__(self, x, is_training: bool = False):
            return nn.Dense(2)(nn.Dropout(0.5, deterministic=not is_training)(nn.Dense(8)(x)))

    class NNXIsTraining(nnx.Module):
        def __init__(self, *, rngs: nnx.Rngs):
            self.linear, self.drop = nnx.Linear(6, 2, rngs=rngs), nnx.Dropout(0.5, rngs=rngs)

        def __call__(self, x, is_training: bool = False):
            return self.drop(self.linear(x), deterministic=not is_training)

    class NNXNeedsIsTraining(NNXIsTraining):
        def __call__(self, x, is_training: bool):
            return self.drop(self.linear(x), deterministic=not is_training)

    for model_class in (LinenIsTraining, NNXIsTraining):
        with pytest.warns(UserWarning, match=rf"{model_class.__name__}.__call__ takes `is_training`, which "
                                             r"flaxlight does not set.*Rename `is_training` to `train`.*keeps its "
                                             r"default \(False\)"):
            _trainer(model_class, tmp_path / model_class.__name__)
    with pytest.raises(TypeError, match=r"takes `is_training`, which flaxlight does not set.*Rename `is_training` to "
                                        r"`train`.*no default"):
        _trainer(NNXNeedsIsTraining, tmp_path / "required")


class LinenFrozenNorm(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(2)(nn.BatchNorm(use_running_average=True)(nn.Dense(8)(x)))


class LinenOwnFlagNorm(nn.Module):  # the flag is one flaxlight does not pass: BatchNorm always in eval mode
    @nn.compact
    def __call__(self, x, in_training: bool = False):
        return nn.Dense(2)(nn.BatchNorm(use_running_average=not in_training)(nn.Dense(8)(x)))


class NNXOwnFlagNorm(nnx.Module):  # the flag is one flaxlight does not pass: BatchNorm always in eval mode
    def __init__(self, *, rngs: nnx.Rngs):
        self.linear, self.norm, self.head = nnx.Linear(6, 8, rngs=rngs), nnx.BatchNorm(8, rngs=rngs), nnx.Linear(
            8, 2, rngs=rngs)

    def __call__(self, x, in_training: bool = False):
        return self.head(self.norm(self.linear(x), use_running_average=not in_training))


@pytest.mark.parametrize("model_class", [LinenOwnFlagNorm, NNXOwnFlagNorm])
def test_batchnorm_statistics_left_unchanged_by_the_train_step_are_warned_about(model_class, tmp_path, caplog):
    train, val, _ = _data()
    trainer = _trainer(model_class, tmp_path)
    with caplog.at_level(logging.WARNING, logger="flaxlight"):
        trainer.train_model(train, val, num_epochs=2)
    warned = [r.getMessage() for r in caplog.records if "left every one of them unchanged" in r.getMessage()]
    assert len(warned) == 1, [r.getMessage() for r in caplog.records]
    assert "use_running_average=True in training" in warned[0]
    assert "BatchNorm(use_running_average=not train)" in warned[0]
    assert "no mode argument" in warned[0]


def test_batchnorm_frozen_in_a_model_handed_the_mode_is_not_warned_about(tmp_path, caplog):
    """A model that takes `train` and keeps its statistics frozen does so on purpose (fine-tuning):
    the review found it warned at every run."""
    train, val, _ = _data()
    with caplog.at_level(logging.WARNING, logger="flaxlight"):
        _trainer(LinenFrozenNorm, tmp_path).train_model(train, val, num_epochs=1)
    assert not [r for r in caplog.records if "left every one of them unchanged" in r.getMessage()]


# --- errors that name the fix -----------------------------------------------------------------

def test_a_linen_batchnorm_without_a_mode_argument_is_explained(tmp_path):
    class NormNoFlag(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(2)(nn.BatchNorm()(nn.Dense(8)(x)))

    class NormNotHandedTheFlag(nn.Module):
        @nn.compact
        def __call__(self, x, training: bool = False):
            return nn.Dense(2)(nn.BatchNorm()(nn.Dense(8)(x)))

    with pytest.raises(TypeError, match=r"NormNoFlag uses BatchNorm but its __call__ takes no `train` argument.*"
                                        r"add `train: bool = False` and use nn.BatchNorm\(use_running_average=not "
                                        r"train\)"):
        _trainer(NormNoFlag, tmp_path / "a")
    with pytest.raises(TypeError, match=r"NormNotHandedTheFlag uses BatchNorm without handing it the mode: flaxlight "
                                        r"passes `training`.*nn.BatchNorm\(use_running_average=not training\)"):
        _trainer(NormNotHandedTheFlag, tmp_path / "b")


class NNXKeylessDropout(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.linear, self.drop = nnx.Linear(6, 2, rngs=rngs), nnx.Dropout(0.5)  # no rngs

    def __call__(self, x):
        return self.drop(self.linear(x))


class NNXKeylessDropoutWithStreams(NNXKeylessDropout):  # keeps rngs, but never hands them to the Dropout
    def __init__(self, *, rngs: nnx.Rngs):
        super().__init__(rngs=rngs)
        self.rngs = rngs


def test_an_nnx_dropout_built_without_rngs_is_explained_when_the_trainer_is_built(tmp_path):
    with pytest.raises(TypeError, match=r"NNXKeylessDropout's nnx.Dropout at 'drop' was built without rngs.*"
                                        r"`nnx.Dropout\(rate, rngs=rngs\)`.*`rngs: nnx.Rngs \| None = None`"):
        _trainer(NNXKeylessDropout, tmp_path)


def test_an_nnx_dropout_built_without_rngs_is_explained_at_the_first_step(tmp_path):
    train, val, _ = _data()
    trainer = _trainer(NNXKeylessDropoutWithStreams, tmp_path)  # it might hand them on: known at the first step
    with pytest.raises(ValueError, match=r"NNXKeylessDropoutWithStreams's nnx.Dropout at 'drop' was built without "
                                         r"rngs.*`nnx.Dropout\(rate, rngs=rngs\)`"):
        trainer.train_model(train, val, num_epochs=1)


# --- NNX stacked layers: a key per layer (split_rngs + vmap to build, scan to run) ---------------

class Block(nnx.Module):
    def __init__(self, dim: int, *, rngs: nnx.Rngs):
        self.linear = nnx.Linear(dim, dim, rngs=rngs)
        self.norm = nnx.BatchNorm(dim, momentum=0.9, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)

    def __call__(self, x):
        return x + self.drop(nnx.relu(self.norm(self.linear(x))))


class StackedNNX(nnx.Module):
    """Flax's "scan over layers": blocks built with a key each, run with nnx.scan."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.inp = nnx.Linear(6, 8, rngs=rngs)

        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def create_block(rngs):
            return Block(8, rngs=rngs)

        self.blocks = create_block(rngs)
        self.head = nnx.Linear(8, 2, rngs=rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block):
            return block(x)

        return self.head(forward(self.inp(x), self.blocks))


def test_nnx_stacked_layers_with_dropout_train_evaluate_and_resume_bitwise(tmp_path):
    train, val, x = _data()

    def run(log_dir, num_epochs, resume=False):
        trainer = _trainer(StackedNNX, log_dir)
        before = trainer.eval_model(val, log_prefix="val/")  # it failed: the eval step reseeds too
        metrics = trainer.train_model(train, val, num_epochs=num_epochs, resume=resume)
        return trainer, before, metrics

    straight, before, metrics = run(tmp_path / "straight", 3)
    assert metrics["val/loss"] < before["val/loss"]
    assert straight.eval_model(val, log_prefix="val/") == straight.eval_model(val, log_prefix="val/")
    state = straight.state
    first, _ = state.apply_model(state.params, x[:16], train=True, rng=jax.random.PRNGKey(1))
    again, _ = state.apply_model(state.params, x[:16], train=True, rng=jax.random.PRNGKey(1))
    other, _ = state.apply_model(state.params, x[:16], train=True, rng=jax.random.PRNGKey(2))
    np.testing.assert_array_equal(first, again)  # the step's key decides the masks
    assert not np.allclose(first, other)
    np.testing.assert_array_equal(straight.predict(x[:16], batch_size=8), straight.predict(x[:16], batch_size=8))

    run(tmp_path / "resumed", 1)
    resumed, _, _ = run(tmp_path / "resumed", 3, resume=True)
    jax.tree.map(np.testing.assert_array_equal, jax.device_get((resumed.state.params, resumed.state.batch_stats)),
                 jax.device_get((state.params, state.batch_stats)))
    assert int(resumed.state.step) == int(state.step) == 3 * len(train)
    assert jnp.all(jnp.asarray(jax.tree.leaves(state.batch_stats)[0]) != 0)  # statistics moved


def test_an_nnx_flag_defaulting_to_none_follows_model_train_and_is_not_warned_about(tmp_path, caplog):
    """NNX's convention: a `use_running_average=None` argument falls back to the layer's attribute,
    which model.train() / model.eval() switch; the review found it warned about as never set."""
    class FollowsTrain(nnx.Module):
        def __init__(self, *, rngs: nnx.Rngs):
            self.linear, self.norm, self.head = nnx.Linear(6, 8, rngs=rngs), nnx.BatchNorm(8, rngs=rngs), nnx.Linear(
                8, 2, rngs=rngs)

        def __call__(self, x, use_running_average: bool | None = None):
            return self.head(self.norm(self.linear(x), use_running_average=use_running_average))

    train, val, _ = _data()
    with caplog.at_level(logging.WARNING, logger="flaxlight"):
        trainer = _trainer(FollowsTrain, tmp_path)
        before = jax.tree.map(np.asarray, trainer.state.batch_stats)
        trainer.train_model(train, val, num_epochs=1)
    assert not [r for r in caplog.records if "flaxlight does not set" in r.getMessage()
                or "left every one of them unchanged" in r.getMessage()]
    assert not np.allclose(jax.tree.leaves(before)[0], np.asarray(jax.tree.leaves(trainer.state.batch_stats)[0]))


class SplitAgainInCall(StackedNNX):
    """flax 0.10's scan over layers: split_rngs on the scan too, which flax >= 0.11 refuses itself."""

    def __call__(self, x):
        @nnx.split_rngs(splits=3)
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
        def forward(x, block):
            return block(x)

        return self.head(forward(self.inp(x), self.blocks))


def test_stacked_layers_split_again_in_call_say_to_remove_that_split(tmp_path):
    """It was flax's bare "fold_in accepts a single key, but was given a key array of shape (3,)",
    with flaxlight's note that the model does not fit exmp_input ("If it is about a shape ...")."""
    with pytest.raises(ValueError, match=r"SplitAgainInCall drew a single key from an RNG stream that holds a key "
                                         r"per stacked layer .*Remove the `@nnx.split_rngs\(...\)` above the "
                                         r"`nnx.scan` in SplitAgainInCall.__call__") as info:
        _trainer(SplitAgainInCall, tmp_path)
    assert not [note for note in getattr(info.value, "__notes__", []) if "If it is about a shape" in note]
