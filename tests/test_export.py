"""``trainer.export``: an artifact that plain JAX loads and calls, equal to ``trainer.predict``."""

import json
import subprocess
import sys
import textwrap

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import flaxlight
from conftest import ClassifyTrainer, TinyMLP, TinyNNX, quiet


def _digits_like(n=96, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    return x, (x[:, 0] > 0).astype(np.int32)


class BatchNormNet(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.Dense(16)(x)
        x = nn.BatchNorm(use_running_average=not train)(x)
        x = nn.Dropout(0.5, deterministic=not train)(nn.relu(x))
        return {"logits": nn.Dense(2)(x), "embedding": x}


class DictOutputTrainer(flaxlight.TrainerModule):
    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        out, updates = state.apply_model(params, x, train=train, rng=rng)
        return optax.softmax_cross_entropy_with_integer_labels(out["logits"], y).mean(), ({}, updates)


def _train(tmp_path, trainer_class, model_class, model_hparams):
    x, y = _digits_like()
    trainer = trainer_class(model_class=model_class, model_hparams=model_hparams, exmp_input=x[:1],
                            optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, **quiet(tmp_path))
    trainer.train_model((x, y), (x[:32], y[:32]), num_epochs=2, batch_size=16)
    return trainer, x


def test_plain_jax_serves_the_exported_model_at_any_batch_size(tmp_path):
    trainer, x = _train(tmp_path, ClassifyTrainer, TinyMLP, {"hidden_dims": [16], "output_dim": 2})
    written = trainer.export(tmp_path / "export")
    np.save(tmp_path / "x.npy", x)
    script = textwrap.dedent(f"""
        import sys, jax, numpy as np
        exported = jax.export.deserialize(bytearray(open({str(written)!r}, "rb").read()))
        x = np.load({str(tmp_path / "x.npy")!r})
        np.save({str(tmp_path / "y5.npy")!r}, np.asarray(exported.call(x[:5])))
        np.save({str(tmp_path / "y96.npy")!r}, np.asarray(exported.call(x)))
        assert "flaxlight" not in sys.modules
    """)
    subprocess.run([sys.executable, "-c", script], check=True)
    expected = trainer.predict(x, batch_size=32, which="best")
    np.testing.assert_allclose(np.load(tmp_path / "y96.npy"), expected, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.load(tmp_path / "y5.npy"), expected[:5], rtol=1e-5, atol=1e-6)
    info = json.loads((tmp_path / "export" / "export.json").read_text())
    assert info["inputs"] == [{"name": "x", "shape": [None, 8], "dtype": "float32"}] and info["which"] == "best"
    # the same notation for outputs (was ["b", "1"]: the symbolic name and numbers as strings)
    assert info["outputs"] == [{"path": "outputs", "shape": [None, 2], "dtype": "float32"}]


def test_batch_norm_dropout_and_dict_outputs_export_in_eval_mode(tmp_path):
    trainer, x = _train(tmp_path, DictOutputTrainer, BatchNormNet, {})
    predict = flaxlight.load_exported(trainer.export(tmp_path / "export", which="last"))
    expected = trainer.predict(x, batch_size=32, which="last")
    got = predict(x)
    np.testing.assert_allclose(np.asarray(got["logits"]), expected["logits"], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(predict(x)["embedding"]), np.asarray(got["embedding"]))  # no dropout


def test_an_nnx_model_exports(tmp_path):
    trainer, x = _train(tmp_path, ClassifyTrainer, TinyNNX, {"din": 8, "hidden_dims": [16], "output_dim": 2, "batch_norm": True})
    predict = flaxlight.load_exported(trainer.export(tmp_path / "export", which="current", batch_size=96))
    np.testing.assert_allclose(np.asarray(predict(x)), trainer.predict(x, batch_size=96), rtol=1e-5, atol=1e-6)


def test_export_errors_say_what_to_do(tmp_path):
    x, y = _digits_like()
    trainer = ClassifyTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [4], "output_dim": 2},
                              optimizer_hparams={"optimizer": "adam"}, exmp_input=x[:1], **quiet(tmp_path))
    with pytest.raises(FileNotFoundError, match="needs a saved checkpoint; pass which='current'"):
        trainer.export(tmp_path / "export")
    with pytest.raises(FileNotFoundError, match="No exported model"):
        flaxlight.load_exported(tmp_path / "nothing")


class TwoInputs(nn.Module):
    """A model of two inputs: exmp_input=(a, b), batches (a, b, y)."""

    @nn.compact
    def __call__(self, a, b, train: bool = False):
        return nn.Dense(2)(jnp.concatenate([nn.relu(nn.Dense(8)(a)), b], axis=-1))


class TwoInputTrainer(flaxlight.TrainerModule):
    def loss_fn(self, params, batch, *, train, rng, state):
        a, b, y = batch
        logits, updates = state.apply_model(params, a, b, train=train, rng=rng)
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(), ({}, updates)


def test_a_model_of_two_inputs_predicts_and_exports(tmp_path):
    """predict and export fed the model batch[0] only: "missing 1 required positional argument"."""
    x, y = _digits_like()
    a, b = x[:, :5], x[:, 5:]
    trainer = TwoInputTrainer(model_class=TwoInputs, model_hparams={}, exmp_input=(a[:1], b[:1]),
                              optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, **quiet(tmp_path))
    trainer.train_model((a, b, y), None, num_epochs=1, batch_size=16)
    expected, _ = trainer.state.apply_model(trainer.state.params, a, b, train=False)
    np.testing.assert_allclose(trainer.predict((a, b), batch_size=32), expected, rtol=1e-5, atol=1e-6)
    by_loader = trainer.predict(flaxlight.ArrayLoader(a, b, y, batch_size=40))  # the labels are not inputs
    np.testing.assert_allclose(by_loader, expected, rtol=1e-5, atol=1e-6)
    served = flaxlight.load_exported(trainer.export(tmp_path / "export", which="current"))
    np.testing.assert_allclose(np.asarray(served(a[:7], b[:7])), expected[:7], rtol=1e-5, atol=1e-6)
    info = json.loads((tmp_path / "export" / "export.json").read_text())
    assert info["inputs"] == [{"name": "x0", "shape": [None, 5], "dtype": "float32"},
                              {"name": "x1", "shape": [None, 3], "dtype": "float32"}]


def test_an_exmp_input_set_since_the_trainer_was_built_that_does_not_fit_is_named_by_export(tmp_path):
    """Any failure was blamed on the symbolic batch size, with advice (batch_size=N) that failed too;
    then it was Flax's bare ScopeParamShapeError, with no word of exmp_input."""
    x, y = _digits_like()
    trainer = ClassifyTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [4], "output_dim": 2},
                              optimizer_hparams={"optimizer": "adam"}, exmp_input=x[:1], **quiet(tmp_path))
    trainer.exmp_input = x[:1, :5]  # the model's first layer was built for 8 features
    with pytest.raises(ValueError, match="expected to generate shape \\(5, 4\\)") as raised:
        trainer.export(tmp_path / "export", which="current")
    message = str(raised.value)
    assert "batch_size=N" not in message
    assert message.startswith("export traces the model on inputs shaped like trainer.exmp_input, now an array of "
                              "shape (1, 5), but the trainer's model and its parameters were built from an exmp_input "
                              "that was an array of shape (1, 8), and they do not fit the new one; its parameters "
                              "would be shaped otherwise:\n  params/Dense_0/kernel: (8, 4) in the trainer, (5, 4) from "
                              "this exmp_input\nThe model's error: ScopeParamShapeError: ")
    assert "Set trainer.exmp_input back to one batch of the model's inputs shaped as when the trainer was" in message
    assert not (tmp_path / "export").exists()
    trainer.exmp_input = x[:1]  # as the message says: set back, it exports
    assert flaxlight.load_exported(trainer.export(tmp_path / "export", which="current"))(x).shape == (96, 2)
    nnx_trainer = ClassifyTrainer(model_class=TinyNNX, model_hparams={"din": 8, "hidden_dims": [4], "output_dim": 2},
                                  optimizer_hparams={"optimizer": "adam"}, exmp_input=x[:1], **quiet(tmp_path / "nnx"))
    nnx_trainer.exmp_input = x[:1, :5]  # an NNX model's sizes are its hparams: no parameter is listed
    with pytest.raises(ValueError, match=r"now an array of shape \(1, 5\), but .* an array of shape \(1, 8\), and "
                                         r"they do not fit the new one; the model's error: TypeError: dot_general"):
        nnx_trainer.export(tmp_path / "nnx_export", which="current")


class FailsInEvalMode(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        if not train:
            raise ValueError("this model has no eval mode")
        return nn.Dense(2)(x)


def test_a_model_that_fails_on_its_inputs_gets_its_own_error_from_export(tmp_path):
    x, _ = _digits_like()
    trainer = ClassifyTrainer(model_class=FailsInEvalMode, model_hparams={}, optimizer_hparams={"optimizer": "adam"},
                              exmp_input=x[:1], **quiet(tmp_path))
    with pytest.raises(ValueError) as raised:  # exmp_input is as built: the model's own error, as it is
        trainer.export(tmp_path / "export", which="current")
    assert raised.value.args == ("this model has no eval mode",)


def test_predict_on_batches_unlike_the_models_input_says_what_to_give(tmp_path):
    """Dict batches {"x", "y"} for a model of one array gave "IndexError: tuple index out of range"."""
    x, y = _digits_like()
    trainer = ClassifyTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [4], "output_dim": 2},
                              optimizer_hparams={"optimizer": "adam"}, exmp_input=x[:1], **quiet(tmp_path))
    with pytest.raises(TypeError, match=r"exmp_input: an array of shape \(1, 8\), but predict's batches give 1: a "
                                        r"dict with keys \['x', 'y'\]. Give predict the model's inputs only, "
                                        r"e.g. trainer.predict\(x, batch_size=256\)"):
        trainer.predict([{"x": x[:8], "y": y[:8]}])
    assert trainer.predict([{"x": x[:8], "y": y[:8]}[k] for k in ["x"]]).shape == (8, 2)


def test_a_two_input_model_given_one_array_is_told_to_pass_a_tuple_of_both(tmp_path):
    """predict(x) for a model of two inputs suggested trainer.predict(x, batch_size=256): the call
    that had just failed; the inputs were shown as [PyTreeDef(*)]."""
    x, _ = _digits_like()
    a, b = x[:, :5], x[:, 5:]
    trainer = TwoInputTrainer(model_class=TwoInputs, model_hparams={}, exmp_input=(a[:1], b[:1]),
                              optimizer_hparams={"optimizer": "adam"}, **quiet(tmp_path))
    with pytest.raises(TypeError) as raised:
        trainer.predict(a, batch_size=16)
    message = str(raised.value)
    assert "takes 2 inputs like exmp_input: an array of shape (1, 5); an array of shape (1, 3)" in message
    assert "predict's batches give 1: an array of shape (16, 5)" in message
    assert "trainer.predict((x0, x1), batch_size=256)" in message
    assert "predict(x, batch_size" not in message and "PyTreeDef" not in message
