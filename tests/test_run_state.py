"""State that travels with a run: arrays given as hyperparameters (a data scaler) are written to
hparams.yaml as plain lists and come back as arrays; arrays shared between two trainers' states,
donated by training one of them, are named in a clear error before anything is written."""

import warnings
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from conftest import RegressTrainer, TinyMLP, linear_data, quiet

import flaxlight
from flaxlight import runfiles

X0 = np.zeros((1, 4), np.float32)
MEAN = np.array([37.52751, 49.972755, -1.5, 0.1], np.float32)
STD = np.array([9.470913, 10.800285, 2.0, 1.0], np.float32)


class Standardized(nn.Module):
    """A scaler inside the model: its arrays are model hyperparameters."""

    mean: Any = None
    std: Any = None

    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(1)((x - jnp.asarray(self.mean)) / jnp.asarray(self.std))


class ScaledTrainer(RegressTrainer):
    """Array arguments of the trainer's own constructor, passed up to be recorded."""

    def __init__(self, scaler_mean=None, counts=None, offset=None, **kwargs):
        super().__init__(scaler_mean=scaler_mean, counts=counts, offset=offset, **kwargs)
        self.scaler_mean, self.counts, self.offset = scaler_mean, counts, offset


def test_array_hyperparameters_are_plain_lists_in_hparams_yaml_and_load_back_as_arrays(tmp_path):
    x, y = linear_data(64)
    trainer = ScaledTrainer(scaler_mean=MEAN, counts=np.arange(6, dtype=np.int32).reshape(2, 3),
                            offset=jnp.asarray(2.5, jnp.bfloat16), model_class=Standardized,
                            model_hparams={"mean": jnp.asarray(MEAN), "std": STD},
                            optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, exmp_input=X0, **quiet(tmp_path))
    trainer.train_model((x, y), (x, y), num_epochs=1, batch_size=32)
    text = (tmp_path / "run" / "hparams.yaml").read_text()
    assert "scaler_mean: [37.52751, 49.972755, -1.5, 0.1]" in text and "array(" not in text
    plain = yaml.safe_load(text)  # plain YAML for any other tool: lists of numbers, and which keys were arrays
    assert plain["counts"] == [[0, 1, 2], [3, 4, 5]] and plain["model_hparams"]["std"] == [9.470913, 10.800285, 2.0, 1.0]
    assert {"path": ["model_hparams", "mean"], "dtype": "float32", "shape": [4]} in plain["array_hparams"]

    loaded = ScaledTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=X0)
    for got, want in [(loaded.scaler_mean, MEAN), (loaded.counts, trainer.counts), (loaded.offset, trainer.offset),
                      (loaded.model.mean, MEAN), (loaded.model.std, STD)]:
        assert isinstance(got, np.ndarray) and got.dtype == np.asarray(want).dtype and got.shape == np.shape(want)
        assert np.array_equal(got, np.asarray(want))
    assert np.array_equal(loaded.predict(x, batch_size=32), trainer.predict(x, batch_size=32, which="best"))
    assert (tmp_path / "run" / "hparams.yaml").read_text() == text  # loading rewrote nothing


def test_a_large_array_is_summarised_with_a_warning_to_keep_it_elsewhere(tmp_path):
    """Written whole, a 1M-element array took 14 s to write and 26 s to read, at every save (review)."""
    values = np.arange(1_000_000, dtype=np.float32) / 7
    with pytest.warns(UserWarning, match=r"scaler_mean is an array of 1,000,000 elements .* not written .* "
                                         r"flaxlight\.TrainState subclass .* a file of your own"):
        runfiles.write_hparams(str(tmp_path), {"seed": 0, "scaler_mean": values, "names": np.array(["ab", "cde"])})
    assert (tmp_path / "hparams.yaml").stat().st_size < 2000
    back = runfiles.with_arrays(runfiles.read_hparams(str(tmp_path)))
    assert isinstance(back["scaler_mean"], str) and "shape=(1000000,)" in back["scaler_mean"]
    assert back["names"].tolist() == ["ab", "cde"] and back["seed"] == 0 and "array_hparams" not in back
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 10,000 elements or fewer: written without a word
        (tmp_path / "small").mkdir()
        runfiles.write_hparams(str(tmp_path / "small"), {"small": np.ones(10_000)})


def _new_head(source, tmp_path, name, copy=False):
    """docs/models.md "A new head": a new trainer whose first layer is the source's."""
    new = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=X0,
                         optimizer_hparams={"optimizer": "adam", "lr": 1e-2},
                         **quiet(tmp_path, logger_params={"log_dir": str(tmp_path / name)}))
    layer = source.state.params["Dense_0"]
    new.state = new.state.replace(params={**new.state.params,
                                          "Dense_0": jax.tree.map(jnp.copy, layer) if copy else layer})
    return new


def test_arrays_donated_by_another_trainers_training_are_named_before_anything_is_written(tmp_path):
    x, y = linear_data(64)
    source = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=X0,
                            optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, **quiet(tmp_path))
    source.train_model((x, y), (x, y), num_epochs=1, batch_size=32)
    _new_head(source, tmp_path, "first").train_model((x, y), (x, y), num_epochs=1, batch_size=32)

    said = (r"state\.params\['Dense_0'\]\['(bias|kernel)'\] \(float32\[.*donates .*load_from_checkpoint.*"
            r"jax\.tree\.map\(jnp\.copy, source\.state\.params\['Dense_0'\]\)")
    with pytest.raises(RuntimeError, match=r"^RegressTrainer\.predict: 2 array\(s\) of the trainer's state were "
                                           r"deleted: " + said):
        source.predict(x, batch_size=32)
    with pytest.raises(RuntimeError, match=r"^RegressTrainer\.test: .*" + said):
        source.test((x, y), batch_size=32, which="current")
    with pytest.raises(RuntimeError, match=r"^RegressTrainer\.eval_model: .*" + said):
        source.eval_model((x, y), batch_size=32)
    second = _new_head(source, tmp_path, "second")  # built from the deleted arrays: refused before its folder is used
    with pytest.raises(RuntimeError, match=r"^RegressTrainer\.train_model: .*" + said):
        second.train_model((x, y), (x, y), num_epochs=1, batch_size=32)
    assert not (tmp_path / "second" / "hparams.yaml").exists()
    assert source.predict(x, batch_size=32, which="best").shape == (64, 1)  # its checkpoint is intact


def test_copied_arrays_leave_the_source_trainer_usable(tmp_path):
    x, y = linear_data(64)
    source = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=X0,
                            optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, **quiet(tmp_path))
    before = source.predict(x, batch_size=32)
    _new_head(source, tmp_path, "first", copy=True).train_model((x, y), (x, y), num_epochs=1, batch_size=32)
    _new_head(source, tmp_path, "second", copy=True).train_model((x, y), (x, y), num_epochs=1, batch_size=32)
    assert np.array_equal(source.predict(x, batch_size=32), before)


def test_the_models_guide_says_where_run_state_goes():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "models.md").read_text()
    section = text[text.index("## State that travels with the run"):]
    section = section[:section.index("\n## ", 5)]
    for said in ("hparams.yaml", "TrainState", "state_dict()", "export()", "10,000", "load_from_checkpoint"):
        assert said in section, said
    assert "jax.tree.map(jnp.copy" in text[text.index("### A new head"):]
