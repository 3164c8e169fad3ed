"""``trainer.predict`` and ``trainer.test`` on loaders and on arrays."""

import csv
import itertools
import json
import os
import re

import jax
import numpy as np
import pytest
from conftest import RegressTrainer, TinyMLP, linear_data, quiet

import flaxlight


def _trained(tmp_path, regression_loaders, **model):
    train, val, _ = regression_loaders
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [16], **model},
                             optimizer_hparams={"optimizer": "adam", "lr": 3e-2}, exmp_input=linear_data(1)[0],
                             **quiet(tmp_path))
    trainer.train_model(train, val, num_epochs=3)
    return trainer


def test_predict_on_arrays_stacks_the_eval_mode_outputs_of_every_row(tmp_path, regression_loaders):
    trainer = _trained(tmp_path, regression_loaders, batch_norm=True)  # eval mode: running averages
    x, _ = linear_data(70, 5)
    predictions = trainer.predict(x, batch_size=32)  # 32 + 32 + a short batch of 6
    expected = np.asarray(trainer.bind_model()(x, train=False))
    assert isinstance(predictions, np.ndarray) and predictions.shape == (70, 1)
    np.testing.assert_allclose(predictions, expected, rtol=1e-5, atol=1e-6)
    # a loader of (x, y) batches: the model gets x
    loader = flaxlight.ArrayLoader(*linear_data(70, 5), batch_size=32)
    np.testing.assert_allclose(trainer.predict(loader), predictions, rtol=1e-6)
    np.testing.assert_allclose(trainer.predict(linear_data(70, 5), batch_size=64), predictions, rtol=1e-6)


def test_predict_computes_in_bf16_as_the_evaluation_of_a_bf16_run_does(tmp_path, regression_loaders):
    """predict ran in float32 while validate and test ran in bf16: its outputs did not give the
    reported test loss."""
    train, val, test = regression_loaders
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [16]}, exmp_input=linear_data(1)[0],
                             optimizer_hparams={"optimizer": "adam", "lr": 3e-2, "precision": "bf16"},
                             **quiet(tmp_path))
    trainer.train_model(train, val, num_epochs=2)
    import jax.numpy as jnp

    x = np.concatenate([np.asarray(b[0]) for b in test])
    predictions = trainer.predict(x, batch_size=len(x))
    state = trainer.state
    bf16 = jax.tree.map(lambda p: p.astype(jnp.bfloat16), state.params)
    in_bf16 = jax.jit(lambda p, x: state.apply_model(p, x, train=False)[0])(
        bf16, jnp.asarray(x, jnp.bfloat16))  # as the eval step computes: bf16 copies, bf16 outputs
    in_fp32, _ = state.apply_model(state.params, x, train=False)
    assert predictions.dtype == np.float32
    np.testing.assert_array_equal(predictions, np.asarray(in_bf16, np.float32))  # float32, rounded as computed
    assert np.abs(predictions - np.asarray(in_fp32)).max() > 1e-4  # not the float32 forward pass


def test_predict_with_an_nnx_model_in_eval_mode(tmp_path, regression_loaders):
    from conftest import TinyNNX

    train, val, _ = regression_loaders
    trainer = RegressTrainer(model_class=TinyNNX, model_hparams={"din": 4, "hidden_dims": [8], "batch_norm": True},
                             optimizer_hparams={"optimizer": "adam", "lr": 3e-2}, exmp_input=linear_data(1)[0],
                             **quiet(tmp_path))
    trainer.train_model(train, val, num_epochs=2)
    x, _ = linear_data(40, 5)
    np.testing.assert_allclose(trainer.predict(x, batch_size=16), np.asarray(trainer.bind_model()(x)),
                               rtol=1e-5, atol=1e-6)


def test_predict_with_the_best_checkpoint_leaves_the_state_alone(tmp_path, regression_loaders):
    trainer = _trained(tmp_path, regression_loaders)
    x, _ = linear_data(20, 5)
    current = trainer.predict(x, batch_size=8)
    trainer.state = trainer.state.replace(params=jax.tree.map(lambda p: p * 0, trainer.state.params))
    best = trainer.predict(x, batch_size=8, which="best")
    assert not np.allclose(trainer.predict(x, batch_size=8), current)  # the zeroed state is used now
    best_state = trainer.checkpointer.restore(trainer.state, step=trainer.checkpointer.all_steps()[0])
    manual = np.asarray(best_state.apply_model(best_state.params, x, train=False)[0])
    np.testing.assert_allclose(best, manual, rtol=1e-6)
    with pytest.raises(ValueError, match="which must be 'current', 'best' or 'last'"):
        trainer.predict(x, batch_size=8, which="newest")


def test_which_best_or_last_with_checkpointing_off_says_so_and_what_to_use(tmp_path, regression_loaders):
    """It said "this run saved no model yet", as if waiting or training longer would give one."""
    train, val, _ = regression_loaders
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=linear_data(1)[0],
                             optimizer_hparams={"optimizer": "adam", "lr": 3e-2}, enable_checkpointing=False,
                             **quiet(tmp_path))
    trainer.train_model(train, val, num_epochs=2)
    x, _ = linear_data(8, 5)
    for which in ("best", "last"):
        with pytest.raises(FileNotFoundError) as raised:
            trainer.predict(x, batch_size=8, which=which)
        message = str(raised.value)
        assert f"No '{which}' checkpoint: checkpointing is off for this trainer (enable_checkpointing=False" in message
        assert "which='current'" in message and "enable_checkpointing=True" in message and "yet" not in message
    with pytest.raises(FileNotFoundError, match="checkpointing is off.*export.which='best'. needs a saved"):
        trainer.export(tmp_path / "export", which="best")
    assert trainer.predict(x, batch_size=8).shape == (8, 1)  # which='current' serves the state as training left it
    with pytest.raises(FileNotFoundError, match="trained with enable_checkpointing=False, so it saved no model"):
        RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=linear_data(1)[0])



def test_a_test_with_checkpointing_off_says_it_tests_the_last_model_and_refuses_which_best(tmp_path, regression_loaders,
                                                                                          caplog):
    """With checkpointing off, train_model's test_loader and test() quietly tested the last model under
    the best validation's name, and test(which='best') did too (predict(which='best') raised)."""
    train, val, test_loader = regression_loaders
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=linear_data(1)[0],
                             optimizer_hparams={"optimizer": "adam", "lr": 3e-2}, enable_checkpointing=False,
                             **quiet(tmp_path))
    with caplog.at_level("WARNING", logger="flaxlight"):
        returned = trainer.train_model(train, val, test_loader=test_loader, num_epochs=2)
    said = [r.getMessage() for r in caplog.records if "Testing the model as training left it" in r.getMessage()]
    assert len(said) == 1 and "checkpointing is off" in said[0] and "which='current'" in said[0]
    assert returned["test/loss"] == pytest.approx(trainer.eval_model(test_loader)["loss"])  # the last model's
    for which in ("best", "last"):
        with pytest.raises(FileNotFoundError, match=f"No '{which}' checkpoint: checkpointing is off"):
            trainer.test(test_loader, which=which)
    assert trainer.test(test_loader, which="current", name="now")["test_now/loss"] == pytest.approx(
        returned["test/loss"])
    with pytest.raises(ValueError, match="which must be 'current', 'best' or 'last'; got 'bogus'"):
        trainer.test(test_loader, which="bogus")

def test_test_on_arrays_logs_and_saves_test_metrics_like_train_models_test_loader(tmp_path, regression_loaders):
    trainer = _trained(tmp_path, regression_loaders)
    _, _, test_loader = regression_loaders
    metrics = trainer.test(test_loader.data, batch_size=32)
    assert set(metrics) == {"test/loss"}
    saved = json.loads((tmp_path / "run" / "metrics" / "test.json").read_text())
    assert saved["test/loss"] == pytest.approx(metrics["test/loss"])
    trainer.load_model()
    assert trainer.eval_model(test_loader, log_prefix="test/")["test/loss"] == pytest.approx(metrics["test/loss"])


def _saved(tmp_path, name):
    return json.loads((tmp_path / "run" / "metrics" / f"{name}.json").read_text())


def test_named_tests_keep_each_test_sets_metrics_apart(tmp_path, regression_loaders):
    trainer = _trained(tmp_path, regression_loaders)
    _, _, test_loader = regression_loaders
    plain = trainer.test(test_loader)
    shifted_data = (test_loader.data[0], test_loader.data[1] + 1.0)  # a shifted test set
    shifted = trainer.test(shifted_data, batch_size=32, name="shifted")
    assert set(shifted) == {"test_shifted/loss"} and shifted["test_shifted/loss"] > plain["test/loss"] + 0.5
    assert _saved(tmp_path, "test") == pytest.approx(plain)
    assert _saved(tmp_path, "test_shifted") == pytest.approx(shifted)
    trainer.logger.flush()
    rows = list(csv.DictReader(open(tmp_path / "run" / "metrics.csv")))
    assert [float(r["test/loss"]) for r in rows if r["test/loss"]] == pytest.approx([plain["test/loss"]])
    assert [float(r["test_shifted/loss"]) for r in rows if r["test_shifted/loss"]] == pytest.approx(
        [shifted["test_shifted/loss"]])


def test_a_second_test_under_the_same_name_keeps_the_first_ones_file(tmp_path, regression_loaders, capsys):
    train, val, test_loader = regression_loaders
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [16]},
                             optimizer_hparams={"optimizer": "adam", "lr": 3e-2}, exmp_input=linear_data(1)[0],
                             **quiet(tmp_path))
    first = trainer.train_model(train, val, test_loader=test_loader, num_epochs=2)  # writes metrics/test.json
    second = trainer.test(linear_data(40, 7), batch_size=32)
    third = trainer.test(linear_data(40, 8), batch_size=32)
    assert _saved(tmp_path, "test") == pytest.approx({"test/loss": first["test/loss"]})
    assert _saved(tmp_path, "test.2") == pytest.approx(second) and _saved(tmp_path, "test.3") == pytest.approx(third)
    assert "metrics/test.json holds an earlier test's metrics: this one's (test/...) are saved to " \
           "metrics/test.2.json" in capsys.readouterr().err
    loaded = RegressTrainer.load_from_checkpoint(str(tmp_path / "run"), exmp_input=linear_data(1)[0])
    loaded.test(linear_data(40, 9), batch_size=32, name="ood")
    loaded.test(linear_data(40, 9), batch_size=32, name="ood")  # a rerun (a notebook cell run twice)
    assert sorted(f for f in os.listdir(tmp_path / "run" / "metrics") if f.startswith("test")) == [
        "test.2.json", "test.3.json", "test.json", "test_ood.2.json", "test_ood.json"]


@pytest.mark.parametrize("name", ["", "a/b", "shifted set", 3])
def test_a_test_name_that_cannot_name_a_file_is_a_clear_error(tmp_path, regression_loaders, name):
    trainer = _trained(tmp_path, regression_loaders)
    with pytest.raises(ValueError, match=r"test's name must be letters, digits, '_' or '-'.*name='shifted'"):
        trainer.test(linear_data(10), batch_size=5, name=name)


@pytest.mark.parametrize("call, message", [
    (lambda t, x, y: t.predict(x), r"predict's data is arrays: pass batch_size"),
    (lambda t, x, y: t.test((x, y)), r"test's data is arrays: pass batch_size"),
    (lambda t, x, y: t.predict([(x, y)], batch_size=4), r"batch_size is for arrays; predict's data is a list"),
    (lambda t, x, y: t.test((x, y[:5]), batch_size=4), r"must share a leading dimension"),
])
def test_arrays_without_a_batch_size_or_of_different_lengths_are_clear_errors(tmp_path, call, message):
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={}, optimizer_hparams={},
                             exmp_input=linear_data(1)[0], **quiet(tmp_path))
    x, y = linear_data(10)
    with pytest.raises(ValueError, match=message):
        call(trainer, x, y)


def test_a_trainer_loaded_for_inference_tests_the_moving_average_of_the_checkpoint_asked_for(
        tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [16]}, exmp_input=linear_data(1)[0],
                             optimizer_hparams={"optimizer": "adam", "lr": 3e-2, "ema_decay": 0.9},
                             callbacks=[flaxlight.callbacks.ModelCheckpoint(save_top_k=1, every_n_epochs=1)],
                             **quiet(tmp_path))
    trainer.train_model(train, val, num_epochs=3)
    data = linear_data(40, 7)
    expected = {which: RegressTrainer.load_from_checkpoint(trainer.log_dir, exmp_input=data[0][:1], which=which)
                .test(data, batch_size=32)["test/loss"] for which in ("best", "last")}
    loaded = RegressTrainer.load_from_checkpoint(trainer.log_dir, exmp_input=data[0][:1], which="best")
    for which in ("last", "best"):
        assert loaded.test(data, batch_size=32, which=which)["test/loss"] == pytest.approx(expected[which], rel=1e-6)
        assert loaded.test(data, batch_size=32)["test/loss"] == pytest.approx(expected[which], rel=1e-6)  # now held


def test_a_trainer_loaded_into_a_new_folder_finds_best_and_last_in_the_loaded_run(tmp_path, regression_loaders):
    trainer = _trained(tmp_path, regression_loaders)
    data = linear_data(40, 7)
    last = RegressTrainer.load_from_checkpoint(trainer.log_dir, exmp_input=data[0][:1], which="last")
    moved = RegressTrainer.load_from_checkpoint(trainer.log_dir, exmp_input=data[0][:1], which="best",
                                                logger_params={"log_dir": str(tmp_path / "elsewhere")})
    np.testing.assert_allclose(moved.predict(data[0], batch_size=32, which="last"), last.predict(data[0], batch_size=32))
    assert moved.test(data, batch_size=32, which="last") == pytest.approx(last.test(data, batch_size=32))


def test_a_loaded_trainer_that_trained_since_tests_its_own_training(tmp_path, regression_loaders):
    """A trainer loaded into another folder that fine-tuned without checkpoints tested the loaded
    run's checkpoint instead (its training lost)."""
    train, val, test = regression_loaders
    trainer = _trained(tmp_path, regression_loaders)
    tuned = RegressTrainer.load_from_checkpoint(trainer.log_dir, exmp_input=linear_data(1)[0], with_optimizer=True,
                                                logger_params={"log_dir": str(tmp_path / "tuned")},
                                                enable_checkpointing=False)
    result = tuned.train_model(train, val, test_loader=test, num_epochs=5)
    assert result["test/loss"] == pytest.approx(tuned.eval_model(test, "test/")["test/loss"], rel=1e-6)
    assert int(tuned.state.step) == tuned.global_step


def test_predict_on_wrongly_shaped_data_names_the_shapes_as_test_does(tmp_path, regression_loaders):
    """predict on data shaped unlike exmp_input raised Flax's ScopeParamShapeError about an
    "initializer" (predict(x[0]), one example without its batch axis, too), while test() on the
    same arrays gave flaxlight's shape message."""
    trainer = _trained(tmp_path, regression_loaders)  # exmp_input of shape (1, 4)
    x, _ = linear_data(20, 3, dim=6)
    with pytest.raises(ValueError, match=r"predict's data does not fit the model: its batches' input has shape "
                                         r"\(8, 6\), but the model was initialised with exmp_input of shape \(1, 4\).*"
                                         r"expected \(N, 4\)") as raised:
        trainer.predict(x, batch_size=8)
    assert "batch axis: pass" not in str(raised.value)
    one = linear_data(3, 3)[0][:, :, None]  # a model of (N, 4, 1) inputs, given one example x[0] of shape (4, 1)
    image = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [4]}, optimizer_hparams={},
                           exmp_input=one[:1], **quiet(tmp_path, logger_params={"log_dir": str(tmp_path / "i")}))
    with pytest.raises(ValueError, match=r"predict's data has shape \(4, 1\): exmp_input's shape \(1, 4, 1\) without "
                                         r"its batch axis.*Pass one example as x\[:1\] or x\[None\] \(shape \(1, 4, 1\)\)"):
        image.predict(one[0], batch_size=1)  # refused before the model runs
    with pytest.raises(ValueError, match=r"input has shape \(1, 1\).*expected \(N, 4, 1\). The data seems to lack "
                                         r"the batch axis: pass one example as x\[:1\] or x\[None\] \(shape "
                                         r"\(1, 4, 1\)\), not x\[0\] \(shape \(4, 1\)\)"):
        image.predict([one[0][:1]])  # a loader's batch of rows: the model, traced on it, fails
    assert image.predict(one[0][None], batch_size=1).shape == (1, 1)


def test_predict_gives_a_model_of_variable_input_sizes_what_it_takes(tmp_path):
    """The shape check refuses only what the model cannot take (it is traced on the batch)."""
    import flax.linen as nn

    class MeanOverTime(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            return nn.Dense(1)(x.mean(axis=1))

    trainer = RegressTrainer(model_class=MeanOverTime, model_hparams={}, optimizer_hparams={},
                             exmp_input=np.zeros((1, 5, 4), np.float32), **quiet(tmp_path))
    assert trainer.predict(np.ones((6, 9, 4), np.float32), batch_size=3).shape == (6, 1)


class _WithExtras:
    """Models whose output dict holds, next to per-example values, one that is not per example."""

    @staticmethod
    def make(extra: str):
        import flax.linen as nn
        import jax.numpy as jnp

        class Outputs(nn.Module):
            @nn.compact
            def __call__(self, x, train: bool = False):
                pred = nn.Dense(1)(x)
                prior = self.param("prior", nn.initializers.zeros, (3,))
                out = {"pred": pred, "per_example": jnp.abs(pred[:, 0])}
                if extra == "vector":
                    out["prior"] = prior  # shape (3,): the same for every batch
                elif extra == "scalar":
                    out["batch_mean"] = pred.mean()
                return out

        return Outputs


class DictRegress(flaxlight.TrainerModule):
    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        out, updates = state.apply_model(params, x, train=train, rng=rng)
        return ((out["pred"] - y) ** 2).mean(), ({}, updates)


def test_predict_refuses_a_scalar_output_naming_it(tmp_path):
    """A scalar entry failed with numpy's bare 'zero-dimensional arrays cannot be concatenated'."""
    trainer = DictRegress(model_class=_WithExtras.make("scalar"), model_hparams={}, optimizer_hparams={},
                          exmp_input=linear_data(1)[0], **quiet(tmp_path))
    x, _ = linear_data(25, 3)
    with pytest.raises(ValueError, match=r"^predict: the model's output\['batch_mean'\] is a scalar \(shape \(\)\): .*"
                                         r"a scalar has no rows to stack. Return per-example values"):
        trainer.predict(x, batch_size=10)


def test_predict_stacks_an_output_of_other_rows_as_it_is_with_a_warning_naming_it(tmp_path):
    """A (3,) entry of a VAE's output came back (9,) for 3 batches without a word; per-token rows
    ((B*T, V), a review) are right stacked as they are: a warning, once per output, not an error."""
    trainer = DictRegress(model_class=_WithExtras.make("vector"), model_hparams={}, optimizer_hparams={},
                          exmp_input=linear_data(1)[0], **quiet(tmp_path))
    x, _ = linear_data(25, 3)
    with pytest.warns(UserWarning, match=r"predict: the model's output\['prior'\] has shape \(3,\), and the batch has "
                                         r"10 examples: .*once per batch") as caught:
        out = trainer.predict(x, batch_size=10)
    assert len([w for w in caught if "output['prior']" in str(w.message)]) == 1
    assert out["prior"].shape == (9,) and out["pred"].shape == (25, 1)


def test_predict_stacks_a_dict_of_per_example_outputs(tmp_path):
    trainer = DictRegress(model_class=_WithExtras.make("none"), model_hparams={}, optimizer_hparams={},
                          exmp_input=linear_data(1)[0], **quiet(tmp_path))
    x, _ = linear_data(25, 3)
    out = trainer.predict(x, batch_size=10)  # 10 + 10 + 5
    assert {key: value.shape for key, value in out.items()} == {"pred": (25, 1), "per_example": (25,)}
    whole = trainer.predict(x, batch_size=25)
    np.testing.assert_allclose(out["per_example"], whole["per_example"], rtol=1e-6)


def test_predict_on_batches_of_several_sequence_lengths_fails_at_the_first_other_length_naming_it(tmp_path):
    """Bucketed batches (lengths 8 then 16) trained and evaluated, but predict computed every batch and
    then failed with numpy's bare 'all the input array dimensions except for the concatenation axis'."""
    import flax.linen as nn

    class PerToken(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            return nn.Dense(1)(x)[..., 0]  # one value per token: [B, T]

    batches = [(np.ones((4, 8, 3), np.float32),), (np.ones((4, 8, 3), np.float32),),
               (np.ones((4, 16, 3), np.float32),), (np.ones((4, 8, 3), np.float32),)]
    seen = []

    def loader():
        for batch in batches:
            seen.append(batch[0].shape[1])
            yield batch

    trainer = RegressTrainer(model_class=PerToken, model_hparams={}, optimizer_hparams={},
                             exmp_input=np.zeros((1, 8, 3), np.float32), **quiet(tmp_path))
    with pytest.raises(ValueError, match=r"predict: the model's output has shape \(4, 16\) in batch 2 and \(4, 8\) in "
                                         r"batch 0: .*pad the inputs to one length for predict, or call predict once "
                                         r"per length"):
        trainer.predict(loader())
    assert seen == [8, 8, 16]  # failed at that batch, not after computing them all
    assert trainer.predict(np.ones((6, 16, 3), np.float32), batch_size=4).shape == (6, 16)  # one length: stacked


def _endless(limit=50):
    """An endless generator of (x, y) batches of 8, its own guard: iterated past ``limit`` batches, it fails (a
    missing steps cut raises here rather than hanging the test)."""
    for index in itertools.count():
        if index >= limit:
            raise AssertionError(f"iterated past {limit} batches: steps did not cut the generator")
        yield linear_data(8, 100 + index)


def _untrained(tmp_path):
    return RegressTrainer(model_class=TinyMLP, model_hparams={}, optimizer_hparams={},
                          exmp_input=linear_data(1)[0], **quiet(tmp_path))


def test_predict_and_test_take_steps_batches_of_an_endless_generator(tmp_path, regression_loaders, caplog):
    trainer = _untrained(tmp_path)
    predictions = trainer.predict(_endless(), steps=3)
    firsts = [linear_data(8, 100 + i) for i in range(3)]
    assert predictions.shape == (24, 1)
    np.testing.assert_allclose(predictions, trainer.predict(firsts), rtol=1e-6)
    with caplog.at_level("INFO", logger="flaxlight"):
        metrics = trainer.test(_endless(), steps=3, which="current")
    assert metrics["test/loss"] == pytest.approx(trainer.eval_model(firsts, log_prefix="test/")["test/loss"])
    assert "test(steps=3) tested 3 batches: the test/... metrics are their means." in caplog.text
    assert _saved(tmp_path, "test") == pytest.approx(metrics)
    # steps beyond a loader's end: the whole loader, said as it is
    _, _, test_loader = regression_loaders  # 3 batches
    with caplog.at_level("INFO", logger="flaxlight"):
        assert trainer.test(test_loader, steps=10, which="current", name="short")["test_short/loss"] == pytest.approx(
            trainer.eval_model(test_loader)["loss"])
    assert "test(steps=10) tested 3 batches: the test_short/... metrics are their means." in caplog.text
    assert trainer.predict(test_loader.data[0], batch_size=32, steps=2).shape == (64, 1)


def test_steps_that_is_no_whole_number_of_batches_is_a_clear_error(tmp_path):
    trainer = _untrained(tmp_path)
    for steps, method in itertools.product([0, -1, 2.5, True, "3"], (trainer.predict, trainer.test)):
        with pytest.raises(ValueError, match=rf"^{method.__name__}\(steps=\.\.\.\) is the number of batches to take, a "
                                             rf"whole number >= 1 \(None: the whole loader\); got {re.escape(repr(steps))}"):
            method(_endless(), steps=steps)


class _DataModule:
    """A LightningDataModule's shape (no Lightning imported)."""

    def setup(self, stage):
        pass


@pytest.mark.parametrize("call, message", [
    (lambda t: t.test(datamodule=_DataModule()),
     r"^test\(\) got an unexpected keyword argument 'datamodule': flaxlight takes the loaders themselves: Lightning's "
     r"trainer\.test\(model, datamodule=dm\) is dm\.setup\('test'\) \(Lightning calls it for you; flaxlight does not\) "
     r"and then trainer\.test\(dm\.test_dataloader\(\)\)\.$"),
    (lambda t: t.predict(datamodule=_DataModule()),
     r"^predict\(\) got an unexpected keyword argument 'datamodule': .*dm\.setup\('predict'\) .*"
     r"trainer\.predict\(dm\.predict_dataloader\(\)\)\.$"),
    (lambda t: t.eval_model(datamodule=_DataModule()),
     r"^eval_model\(\) got an unexpected keyword argument 'datamodule': .*trainer\.validate\(model, datamodule=dm\) is "
     r"dm\.setup\('validate'\) .*trainer\.eval_model\(dm\.val_dataloader\(\), log_prefix='val/'\)\.$"),
    (lambda t: t.test(dataloaders=[]), r"^test\(\) got an unexpected keyword argument 'dataloaders': pass the loader "
                                       r"as the first argument: test\(\(x, y\), batch_size=256\)\.$"),
    (lambda t: t.test([], ckpt_path="best"), r"'ckpt_path': it is which='best' \(or 'last'\)"),
    (lambda t: t.predict(x=np.zeros((4, 4))), r"^predict\(\) got an unexpected keyword argument 'x': pass the data as "
                                              r"the first argument: predict\(x, batch_size=256\)\.$"),
    (lambda t: t.eval_model([], steps=3), r"'steps': eval_model evaluates the whole loader .*FirstBatches\(loader, N\)"),
    (lambda t: t.predict([], batchsize=4), r"^predict\(\) got an unexpected keyword argument 'batchsize': did you mean "
                                           r"'batch_size'\?$"),
    (lambda t: t.test(), r"^test\(\) missing its first argument 'data': it takes the data to test on: a loader of "
                         r"\(inputs, labels\) batches, test\(test_loader\), or arrays, test\(\(x, y\), batch_size=256\)\.$"),
    (lambda t: t.predict(which="best"), r"^predict\(\) missing its first argument 'data': it takes the inputs"),
    (lambda t: t.eval_model(log_prefix="val/"), r"^eval_model\(\) missing its first argument 'data_loader'"),
])
def test_a_lightning_or_keras_call_of_an_evaluation_says_what_to_write(tmp_path, call, message):
    trainer = _untrained(tmp_path)
    with pytest.raises(TypeError, match=message):
        call(trainer)
