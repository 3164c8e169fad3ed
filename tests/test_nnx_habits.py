"""What an NNX user's habits meet (the NNX trial's findings): a layer named ``value``, params set
from ``nnx.state(...)``, functions / dtypes / modules as model hparams, plain attributes changed
in ``__call__``, and an ``nnx.Rngs`` handed to the trainer. Linen where the same applies."""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from conftest import RegressTrainer, TinyNNX, linear_data, quiet
from flax import nnx

from flaxlight import optim
from flaxlight.models import ModelHparamsError, make_adapter
from flaxlight.optim import make_freeze_mask, make_weight_decay_mask

X0 = np.zeros((1, 4), np.float32)
ADAM = {"optimizer": "adam", "lr": 1e-2}


def _fit(trainer, epochs: int = 1, **kwargs):
    x, y = linear_data(64)
    return trainer.train_model((x, y), (x, y), num_epochs=epochs, batch_size=32, **kwargs)


# --------------------------------------------------------------------------- a layer named `value`
class ActorCriticNNX(nnx.Module):
    def __init__(self, din: int = 4, *, rngs: nnx.Rngs):
        self.trunk = nnx.Linear(din, 8, rngs=rngs)
        self.value = nnx.Linear(8, 1, rngs=rngs)   # a value head, as attention's value projection

    def __call__(self, x):
        return self.value(nnx.relu(self.trunk(x)))


class ActorCriticLinen(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(1, name="value")(nn.relu(nn.Dense(8, name="trunk")(x)))


@pytest.mark.parametrize("model_class", [ActorCriticNNX, ActorCriticLinen], ids=["nnx", "linen"])
def test_a_layer_named_value_is_frozen_by_its_name_and_by_a_wildcard(model_class, tmp_path, caplog):
    """``value`` path entries were dropped as if they were an nnx.Variable's wrapper: the layer
    could not be named, and ``*/kernel`` silently trained it."""
    optim._logged.clear()
    trainer = RegressTrainer(model_class=model_class, model_hparams={}, exmp_input=X0,
                             optimizer_hparams={**ADAM, "freeze": ["value"]}, **quiet(tmp_path))
    before = jax.device_get(trainer.state.params)
    with caplog.at_level(logging.INFO, logger="flaxlight"):
        _fit(trainer)
    after = jax.device_get(trainer.state.params)
    assert "2 of 4 parameter arrays stay fixed" in caplog.text and "value/bias, value/kernel" in caplog.text
    assert all(np.array_equal(before["value"][k], after["value"][k]) for k in ("kernel", "bias"))
    assert not np.array_equal(before["trunk"]["kernel"], after["trunk"]["kernel"])
    assert make_freeze_mask(["*/kernel"])(after) == {"trunk": {"kernel": True, "bias": False},
                                                     "value": {"kernel": True, "bias": False}}
    optim._logged.clear()


def test_a_parameter_named_value_and_an_nnx_states_wrapper_in_the_masks():
    gate = {"gate": {"value": np.ones(2), "kernel": np.ones((2, 2))}}   # a parameter of its own named `value`
    assert make_weight_decay_mask(["value"])(gate) == {"gate": {"kernel": True, "value": False}}
    state = nnx.state(ActorCriticNNX(rngs=nnx.Rngs(0)), nnx.Param)     # Variables: their `.value` is no layer
    masked = make_freeze_mask(["value/kernel"])(state)
    assert jax.tree.leaves(masked) == [False, False, False, True]      # trunk bias, kernel; value bias, kernel
    with pytest.raises(ValueError, match=r"this model's parameters are trunk/bias, trunk/kernel, value/bias, "
                                         r"value/kernel\. Did you mean 'value' for 'valeu'"):
        make_freeze_mask(["valeu"])(state)


# --------------------------------------------------------------------------- params from nnx.state(...)
def test_params_set_from_nnx_state_train_and_the_run_loads_and_resumes(tmp_path):
    """Kept as an nnx.State, every checkpoint had an extra `/value` level: 'saved from a different model'."""
    kwargs = dict(model_class=TinyNNX, model_hparams={"hidden_dims": [8], "batch_norm": True}, exmp_input=X0,
                  optimizer_hparams=ADAM, **quiet(tmp_path))
    pretrained = TinyNNX(hidden_dims=[8], batch_norm=True, rngs=nnx.Rngs(7))
    trainer = RegressTrainer(**kwargs)
    trainer.state = trainer.state.replace(params=nnx.state(pretrained, nnx.Param),
                                          batch_stats=nnx.state(pretrained, nnx.BatchStat))
    taken = trainer.state.with_optimizer(optax.sgd(0.1))                 # exactly the module's arrays, as a dict
    assert type(taken.params) is dict and jax.tree.all(jax.tree.map(
        np.array_equal, taken.params, nnx.to_pure_dict(nnx.state(pretrained, nnx.Param))))
    _fit(trainer)

    loaded = RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=X0, which="last")
    x, _ = linear_data(8)
    np.testing.assert_array_equal(loaded.predict(x, batch_size=8), trainer.predict(x, batch_size=8))
    resumed = RegressTrainer(**kwargs)
    _fit(resumed, epochs=2, resume=True)
    assert resumed.global_step == 4


# --------------------------------------------------------------------------- functions, dtypes, modules as hparams
class ActNNX(nnx.Module):
    def __init__(self, din: int = 4, act: Callable = nnx.relu, dtype: Any = jnp.float32, backbone: Any = None, *,
                 rngs: nnx.Rngs):
        self.dense, self.act = nnx.Linear(din, 8, dtype=dtype, rngs=rngs), act
        self.head = nnx.Linear(8, 1, dtype=dtype, rngs=rngs)

    def __call__(self, x):
        return self.head(self.act(self.dense(x))).astype(jnp.float32)


class ActLinen(nn.Module):
    act: Callable = nn.relu
    dtype: Any = jnp.float32
    backbone: Any = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(1, dtype=self.dtype)(self.act(nn.Dense(8, dtype=self.dtype)(x))).astype(jnp.float32)


@pytest.mark.parametrize("model_class,module", [(ActNNX, lambda: nnx.Linear(2, 2, rngs=nnx.Rngs(0))),
                                                (ActLinen, lambda: nn.Dense(2))], ids=["nnx", "linen"])
def test_a_dtype_comes_back_and_a_function_or_module_is_asked_for_again_by_name(model_class, module, tmp_path):
    """Written as strings without a word, they were handed back to the model at load: its own error
    ('str' object is not callable, data type not understood) with a note about shapes."""
    hparams = {"act": jax.nn.gelu, "dtype": jnp.bfloat16, "backbone": module()}
    trainer = RegressTrainer(model_class=model_class, model_hparams=hparams, exmp_input=X0, optimizer_hparams=ADAM,
                             **quiet(tmp_path))
    with pytest.warns(UserWarning, match=r"^hparams\.yaml: model_hparams act \(a function: 'jax\..*gelu'\), backbone "
                                         r"\(a module: '.*'\) are kept there as text only: a run's files are data, .*"
                                         r"load_from_checkpoint\(run, exmp_input=\.\.\., act=gelu, backbone=\.\.\.\)"):
        _fit(trainer)
    saved = yaml.safe_load((tmp_path / "run" / "hparams.yaml").read_text())
    assert saved["model_hparams"]["dtype"] == "bfloat16"
    assert saved["dtype_hparams"] == [{"path": ["model_hparams", "dtype"], "dtype": "bfloat16"}]
    assert [r["path"][1] for r in saved["by_name_hparams"]] == ["act", "backbone"]

    with pytest.raises(TypeError, match=r"^RegressTrainer\.load_from_checkpoint: the run's model_hparams act \(a "
                                        r"function: .*\), backbone \(a module: .*\) are kept in hparams\.yaml as text "
                                        r"only, .*Pass them again: RegressTrainer\.load_from_checkpoint\(.*, "
                                        r"exmp_input=\.\.\., act=gelu, backbone=\.\.\.\)\.$") as info:
        RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=X0)
    assert not getattr(info.value, "__notes__", None)   # not the note about shapes, which does not apply
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # given again: loads without a word (nor the "replaces the run's" line)
        loaded = RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=X0, act=jax.nn.gelu,
                                                     backbone=module())
    assert loaded.model_hparams["dtype"] == jnp.bfloat16 and isinstance(loaded.model_hparams["dtype"], np.dtype)
    x, _ = linear_data(8)
    np.testing.assert_array_equal(loaded.predict(x, batch_size=8), trainer.predict(x, batch_size=8, which="best"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # said at the run's first write only: not again when it is resumed
        again = RegressTrainer(model_class=model_class, model_hparams=hparams, exmp_input=X0, optimizer_hparams=ADAM,
                               **quiet(tmp_path))
        _fit(again, epochs=2, resume=True)


# --------------------------------------------------------------------------- plain attributes changed in __call__
class Counters(nnx.Module):
    def __init__(self, din: int = 4, *, rngs: nnx.Rngs):
        self.dense = nnx.Linear(din, 1, rngs=rngs)
        self.calls, self.total, self.seen = 0, jnp.zeros(()), []     # no nnx.Variable: not carried
        self.steps = nnx.Variable(jnp.zeros((), jnp.int32))            # carried, checkpointed

    def __call__(self, x, train: bool = False):
        if train:
            self.calls += 1
            self.total = self.total + 1
            self.seen.append(x.shape[0])
            self.steps[...] += 1   # flax 0.12 deprecates `.value` access
        return self.dense(x)


def test_plain_attributes_changed_in_call_are_warned_of_once_at_the_first_train_step(tmp_path, recwarn):
    """They stayed at their construction value without a word (nnx.jit keeps the change)."""
    trainer = RegressTrainer(model_class=Counters, model_hparams={}, exmp_input=X0, optimizer_hparams=ADAM,
                             **quiet(tmp_path))
    assert not [w for w in recwarn if "__call__ changes" in str(w.message)]   # eval mode: nothing changes yet
    _fit(trainer, epochs=2)
    said = [str(w.message) for w in recwarn if "__call__ changes" in str(w.message)]
    assert len(said) == 1 and said[0].startswith(
        "Counters.__call__ changes calls, seen, total: plain attribute(s), not nnx.Variable. flaxlight's steps ")
    assert "stays at its construction value" in said[0] and "class Count(nnx.Variable)" in said[0]
    assert "self.calls[...] += 1 in __call__" in said[0]   # not `.value`, which flax 0.12 deprecates
    where = [w for w in recwarn if "__call__ changes" in str(w.message)][0]
    assert (where.filename, where.lineno) == (__file__, Counters.__call__.__code__.co_firstlineno)  # not jax's line
    model = trainer.bind_model()
    assert (model.calls, float(model.total), int(model.steps[...])) == (0, 0.0, 4)   # as docs/models.md says


class ShapeCache(nnx.Module):
    """A size read from the input while tracing (harmless: every call sets it alike) and a counter (lost)."""

    def __init__(self, din: int = 4, count: bool = False, *, rngs: nnx.Rngs):
        self.dense = nnx.Linear(din, 1, rngs=rngs)
        self.features, self.count, self.calls = None, count, 0

    def __call__(self, x, train: bool = False):
        self.features = x.shape[-1]
        self.batch_shape = tuple(x.shape[:-1])   # set in __call__ only, the same way
        if self.count:
            self.calls += 1
        return self.dense(x)


def test_a_value_every_call_sets_alike_is_not_warned_of(tmp_path, recwarn):
    """`self.features = x.shape[-1]` was warned of, with advice (an nnx.Variable) that fits no Python int
    read at trace time; a counter next to it still is, alone."""
    for count in (False, True):
        trainer = RegressTrainer(model_class=ShapeCache, model_hparams={"count": count}, exmp_input=X0,
                                 optimizer_hparams=ADAM, **quiet(tmp_path / str(count)))
        _fit(trainer)
    said = [str(w.message) for w in recwarn if "__call__ changes" in str(w.message)]
    assert len(said) == 1 and said[0].startswith("ShapeCache.__call__ changes calls: plain attribute(s)")


class HoldsCounters(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs):
        self.inner = Counters(rngs=rngs)

    def __call__(self, x, train: bool = False):
        return self.inner(x, train=train)


def test_the_plain_attribute_warning_points_at_the_call_of_the_submodule_that_holds_it():
    adapter = make_adapter(HoldsCounters, {}, seed=0)
    variables = adapter.init(None, [X0])
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        jax.jit(lambda v, x: adapter.apply(v, x, train=True))(variables, X0)   # inside a trace, as a step is
    [warning] = [w for w in said if "__call__ changes" in str(w.message)]
    assert str(warning.message).startswith("HoldsCounters.__call__ changes inner/calls, inner/seen, inner/total")
    assert (warning.filename, warning.lineno) == (__file__, Counters.__call__.__code__.co_firstlineno)


# --------------------------------------------------------------------------- an nnx.Rngs handed to the trainer
def test_an_nnx_rngs_in_model_hparams_or_as_a_trainer_keyword_names_seed(tmp_path):
    fix = r"Pass the int as the trainer's seed= instead \(for nnx\.Rngs\(7\): seed=7, an int\), and leave rngs out\."
    with pytest.raises(ModelHparamsError, match=r"^model_hparams hold rngs=<an nnx\.Rngs>, which flaxlight does not "
                                                r"take: .* as TinyNNX\(\*\*model_hparams, rngs=nnx\.Rngs\(seed\)\).*" + fix):
        RegressTrainer(model_class=TinyNNX, model_hparams={"rngs": nnx.Rngs(7)}, exmp_input=X0,
                       optimizer_hparams=ADAM, **quiet(tmp_path))
    with pytest.raises(TypeError, match=r"^RegressTrainer got rngs=<an nnx\.Rngs>, which flaxlight does not take: "
                                        r".*" + fix):
        RegressTrainer(model_class=TinyNNX, model_hparams={}, exmp_input=X0, optimizer_hparams=ADAM,
                       rngs=nnx.Rngs(7), **quiet(tmp_path))
    assert not (tmp_path / "run").exists()
    seeded = RegressTrainer(model_class=TinyNNX, model_hparams={}, exmp_input=X0, optimizer_hparams=ADAM, seed=7,
                            **quiet(tmp_path))
    np.testing.assert_array_equal(seeded.state.params["head"]["kernel"], TinyNNX(rngs=nnx.Rngs(7)).head.kernel[...])


# --------------------------------------------------------------------------- plain NNX training-loop habits
class ModuleLoss(RegressTrainer):
    def loss_fn(self, model, batch, *, train, rng, state):   # nnx.value_and_grad's habit: the first argument as the model
        x, y = batch
        return jnp.mean((model(x) - y) ** 2), {}


def test_a_loss_that_calls_its_params_as_the_model_says_what_they_are_and_how_to_call_the_model(tmp_path):
    trainer = ModuleLoss(model_class=TinyNNX, model_hparams={}, exmp_input=X0, optimizer_hparams=ADAM,
                         **quiet(tmp_path))
    with pytest.raises(TypeError, match="'dict' object is not callable") as caught:
        _fit(trainer)
    note = "\n".join(caught.value.__notes__)
    assert "loss_fn's first argument is the model's parameters, a dict" in note
    assert "state.apply_model(params, x, train=train, rng=rng)" in note
    assert "Coming from a plain NNX training loop" in note


@pytest.mark.parametrize("given", [lambda opt: opt, lambda opt: {"optimizer": opt, "lr": 1e-3}], ids=["itself", "in-dict"])
def test_an_nnx_optimizer_is_refused_naming_the_optax_transformation_to_pass(tmp_path, given):
    opt = nnx.Optimizer(TinyNNX(rngs=nnx.Rngs(0)), optax.adamw(1e-3), wrt=nnx.Param)
    with pytest.raises(TypeError, match=r"is an nnx\.Optimizer, .* takes only the optax transformation inside it: "
                                        r"optimizer_hparams=optax\.adamw\(1e-3\)"):
        _fit(RegressTrainer(model_class=TinyNNX, model_hparams={}, exmp_input=X0, optimizer_hparams=given(opt),
                            **quiet(tmp_path)))


@pytest.mark.parametrize("key, value, says", [
    ("optimizer", optax.adam(1e-3), r"optimizer=<a GradientTransformationExtraArgs>, .* optimizer_hparams=optax\.adam"),
    ("optimizer", "adam", r"optimizer='adam', .*optimizer_hparams=\{'optimizer': 'adam', 'lr': 1e-3\}"),
    ("model", TinyNNX, r"model=<TinyNNX>, .* model_class=TinyNNX, model_hparams=\{\.\.\.\}"),
    ("loss", "mse", r"loss='mse', .* def loss_fn\(self, params, batch, \*, train, rng, state\)"),
    ("metrics", ["accuracy"], r"metrics=<a list>, .* return loss, \{'acc': "),
])
def test_keras_and_nnx_loop_arguments_are_refused_with_flaxlights_spelling(tmp_path, key, value, says):
    """optimizer=optax.adam(...) was kept as an unused extra hparam while the configured optimizer trained."""
    with pytest.raises(TypeError, match=r"^RegressTrainer got " + says + r".*it would change nothing; so it is refused"):
        RegressTrainer(model_class=TinyNNX, model_hparams={}, exmp_input=X0, optimizer_hparams=ADAM,
                       **quiet(tmp_path, **{key: value}))
    assert not (tmp_path / "run").exists()


def test_model_given_for_model_class_is_named_before_pythons_missing_arguments(tmp_path):
    with pytest.raises(TypeError, match=r"^RegressTrainer got model=<a TinyNNX>, .* model_class=TinyNNX, "):
        RegressTrainer(model=TinyNNX(rngs=nnx.Rngs(0)), optimizer_hparams=ADAM, exmp_input=X0, **quiet(tmp_path))


class OwnOptimizerArgument(RegressTrainer):
    def __init__(self, *args, optimizer: str = "adam", **kwargs):   # declared: the class's own hparam
        super().__init__(*args, optimizer_hparams={"optimizer": optimizer, "lr": 1e-2}, optimizer=optimizer, **kwargs)


class TakesModel(RegressTrainer):
    def __init__(self, model, **kwargs):   # takes model= itself (through **kwargs from a caller)
        super().__init__(type(model), {}, ADAM, X0, **kwargs)


def test_a_trainer_that_declares_or_takes_such_an_argument_keeps_it(tmp_path):
    trainer = OwnOptimizerArgument(model_class=TinyNNX, model_hparams={}, exmp_input=X0, optimizer="sgd",
                                   **quiet(tmp_path))
    assert trainer.config["optimizer"] == "sgd" and trainer.optimizer_hparams["optimizer"] == "sgd"
    assert TakesModel(model=TinyNNX(rngs=nnx.Rngs(0)), **quiet(tmp_path / "b")).model_class is TinyNNX
