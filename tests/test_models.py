"""Linen and NNX models through the same trainer: train, validate, checkpoint, resume, load, bind."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import ClassifyTrainer, TinyMLP, TinyNNX, quiet
from flax import nnx

import flaxlight
from flaxlight import ArrayLoader


def _data(seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(320, 6)).astype(np.float32)
    y = (x[:, 0] + x[:, 1] > 0).astype(np.int32)
    return (ArrayLoader(x[:256], y[:256], batch_size=32, shuffle=True, seed=1),
            ArrayLoader(x[256:], y[256:], batch_size=32), x)


MODELS = {
    "linen": (TinyMLP, {"hidden_dims": [32], "output_dim": 2, "batch_norm": True, "dropout_prob": 0.1}),
    "nnx": (TinyNNX, {"din": 6, "hidden_dims": [32], "output_dim": 2, "batch_norm": True, "dropout_prob": 0.1}),
}


def _trainer(kind, tmp_path, **kwargs):
    model_class, hparams = MODELS[kind]
    return ClassifyTrainer(model_class=model_class, model_hparams=hparams,
                           optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, exmp_input=np.zeros((1, 6), np.float32),
                           **quiet(tmp_path, monitor="val/acc", mode="max", **kwargs))


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_train_validate_checkpoint_load_and_bind(kind, tmp_path):
    train, val, x = _data()
    trainer = _trainer(kind, tmp_path)
    metrics = trainer.train_model(train, val, num_epochs=6)
    assert metrics["val/acc"] > 0.9

    loaded = ClassifyTrainer.load_from_checkpoint(trainer.log_dir, exmp_input=x[:1], which="last")
    last_val = trainer.eval_model(val, log_prefix="val/")
    assert loaded.eval_model(val, log_prefix="val/") == pytest.approx(last_val)
    model = loaded.bind_model()
    if kind == "nnx":
        assert isinstance(model, nnx.Module)
        predictions = model(x[256:])
    else:
        predictions = model(x[256:], train=False)
    predictions = np.asarray(predictions)
    # The trained trainer's own outputs, not through bind_model (a bind_model that ignored the
    # trained weights would give the same wrong outputs for both trainers, built with one seed).
    expected, _ = trainer.state.apply_model(trainer.state.params, x[256:], train=False)
    np.testing.assert_allclose(predictions, np.asarray(expected), rtol=1e-5, atol=1e-5)
    y_val = (x[256:, 0] + x[256:, 1] > 0).astype(np.int32)
    assert float((predictions.argmax(-1) == y_val).mean()) == pytest.approx(last_val["val/acc"], abs=1e-6)
    untrained = _trainer(kind, tmp_path / "untrained").state
    untrained_outputs, _ = untrained.apply_model(untrained.params, x[256:], train=False)
    assert not np.allclose(predictions, np.asarray(untrained_outputs), atol=1e-2)  # training changed the outputs
    if kind == "nnx":  # trainer.model is the trained module (it was the untrained one, its arrays donated away)
        for holder in (trainer, loaded):
            np.testing.assert_allclose(np.asarray(holder.model(x[256:])), predictions, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_dropout_and_batch_norm_follow_train_and_eval(kind, tmp_path):
    train, _, x = _data()
    trainer = _trainer(kind, tmp_path)
    state = trainer.state
    batch = x[:32]
    eval_a, _ = state.apply_model(state.params, batch, train=False)
    eval_b, _ = state.apply_model(state.params, batch, train=False)
    np.testing.assert_array_equal(eval_a, eval_b)  # eval: deterministic
    train_a, updates = state.apply_model(state.params, batch, train=True, rng=jax.random.PRNGKey(1))
    train_b, _ = state.apply_model(state.params, batch, train=True, rng=jax.random.PRNGKey(2))
    assert not np.allclose(train_a, train_b)  # a different dropout mask per key
    old_stats, new_stats = jax.tree.leaves(state.batch_stats), jax.tree.leaves(updates["batch_stats"])
    assert any(not np.allclose(a, b) for a, b in zip(old_stats, new_stats))  # running stats move in training
    assert eval_model_changes_nothing(state, batch)


def eval_model_changes_nothing(state, batch):
    _, updates = state.apply_model(state.params, batch, train=False)
    return updates == {}


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_crash_and_resume_is_bitwise_equal(kind, tmp_path):
    class Crash(flaxlight.Callback):
        every_n_steps = 13

        def on_step(self, trainer, step):
            raise RuntimeError("crash")

    def run(log_dir, callbacks=(), resume=False):
        train, val, _ = _data()
        trainer = _trainer(kind, log_dir, callbacks=[flaxlight.ModelCheckpoint(every_n_steps=5), *callbacks])
        trainer.train_model(train, val, num_epochs=3, resume=resume)
        return jax.device_get((trainer.state.params, trainer.state.batch_stats))

    reference = run(tmp_path / "ref")
    with pytest.raises(RuntimeError, match="crash"):
        run(tmp_path / "crashed", callbacks=[Crash()])
    jax.tree.map(np.testing.assert_array_equal, run(tmp_path / "crashed", resume=True), reference)


def test_models_that_are_neither_linen_nor_nnx_are_refused(tmp_path):
    with pytest.raises(TypeError, match="flax.linen.Module or flax.nnx.Module.*'dict'"):
        ClassifyTrainer(model_class=dict, model_hparams={}, optimizer_hparams={}, exmp_input=np.zeros((1, 6)),
                        **quiet(tmp_path))


def test_an_nnx_model_without_rngs_in_init_is_told_how_it_is_built(tmp_path):
    """The user saw only "__init__() got an unexpected keyword argument 'rngs'"."""

    class NoRngs(nnx.Module):
        def __init__(self, din: int):
            self.linear = nnx.Linear(din, 2, rngs=nnx.Rngs(0))

        def __call__(self, x):
            return self.linear(x)

    with pytest.raises(TypeError, match=r"NoRngs.__init__ takes no rngs argument: .* NoRngs\(\*\*model_hparams, "
                                        r"rngs=nnx.Rngs\(seed\)\).* Add `\*, rngs: nnx.Rngs`"):
        ClassifyTrainer(model_class=NoRngs, model_hparams={"din": 6}, optimizer_hparams={},
                        exmp_input=np.zeros((1, 6), np.float32), **quiet(tmp_path))


@pytest.mark.parametrize("kind", ["linen", "nnx"])
def test_unknown_model_hparam_is_named_with_the_accepted_ones(kind, tmp_path):
    model_class, hparams = MODELS[kind]
    with pytest.raises(TypeError, match=r"\['hidden_dim'\] are not accepted by .*accepts: .*'hidden_dims'"):
        ClassifyTrainer(model_class=model_class, model_hparams={**hparams, "hidden_dim": 3}, optimizer_hparams={},
                        exmp_input=np.zeros((1, 6), np.float32), **quiet(tmp_path))


def test_linen_dropout_without_a_train_switch_is_explained(tmp_path):
    class NoSwitch(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dropout(0.5)(nn.Dense(2)(x))

    for summary in (False, True):  # the model table is built first when asked for: same message
        with pytest.raises(TypeError, match="no `train` argument"):
            ClassifyTrainer(model_class=NoSwitch, model_hparams={}, optimizer_hparams={},
                            exmp_input=np.zeros((1, 6), np.float32), **quiet(tmp_path, enable_model_summary=summary))


def test_a_linen_dropout_that_drops_in_eval_mode_is_said_once_and_a_mode_following_one_is_not(tmp_path, caplog):
    """nn.Dropout(rate, deterministic=False) drops units at validation too (flaxlight's eval step
    gives the model a fixed key): the validation scores were of a thinned model, unsaid."""
    import logging

    class AlwaysDrops(nn.Module):
        follow_mode: bool = False

        @nn.compact
        def __call__(self, x, train: bool = False):
            drop = nn.Dropout(0.5, deterministic=not train if self.follow_mode else False)
            return nn.Dense(2)(drop(nn.relu(nn.Dense(16)(x))))

    train, val, x = _data()
    for follow_mode in (False, True):
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="flaxlight"):
            ClassifyTrainer(model_class=AlwaysDrops, model_hparams={"follow_mode": follow_mode}, optimizer_hparams={},
                            exmp_input=x[:1], **quiet(tmp_path / str(follow_mode))).train_model(train, val, num_epochs=2)
        said = [r.getMessage() for r in caplog.records if "drops units with train=False" in r.getMessage()]
        if follow_mode:
            assert said == []
        else:
            assert len(said) == 1 and "Dropout_0 (rate 0.5)" in said[0], said
            assert "nn.Dropout(rate, deterministic=not train)" in said[0]


class _DropoutFlagNNX(nnx.Module):
    """Hands `deterministic` to its Dropout only and leaves BatchNorm to the module's mode (as
    plain NNX code does): evaluation must still use the running statistics."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.linear, self.norm = nnx.Linear(6, 16, rngs=rngs), nnx.BatchNorm(16, rngs=rngs)
        self.drop, self.head = nnx.Dropout(0.2, rngs=rngs), nnx.Linear(16, 2, rngs=rngs)

    def __call__(self, x, deterministic: bool = True):
        return self.head(self.drop(nnx.relu(self.norm(self.linear(x))), deterministic=deterministic))


def test_nnx_evaluation_is_in_eval_mode_when_call_takes_a_mode_argument(tmp_path):
    train, val, x = _data()
    trainer = ClassifyTrainer(model_class=_DropoutFlagNNX, model_hparams={}, optimizer_hparams={"lr": 1e-2},
                              exmp_input=x[:1], **quiet(tmp_path))
    trainer.train_model(train, val, num_epochs=2)
    whole, fours = trainer.predict(x[256:], batch_size=64), trainer.predict(x[256:], batch_size=4)
    np.testing.assert_allclose(whole, fours, atol=1e-5)  # batch statistics would make them differ
    np.testing.assert_allclose(whole, trainer.bind_model()(x[256:]), atol=1e-5)


class _Count(nnx.Variable):
    pass


class _CountingNNX(nnx.Module):
    """A user's own variable type, updated in `__call__` (the NNX docs' `Count`)."""

    def __init__(self, *, rngs: nnx.Rngs):
        self.linear, self.calls = nnx.Linear(6, 2, rngs=rngs), _Count(jnp.zeros((), jnp.int32))

    def __call__(self, x):
        self.calls[...] = self.calls[...] + 1
        return self.linear(x)


def test_an_nnx_variable_type_of_the_users_is_updated_by_training_and_checkpointed(tmp_path):
    train, val, x = _data()
    trainer = ClassifyTrainer(model_class=_CountingNNX, model_hparams={}, optimizer_hparams={"lr": 1e-2},
                              exmp_input=x[:1], **quiet(tmp_path))
    trainer.train_model(train, val, num_epochs=2)
    assert int(trainer.bind_model().calls[...]) == 2 * len(train)  # once per train step; evaluation reads it
    loaded = ClassifyTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=x[:1], which="last")
    assert int(loaded.bind_model().calls[...]) == 2 * len(train)


def test_an_nnx_loss_that_forgets_the_rng_is_stopped_like_linens(tmp_path):
    """NNX: the same dropout mask every step, without a word (Linen raises InvalidRngError)."""

    class ForgetsRng(ClassifyTrainer):
        def loss_fn(self, params, batch, *, train, rng, state):
            x, y = batch
            logits, updates = state.apply_model(params, x, train=train)  # no rng=rng
            return jnp.mean((logits - y[:, None]) ** 2), ({}, updates)

    train, val, _ = _data()
    for kind in ("linen", "nnx"):
        model_class, hparams = MODELS[kind]
        trainer = ForgetsRng(model_class=model_class, model_hparams=hparams, optimizer_hparams={"lr": 1e-2},
                             exmp_input=np.zeros((1, 6), np.float32), **quiet(tmp_path / kind))
        with pytest.raises(Exception, match="PRNG for \"dropout\"" if kind == "linen" else
                           r"TinyNNX drew random numbers .* got no rng.* rng=rng\)"):
            trainer.train_model(train, val, num_epochs=1)

    class KeepsRngs(TinyNNX):  # holds its streams and never draws from them: no error
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.rngs = kwargs["rngs"]

    trainer = ForgetsRng(model_class=KeepsRngs, model_hparams=dict(hparams, dropout_prob=0.0),
                         optimizer_hparams={"lr": 1e-2}, exmp_input=np.zeros((1, 6), np.float32),
                         **quiet(tmp_path / "plain"))
    assert trainer.model.rngs is not None
    assert np.isfinite(trainer.train_model(train, val, num_epochs=1)["val/loss"])


def test_a_trainer_that_sets_self_model_keeps_it(tmp_path):
    """The UvA guide's trainers assign self.model; trainer.model became a read-only property."""

    class SetsModel(ClassifyTrainer):
        def init_model(self, exmp_input):
            self.model = "the user's own"
            super().init_model(exmp_input)

    trainer = SetsModel(model_class=TinyMLP, model_hparams={"hidden_dims": [4], "output_dim": 2},
                        optimizer_hparams={}, exmp_input=np.zeros((1, 6), np.float32), **quiet(tmp_path))
    assert trainer.model == "the user's own"


def test_the_nnx_summary_of_a_module_whose_train_argument_has_no_default(tmp_path, capsys):
    class NeedsTrain(nnx.Module):
        def __init__(self, *, rngs: nnx.Rngs):
            self.linear, self.drop = nnx.Linear(6, 2, rngs=rngs), nnx.Dropout(0.1, rngs=rngs)

        def __call__(self, x, train: bool):
            return self.drop(self.linear(x), deterministic=not train)

    ClassifyTrainer(model_class=NeedsTrain, model_hparams={}, optimizer_hparams={},
                    exmp_input=np.zeros((1, 6), np.float32), **quiet(tmp_path, enable_model_summary=True))
    assert "NeedsTrain Summary" in capsys.readouterr().out
