"""``log_grad_norm=True``: ``train/grad_norm`` is the global norm of the step's gradients before clipping."""

import csv

import jax
import numpy as np
import pytest

import flaxlight
from conftest import RegressTrainer, TinyMLP, linear_data, quiet


def _trainer(tmp_path, **kwargs):
    kwargs.setdefault("optimizer_hparams", {"optimizer": "sgd", "lr": 0.1, "gradient_clip": 0.01})
    return RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [16], "output_dim": 1},
                          exmp_input=np.zeros((1, 4), np.float32), **quiet(tmp_path, **kwargs))


def test_grad_norm_is_the_norm_of_the_gradients_before_clipping(tmp_path):
    x, y = linear_data(32, 0)
    trainer = _trainer(tmp_path, log_grad_norm=True, log_every_n_steps=1)
    params = jax.tree.map(np.array, trainer.state.params)

    def loss(p):
        return trainer.loss_fn(p, (x, y), train=True, rng=jax.random.PRNGKey(0), state=trainer.state)[0]

    grads = jax.tree.leaves(jax.grad(loss)(params))
    expected = float(np.sqrt(sum(np.sum(np.square(g)) for g in grads)))
    assert expected > 0.01  # the optimizer clips to 0.01: the logged norm is the one before
    metrics = trainer.train_model((x, y), None, num_epochs=1, batch_size=32)

    assert metrics["train/grad_norm"] == pytest.approx(expected, rel=1e-5)
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert float(next(r for r in rows if r.get("train/grad_norm"))["train/grad_norm"]) == pytest.approx(expected, rel=1e-5)


def test_grad_norm_leaves_frozen_parameters_out_as_gradient_clip_does(tmp_path):
    """It counted the frozen layers' gradients, which the optimizer (and gradient_clip's norm) leave out."""
    x, y = linear_data(32, 0)
    hparams = {"optimizer": "sgd", "lr": 0.1, "gradient_clip": 0.01, "freeze": ["Dense_0"]}
    trainer = _trainer(tmp_path, log_grad_norm=True, log_every_n_steps=1, optimizer_hparams=hparams)
    params = jax.tree.map(np.array, trainer.state.params)

    def loss(p):
        return trainer.loss_fn(p, (x, y), train=True, rng=jax.random.PRNGKey(0), state=trainer.state)[0]

    grads = jax.grad(loss)(params)
    trained = [g for name, layer in grads.items() if name != "Dense_0" for g in jax.tree.leaves(layer)]
    assert len(trained) == 2 and len(jax.tree.leaves(grads)) == 4
    metrics = trainer.train_model((x, y), None, num_epochs=1, batch_size=32)
    assert metrics["train/grad_norm"] == pytest.approx(float(np.sqrt(sum(np.sum(g ** 2) for g in trained))), rel=1e-5)


def test_grad_norm_is_absent_unless_asked_for_and_refused_with_a_step_of_your_own(tmp_path):
    x, y = linear_data(32, 0)
    metrics = _trainer(tmp_path / "off").train_model((x, y), None, num_epochs=1, batch_size=32)
    assert "train/grad_norm" not in metrics

    class OwnStep(RegressTrainer):
        def create_functions(self):
            return flaxlight.make_train_step(self.loss_fn), flaxlight.make_eval_step(self.loss_fn)

    with pytest.raises(ValueError, match="log_grad_norm=True needs flaxlight's train step.*OwnStep"):
        OwnStep(model_class=TinyMLP, model_hparams={"hidden_dims": [4]}, optimizer_hparams={"optimizer": "sgd"},
                exmp_input=x[:1], log_grad_norm=True, **quiet(tmp_path / "own"))
    with pytest.raises(ValueError, match="log_grad_norm"):
        _trainer(tmp_path / "bad", log_grad_norm="yes")


def test_a_step_wrapped_around_super_create_functions_keeps_grad_norm_and_the_l2_term(tmp_path, caplog):
    x, y = linear_data(32, 0)

    class WithParamNorm(RegressTrainer):
        def create_functions(self):
            train_step, eval_step = super().create_functions()

            def with_param_norm(state, batch):
                state, metrics = train_step(state, batch)
                norm = sum(jax.numpy.sum(p ** 2) for p in jax.tree.leaves(state.params))
                return state, {**metrics, "param_norm": norm}

            return with_param_norm, eval_step

    trainer = WithParamNorm(model_class=TinyMLP, model_hparams={"hidden_dims": [4]}, exmp_input=x[:1],
                            optimizer_hparams={"optimizer": "sgd", "lr": 0.1, "weight_decay": 1e-3,
                                               "weight_decay_mode": "l2"},
                            log_grad_norm=True, **quiet(tmp_path))
    metrics = trainer.train_model((x, y), None, num_epochs=1, batch_size=32)
    assert {"train/grad_norm", "train/param_norm"} <= set(metrics)
    assert "weight_decay_mode='l2' adds its penalty" not in caplog.text  # the wrapped step applies it
