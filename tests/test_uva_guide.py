"""Code written as the UvA "Research Projects with JAX" guide writes its TrainerModule, run on flaxlight.

The guide's overrides are seams flaxlight keeps: ``save_model(step)`` / ``load_model()`` of the
user's own format (called at each new best model; the best is what gets tested and loaded), its
flax ``TrainState`` from ``init_optimizer``, ``debug=True`` steps that read values, an
``exmp_input`` that is a whole ``(imgs, labels)`` batch, and ``logger_params['logger_name']``.
An error of a ``load_model`` override is the user's, never a damaged checkpoint.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import pickle
import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import RegressTrainer, SigtermAt, TinyMLP, linear_data, quiet
from flax.training import train_state

import flaxlight

X0 = np.zeros((1, 4), np.float32)


def _kwargs(tmp_path, **kwargs):
    kwargs.setdefault("model_hparams", {"hidden_dims": [16], "output_dim": 1})
    kwargs.setdefault("optimizer_hparams", {"optimizer": "adam", "lr": 3e-2})
    kwargs.setdefault("exmp_input", X0)
    kwargs.setdefault("logger_params", {"log_dir": str(tmp_path / "run"), "logger_type": "csv"})
    return dict(model_class=TinyMLP, **quiet(tmp_path, **kwargs))


def _steps(log_dir):
    folder = os.path.join(log_dir, "checkpoints")
    return sorted(int(n) for n in os.listdir(folder) if n.isdigit()) if os.path.isdir(folder) else []


def _files(folder):
    """Every file under ``folder`` with its modification time: what a deletion or rewrite changes."""
    return {os.path.join(root, name): os.stat(os.path.join(root, name)).st_mtime_ns
            for root, _, names in os.walk(folder) for name in names}


class FirstIsBest(RegressTrainer):
    """The guide's custom rule, here one whose best model is the first validation's (not the last)."""

    def is_new_model_better(self, new_metrics, old_metrics):
        return old_metrics is None

    def on_validation_epoch_end(self, epoch_idx, eval_metrics, val_loader):  # each epoch's model, tested
        self.__dict__.setdefault("tested", {})[epoch_idx] = self.eval_model(self.test_data, log_prefix="test/")


class GuideSaving(FirstIsBest):
    """The guide's pair: one file, overwritten at each new best; ``load_model(self)`` takes no step."""

    def save_model(self, step=0):
        self.__dict__.setdefault("saved", []).append(step)
        with open(os.path.join(self.log_dir, "best.pkl"), "wb") as f:
            pickle.dump({"step": step, "params": jax.device_get(self.state.params)}, f)

    def load_model(self):
        self.__dict__.setdefault("loads", 0)
        self.loads += 1
        with open(os.path.join(self.log_dir, "best.pkl"), "rb") as f:
            self.state = self.state.replace(params=pickle.load(f)["params"])


def _train_guide(tmp_path, regression_loaders, cls=GuideSaving, epochs=3, **kwargs):
    train, val, test = regression_loaders
    cls.test_data = test
    trainer = cls(**_kwargs(tmp_path, **kwargs))
    return trainer, trainer.train_model(train, val, test_loader=test, num_epochs=epochs)


# ---------------------------------------------------------------------- 1. save_model / load_model of the user's
def test_the_guides_save_and_load_pair_tests_the_best_model(tmp_path, regression_loaders):
    trainer, metrics = _train_guide(tmp_path, regression_loaders)
    assert trainer.own_checkpoints
    assert trainer.saved == [8]  # at the new best only: no "last" save overwrote the guide's one file
    with open(os.path.join(trainer.log_dir, "best.pkl"), "rb") as f:
        assert pickle.load(f)["step"] == 8
    assert trainer.loads == 1  # the test restored the best through the user's load_model()
    best, last = trainer.tested[1]["test/loss"], trainer.tested[3]["test/loss"]
    assert best != pytest.approx(last)
    assert metrics["test/loss"] == pytest.approx(best)  # the best model's test, beside the best's val metrics
    assert metrics["val/loss"] == pytest.approx(next(row for row in trainer.history if "val/loss" in row)["val/loss"])
    with open(os.path.join(trainer.log_dir, "metrics", "test.json")) as f:
        assert json.load(f)["test/loss"] == pytest.approx(best)
    assert _steps(trainer.log_dir) == []  # flaxlight wrote no checkpoint of its own beside the user's
    # load_model() restored the best for the test only: the trainer is the model as training left it
    test = regression_loaders[2]
    assert trainer.eval_model(test, log_prefix="test/")["test/loss"] == pytest.approx(last)
    assert int(trainer.state.step) == trainer.global_step == 24


def test_load_from_checkpoint_restores_the_guides_best_through_its_load_model(tmp_path, regression_loaders):
    trainer, metrics = _train_guide(tmp_path, regression_loaders)
    loaded = GuideSaving.load_from_checkpoint(trainer.log_dir, exmp_input=X0)
    assert loaded.loads == 1
    test = regression_loaders[2]
    assert loaded.eval_model(test, log_prefix="test/")["test/loss"] == pytest.approx(metrics["test/loss"])
    with pytest.raises(ValueError, match=r"checkpoints of its own.*which='last' has no checkpoint"):
        GuideSaving.load_from_checkpoint(trainer.log_dir, exmp_input=X0, which="last")


def test_predict_which_best_restores_the_guides_best_for_the_call_only(tmp_path, regression_loaders):
    trainer, _ = _train_guide(tmp_path, regression_loaders)
    trainer.state = trainer.state.replace(params=jax.tree.map(jnp.zeros_like, trainer.state.params))
    x = linear_data(8, 3)[0]
    best = trainer.predict(x, batch_size=8, which="best")
    assert np.abs(best).sum() > 0 and np.all(trainer.predict(x, batch_size=8) == 0)  # self.state left as it was
    with pytest.raises(ValueError, match="no 'last' checkpoint"):
        trainer.predict(x, batch_size=8, which="last")


def test_an_own_save_model_without_load_model_is_refused_before_training(tmp_path, regression_loaders):
    class SavesOnly(FirstIsBest):
        def save_model(self, step=0):
            pass

    train, val, test = regression_loaders
    SavesOnly.test_data = test
    trainer = SavesOnly(**_kwargs(tmp_path))
    with pytest.raises(TypeError, match=r"SavesOnly.save_model writes checkpoints of its own.*override "
                                        r"load_model\(self\) too"):
        trainer.train_model(train, val, test_loader=test, num_epochs=2)
    assert trainer.global_step == 0  # refused before the first step
    trainer.train_model(train, val, num_epochs=1)  # without a test, nothing needs its checkpoints read
    with pytest.raises(FileNotFoundError, match=r"SavesOnly.save_model writes checkpoints of its own.*Override "
                                                r"load_model\(self\)"):
        SavesOnly.load_from_checkpoint(trainer.log_dir, exmp_input=X0)


def test_an_interrupt_does_not_overwrite_the_guides_best_model(tmp_path, regression_loaders, caplog):
    train, val, test = regression_loaders
    GuideSaving.test_data = test
    trainer = GuideSaving(**_kwargs(tmp_path, callbacks=[SigtermAt(20)]))
    with caplog.at_level(logging.INFO, logger="flaxlight"), pytest.raises(SystemExit):
        trainer.train_model(train, val, num_epochs=4)
    assert trainer.saved == [8]  # the state at step 20 is not a new best: the guide's file keeps step 8's
    said = "\n".join(r.getMessage() for r in caplog.records)
    assert "No checkpoint of step 20 was saved: GuideSaving.save_model writes checkpoints of its own" in said


def test_a_save_model_calling_super_still_gets_every_save(tmp_path, regression_loaders):
    class Extends(FirstIsBest):
        def save_model(self, step=None):
            self.__dict__.setdefault("saved", []).append(step)
            super().save_model(step)

    trainer, metrics = _train_guide(tmp_path, regression_loaders, cls=Extends)
    assert not trainer.own_checkpoints
    assert trainer.saved[0] == 8 and trainer.saved[-1] == 24 and _steps(trainer.log_dir) == [8, 24]
    assert metrics["test/loss"] == pytest.approx(trainer.tested[1]["test/loss"])


def _counted(save_model):
    """A decorator without functools.wraps: the class's save_model is this wrapper."""
    def wrapper(self, step=None):
        self.__dict__.setdefault("saved", []).append(step)
        return save_model(self, step)
    return wrapper


def persist(trainer, step):  # a module-level helper that reaches flaxlight's save_model
    trainer.save_model_of_flaxlight(step)


class ThroughAHelper(FirstIsBest):
    def save_model(self, step=None):
        self.__dict__.setdefault("saved", []).append(step)
        self._really_save(step)

    def _really_save(self, step):
        super().save_model(step)


class ThroughADecorator(FirstIsBest):
    @_counted
    def save_model(self, step=None):
        super().save_model(step)


class ThroughAFunction(FirstIsBest):
    def save_model(self, step=None):
        self.__dict__.setdefault("saved", []).append(step)
        persist(self, step)

    def save_model_of_flaxlight(self, step):
        flaxlight.TrainerModule.save_model(self, step)


@pytest.mark.parametrize("cls", [ThroughAHelper, ThroughADecorator, ThroughAFunction],
                         ids=["helper-method", "decorator-without-wraps", "module-function"])
def test_a_save_model_reaching_super_indirectly_is_not_taken_for_an_own_format(tmp_path, regression_loaders, cls):
    """Reading only the override's own code took these for the guide's own format: a test_loader was
    refused before training, and periodic and interrupt saves were skipped."""
    trainer, metrics = _train_guide(tmp_path, regression_loaders, cls=cls)
    assert not trainer.own_checkpoints
    assert trainer.saved[0] == 8 and trainer.saved[-1] == 24 and _steps(trainer.log_dir) == [8, 24]
    assert metrics["test/loss"] == pytest.approx(trainer.tested[1]["test/loss"])


# ---------------------------------------------------------------------- 5. errors of a load_model override
class SidecarLoad(RegressTrainer):
    """A save_model writing a sidecar file for best saves only, and a load_model that needs it."""

    def is_new_model_better(self, new_metrics, old_metrics):
        return old_metrics is None

    def save_model(self, step=None):
        super().save_model(step)
        if self.is_best_validation:
            open(os.path.join(self.log_dir, f"extra_{step}.txt"), "w").close()

    def load_model(self, step=None):
        super().load_model(step)
        open(os.path.join(self.log_dir, f"extra_{int(self.state.step)}.txt")).close()  # none for step 32


def test_an_error_of_load_model_on_resume_is_the_users_and_deletes_nothing(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    SidecarLoad(**_kwargs(tmp_path)).train_model(train, val, num_epochs=4)
    run = str(tmp_path / "run")
    assert _steps(run) == [8, 32]
    before = _files(os.path.join(run, "checkpoints"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "damaged or partial" fallback warning
        warnings.filterwarnings("ignore", message="Resuming with a train_loader")
        with pytest.raises(FileNotFoundError, match="extra_32.txt") as raised:
            SidecarLoad(**_kwargs(tmp_path)).train_model(train, val, num_epochs=6, resume=True)
    note = "\n".join(getattr(raised.value, "__notes__", []))
    assert "Raised by SidecarLoad.load_model (your code)" in note and "checkpoint 32" in note
    assert "nothing on disk was deleted or moved" in note
    assert _steps(run) == [8, 32] and _files(os.path.join(run, "checkpoints")) == before


def test_an_error_of_load_model_in_load_from_checkpoint_is_not_called_damage(tmp_path, regression_loaders):
    train, val, _ = regression_loaders

    class Broken(RegressTrainer):
        def load_model(self, step=None):
            raise KeyError("my_extra_state")

    Broken(**_kwargs(tmp_path)).train_model(train, val, num_epochs=2)
    run = str(tmp_path / "run")
    before = _files(os.path.join(run, "checkpoints"))
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        with pytest.raises(KeyError, match="my_extra_state") as raised:
            Broken.load_from_checkpoint(run, exmp_input=X0)
    assert "Raised by Broken.load_model (your code)" in "\n".join(raised.value.__notes__)
    assert _files(os.path.join(run, "checkpoints")) == before


class NoStep(FirstIsBest):
    """The guide's signature, extending flaxlight's: ``load_model(self)``."""

    def load_model(self):
        self.__dict__.setdefault("loads", 0)
        self.loads += 1
        super().load_model()


def test_the_guides_load_model_without_a_step(tmp_path, regression_loaders):
    trainer, metrics = _train_guide(tmp_path, regression_loaders, cls=NoStep)  # best: step 8, last: 24
    assert trainer.loads == 1 and metrics["test/loss"] == pytest.approx(trainer.tested[1]["test/loss"])
    loaded = NoStep.load_from_checkpoint(trainer.log_dir, exmp_input=X0)  # the best: what load_model() restores
    assert loaded.loads == 1 and loaded.global_step == 8
    run = trainer.log_dir
    before = _files(os.path.join(run, "checkpoints"))
    train, val, _ = regression_loaders
    with pytest.raises(TypeError, match=r"NoStep.load_model\(self\) takes no step .* a resume needs checkpoint 24. "
                                        r"Give it one.*def load_model\(self, step=None\)"):
        NoStep(**_kwargs(tmp_path)).train_model(train, val, num_epochs=4, resume=True)
    assert _files(os.path.join(run, "checkpoints")) == before


def test_a_load_model_with_a_required_step_gets_one_for_the_test(tmp_path, regression_loaders):
    class Required(FirstIsBest):
        def load_model(self, step):
            self.__dict__.setdefault("loaded", []).append(step)
            super().load_model(step)

    trainer, metrics = _train_guide(tmp_path, regression_loaders, cls=Required)
    assert trainer.loaded == [None]  # None: the best, as flaxlight's load_model takes it
    assert metrics["test/loss"] == pytest.approx(trainer.tested[1]["test/loss"])


# ---------------------------------------------------------------------- 2. the guide's flax TrainState
class GuideTrainState(train_state.TrainState):  # the guide's module-level TrainState
    batch_stats: Any = None
    rng: Any = None


class GuideOptimizer(RegressTrainer):
    state_class = GuideTrainState

    def init_optimizer(self, num_epochs, num_steps_per_epoch):
        schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-2, 2, num_epochs * num_steps_per_epoch, 3e-4)
        self.state = self.state_class.create(apply_fn=self.state.apply_fn, params=self.state.params,
                                             batch_stats=self.state.batch_stats, tx=optax.adam(schedule),
                                             rng=self.state.rng)


def test_the_guides_train_state_from_init_optimizer_is_taken_in(tmp_path, regression_loaders, caplog):
    train, val, test = regression_loaders
    trainer = GuideOptimizer(**_kwargs(tmp_path))
    with caplog.at_level(logging.INFO, logger="flaxlight"):
        metrics = trainer.train_model(train, val, test_loader=test, num_epochs=3)
    assert isinstance(trainer.state, flaxlight.TrainState) and int(trainer.state.epoch) == 3
    assert trainer.global_step == 24 and metrics["train/loss"] < 1.0
    said = [r.getMessage() for r in caplog.records if "a Flax TrainState" in r.getMessage()]
    assert len(said) == 1 and "GuideOptimizer.init_optimizer" in said[0] and "flaxlight.TrainState" in said[0]


def test_a_train_state_with_fields_flaxlight_lacks_is_refused_before_training(tmp_path, regression_loaders):
    class WithEma(GuideTrainState):
        ema: Any = None

    class EmaOptimizer(GuideOptimizer):
        state_class = WithEma

    train, val, _ = regression_loaders
    trainer = EmaOptimizer(**_kwargs(tmp_path))
    with pytest.raises(TypeError, match=r"EmaOptimizer.init_optimizer set self.state to a .*WithEma.*fields "
                                        r"\['ema'\].*flaxlight.TrainState.create\(.*subclass it"):
        trainer.train_model(train, val, num_epochs=2)
    assert trainer.global_step == 0 and _steps(trainer.log_dir) == []


class GuideFlaxLoad(GuideSaving):
    """The guide's ``load_model`` as written there: it builds the guide's flax ``TrainState``."""

    def load_model(self):
        with open(os.path.join(self.log_dir, "best.pkl"), "rb") as f:
            saved = pickle.load(f)
        self.state = GuideTrainState.create(apply_fn=self.model.apply, params=saved["params"],
                                            batch_stats=self.state.batch_stats,
                                            tx=self.state.tx if self.state.tx else optax.sgd(0.1), rng=self.state.rng)


class PredictsAtTest(flaxlight.Callback):
    """Uses the tested model as a callback may: ``predict`` and ``bind_model`` in ``on_test_end``."""

    def on_test_end(self, trainer, metrics):
        x = linear_data(8, 3)[0]
        self.seen = trainer.predict(x, batch_size=8), trainer.bind_model()(x, train=False)


def _best_outputs(trainer, x):
    """What the best model the guide's save_model wrote computes on ``x``."""
    with open(os.path.join(trainer.log_dir, "best.pkl"), "rb") as f:
        params = pickle.load(f)["params"]
    return np.asarray(TinyMLP(hidden_dims=[16], output_dim=1).apply({"params": params}, x))


def test_the_guides_load_model_building_a_flax_state_serves_bind_model_and_predict(tmp_path, regression_loaders,
                                                                                   caplog):
    """bind_model() and predict() failed with AttributeError ('no attribute variables' / 'apply_model')
    after the guide's load_model, on each path that calls it."""
    x = linear_data(8, 3)[0]
    callback = PredictsAtTest()
    with caplog.at_level(logging.INFO, logger="flaxlight"):
        trainer, _ = _train_guide(tmp_path, regression_loaders, cls=GuideFlaxLoad, callbacks=[callback])
    best = _best_outputs(trainer, x)
    assert best.shape == (8, 1) and not np.allclose(best, trainer.predict(x, batch_size=8))  # the last is another
    for served in callback.seen:  # the test (through load_model) served the best model to on_test_end
        np.testing.assert_allclose(served, best, rtol=1e-6, atol=1e-6)
    assert isinstance(trainer.state, flaxlight.TrainState)  # put back after the test
    said = [r.getMessage() for r in caplog.records if "a Flax TrainState" in r.getMessage()]
    assert len(said) == 1 and "GuideFlaxLoad.load_model set self.state" in said[0]

    trainer.load_model()  # by hand, as the guide's notebooks do before bind_model()
    assert isinstance(trainer.state, flaxlight.TrainState) and int(trainer.state.epoch) == 3
    np.testing.assert_allclose(trainer.bind_model()(x, train=False), best, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(trainer.predict(x, batch_size=8), best, rtol=1e-6, atol=1e-6)

    loaded = GuideFlaxLoad.load_from_checkpoint(trainer.log_dir, exmp_input=X0)
    assert isinstance(loaded.state, flaxlight.TrainState)
    np.testing.assert_allclose(loaded.bind_model()(x, train=False), best, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(loaded.predict(x, batch_size=8), best, rtol=1e-6, atol=1e-6)
    test = regression_loaders[2]
    assert loaded.test(test)["test/loss"] == pytest.approx(trainer.tested[1]["test/loss"])


def test_a_load_model_override_keeps_its_name_and_signature(tmp_path):
    """flaxlight reads the override's signature (a step or none) and tells it from its own by its module."""
    assert GuideFlaxLoad.load_model.__name__ == "load_model" and GuideFlaxLoad.load_model.__module__ == __name__
    assert list(inspect.signature(GuideFlaxLoad.load_model).parameters) == ["self"]
    assert flaxlight.TrainerModule.load_model.__module__ == "flaxlight.trainer"  # flaxlight's own: not wrapped


@pytest.mark.parametrize("dropout_prob", [0.0, 0.5], ids=["no-dropout", "dropout-at-init"])
def test_the_guides_run_model_init_gives_the_guides_initial_weights(tmp_path, dropout_prob):
    """The guide's init_model + run_model_init: ``model.init(init_rng, *exmp_input, train=True)`` with
    ``model_rng, init_rng = random.split(PRNGKey(seed))``. flaxlight's default splits init_rng once
    more (docs/from-uva.md); the guide's one-line run_model_init gives the guide's weights."""
    hparams = {"hidden_dims": [16], "output_dim": 1, "dropout_prob": dropout_prob}

    class GuideInit(RegressTrainer):
        def run_model_init(self, exmp_input, init_rng):
            rngs = init_rng if not dropout_prob else {"params": init_rng, "dropout": init_rng}  # draws at init
            return self.model.init(rngs, *exmp_input, train=True)

    trainer = GuideInit(**_kwargs(tmp_path, seed=7, model_hparams=hparams))
    model_rng, init_rng = jax.random.split(jax.random.PRNGKey(7))
    rngs = init_rng if not dropout_prob else {"params": init_rng, "dropout": jax.random.PRNGKey(99)}
    guide = TinyMLP(**hparams).init(rngs, X0, train=True)["params"]  # the dropout key has no say in the params
    jax.tree.map(np.testing.assert_array_equal, trainer.state.params, guide)
    np.testing.assert_array_equal(trainer.state.rng, model_rng)


class GuideSteps(flaxlight.TrainerModule):
    """The guide's ``create_functions``: step functions of its own, no :class:`flaxlight.TrainStep`."""

    def create_functions(self):
        def mse(params, batch):
            x, y = batch
            return ((self.model.apply({"params": params}, x) - y) ** 2).mean()

        def train_step(state, batch):
            loss, grads = jax.value_and_grad(mse)(state.params, batch)
            return state.apply_gradients(grads=grads), {"loss": loss}

        def eval_step(state, batch):
            return {"loss": mse(state.params, batch)}

        return train_step, eval_step


def test_l2_weight_decay_with_the_guides_own_step_is_said_to_apply_no_decay(tmp_path, regression_loaders, caplog):
    """weight_decay_mode='l2' is a penalty flaxlight's step adds: a step of the user's own gets none,
    and the warning says that no decay is applied (it only said what to pass) and where the guide's is."""
    train, val, _ = regression_loaders

    def params_after(name, **decay):
        hparams = {"optimizer": "sgd", "lr": 0.05, "momentum": 0.9, **decay}
        logger_params = {"log_dir": str(tmp_path / name), "logger_type": "csv"}
        trainer = GuideSteps(**_kwargs(tmp_path, optimizer_hparams=hparams, logger_params=logger_params))
        trainer.train_model(train, val, num_epochs=2)
        return trainer.state.params

    with caplog.at_level(logging.WARNING, logger="flaxlight"):
        l2 = params_after("l2", weight_decay=0.5, weight_decay_mode="l2")
    said = [r.getMessage() for r in caplog.records if "weight_decay_mode='l2'" in r.getMessage()]
    assert len(said) == 1 and "GuideSteps.create_functions() builds its own step" in said[0]
    assert "no weight decay is applied" in said[0] and "docs/from-uva.md" in said[0]
    jax.tree.map(np.testing.assert_array_equal, l2, params_after("none", weight_decay=0.0))  # as it says
    decoupled = params_after("decoupled", weight_decay=0.5)  # the optimizer's decay: whatever the step
    assert not np.allclose(decoupled["Dense_0"]["kernel"], l2["Dense_0"]["kernel"])


# ---------------------------------------------------------------------- 3. debug=True: concrete values
@pytest.mark.parametrize("steps_per_execution", [1, 4])
def test_debug_steps_see_concrete_values(tmp_path, regression_loaders, steps_per_execution):
    """With steps_per_execution=4 the steps ran in a lax.scan even with debug=True: tracers again."""
    seen = []

    class Reading(RegressTrainer):
        def create_functions(self):
            train_step, eval_step = super().create_functions()

            def train(state, batch):
                state, metrics = train_step(state, batch)
                seen.append(float(metrics["loss"]))  # a concrete value: fails on a tracer
                return state, metrics

            def evaluate(state, batch):
                metrics = eval_step(state, batch)
                if not np.isfinite(metrics["loss"]):  # a Python branch on a value
                    breakpoint()
                seen.append(metrics["loss"].item())
                return metrics

            return train, evaluate

    train, val, _ = regression_loaders
    trainer = Reading(**_kwargs(tmp_path, debug=True, steps_per_execution=steps_per_execution))
    metrics = trainer.train_model(train, val, num_epochs=1)
    assert all(isinstance(value, float) for value in seen) and len(seen) >= 8 + 2
    assert np.isfinite(metrics["val/loss"])


# ---------------------------------------------------------------------- 4. exmp_input: a whole (imgs, labels) batch
class Classifier(nn.Module):
    @nn.compact
    def __call__(self, x, train=True):
        return nn.Dense(3)(nn.relu(nn.Dense(8)(x.reshape(x.shape[0], -1))))


def _digits(num=96, seed=0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(num, 2, 2, 1)).astype(np.float32), rng.integers(0, 3, num).astype(np.int32)


class WholeBatch(flaxlight.TrainerModule):
    """The guide's classifier: ``exmp_input=next(iter(train_loader))``, unpacked in run_model_init."""

    def run_model_init(self, exmp_input, init_rng):
        imgs, _ = exmp_input
        return self.model.init({"params": init_rng}, x=imgs, train=True)

    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        logits, updates = state.apply_model(params, x, train=train, rng=rng)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), ({}, updates)


def _whole_batch_trainer(tmp_path, cls=WholeBatch):
    x, y = _digits()
    loader = flaxlight.ArrayLoader(x, y, batch_size=32)
    trainer = cls(**quiet(tmp_path, model_class=Classifier, model_hparams={}, exmp_input=list(next(iter(loader))),
                          optimizer_hparams={"optimizer": "adam", "lr": 1e-2}))
    trainer.train_model(loader, loader, num_epochs=1)
    return trainer, loader, x


def test_predict_and_export_feed_the_model_only_what_run_model_init_gave_it(tmp_path):
    trainer, loader, x = _whole_batch_trainer(tmp_path)
    from_loader = trainer.predict(loader)  # batches (x, y): the model gets x
    from_arrays = trainer.predict(x, batch_size=32)
    assert from_loader.shape == (96, 3) and np.allclose(from_loader, from_arrays)
    path = trainer.export(tmp_path / "export", which="current")
    exported = jax.export.deserialize(bytearray(open(path, "rb").read()))
    assert np.allclose(exported.call(x[:5]), from_arrays[:5], atol=1e-5)


def test_an_exmp_input_flaxlight_cannot_split_gets_an_error_naming_what_to_pass(tmp_path):
    class Reshaping(WholeBatch):  # the inputs the model got are not exmp_input's own arrays
        def run_model_init(self, exmp_input, init_rng):
            imgs, _ = exmp_input
            return self.model.init({"params": init_rng}, imgs.reshape(imgs.shape[0], -1), train=True)

    trainer, loader, x = _whole_batch_trainer(tmp_path, Reshaping)
    with pytest.raises(TypeError, match=r"exmp_input holds 2 elements.*If exmp_input is a whole batch with labels.*"
                                        r"exmp_input=batch\[:1\]") as raised:
        trainer.predict(x, batch_size=32)
    assert not str(raised.value).startswith("Give predict")
    with pytest.raises(TypeError) as raised:  # the model's own error, with what to pass
        trainer.predict(loader)
    assert "exmp_input=batch[:1]" in "\n".join(getattr(raised.value, "__notes__", []))


# ---------------------------------------------------------------------- 6. logger_params['logger_name']
def test_logger_name_is_the_guides_folder_between_the_model_and_the_versions(tmp_path):
    params = {"base_log_dir": str(tmp_path / "checkpoints"), "logger_name": "exp1", "logger_type": "csv"}
    first = RegressTrainer(**_kwargs(tmp_path, logger_params=params))
    second = RegressTrainer(**_kwargs(tmp_path, logger_params=params))
    assert first.log_dir == str(tmp_path / "checkpoints" / "TinyMLP" / "exp1" / "version_0")
    assert second.log_dir == str(tmp_path / "checkpoints" / "TinyMLP" / "exp1" / "version_1")
    named = RegressTrainer(**_kwargs(tmp_path, logger_params={**params, "log_dir": str(tmp_path / "mine")}))
    assert named.log_dir == str(tmp_path / "mine")  # as in the guide: a log_dir is the run's folder itself


class TwoInputs(nn.Module):
    @nn.compact
    def __call__(self, x, t, train: bool = False):
        return nn.Dense(1)(jnp.concatenate([x, t], -1))


class ConvertsAnInput(flaxlight.TrainerModule):
    """A run_model_init that converts the second input on the way (a new object of the same shape)."""

    def run_model_init(self, exmp_input, init_rng):
        x, t = exmp_input
        return self.model.init({"params": init_rng}, x, jnp.asarray(t, jnp.float32), train=True)

    def loss_fn(self, params, batch, *, train, rng, state):
        x, t, y = batch
        pred, updates = state.apply_model(params, x, t, train=train, rng=rng)
        return jnp.mean((pred - y) ** 2), ({}, updates)


def test_an_input_converted_in_run_model_init_is_still_an_input(tmp_path):
    """Matching by object first took only x for the model's input: predict fed one input to a model
    of two (``missing 1 required positional argument: 't'``)."""
    rng = np.random.default_rng(0)
    x, t = rng.normal(size=(64, 3)).astype(np.float32), rng.normal(size=(64, 1)).astype(np.float32)
    y = x.sum(-1, keepdims=True) + t
    trainer = ConvertsAnInput(**{**_kwargs(tmp_path, model_hparams={}, exmp_input=(x[:1], t[:1])),
                                 "model_class": TwoInputs})
    trainer.train_model(flaxlight.ArrayLoader(x, t, y, batch_size=16), num_epochs=1)
    assert trainer.predict(flaxlight.ArrayLoader(x, t, y, batch_size=16)).shape == (64, 1)


def test_a_load_model_restoring_its_optimizer_state_into_a_flax_state_keeps_it(tmp_path, regression_loaders):
    """Taking in a Flax TrainState that a load_model of yours set replaced its (restored) optimizer
    state with a fresh one while the step was kept (a review): a resume through it would differ."""
    train, val, _ = regression_loaders

    class RestoresOptimizer(RegressTrainer):
        def load_model(self, step=None):
            saved = self.saved_state
            self.state = GuideTrainState(step=saved.step, apply_fn=saved.apply_fn, params=saved.params,
                                         tx=saved.tx, opt_state=saved.opt_state, batch_stats=None, rng=saved.rng)

    trainer = RestoresOptimizer(**_kwargs(tmp_path))
    trainer.train_model(train, val, num_epochs=2)
    trainer.saved_state = trainer.state
    trainer.load_model()
    assert isinstance(trainer.state, flaxlight.TrainState)
    jax.tree.map(np.testing.assert_array_equal, trainer.state.opt_state, trainer.saved_state.opt_state)
    assert int(trainer.state.step) == int(trainer.saved_state.step)


    class SetsNone(RegressTrainer):  # something flaxlight cannot take in: left as it set it
        def load_model(self, step=None):
            self.state = None

    other = SetsNone(**_kwargs(tmp_path / "none"))
    other.load_model()
    assert other.state is None


def test_a_load_model_setting_a_flax_state_with_fields_of_its_own_is_refused_naming_load_model(tmp_path):
    """Kept without a word, it failed later in predict with AttributeError 'no attribute apply_model' (a review)."""
    class WithEma(GuideTrainState):
        ema: Any = None

    class EmaLoad(RegressTrainer):
        def load_model(self, step=None):
            self.state = WithEma.create(apply_fn=self.state.apply_fn, params=self.state.params, tx=optax.adam(1e-3),
                                        batch_stats=None, rng=self.state.rng, ema=self.state.params)

    trainer = EmaLoad(**_kwargs(tmp_path))
    with pytest.raises(TypeError, match=r"EmaLoad.load_model set self.state to a .*WithEma.*fields \['ema'\]"):
        trainer.load_model()
