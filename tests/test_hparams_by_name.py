"""Model hparams that ``hparams.yaml`` keeps as text only (a function: ``by_name_hparams``) and dtypes
(``dtype_hparams``), as a user meets them: a trainer that picks its model itself loads its run (the
command line tests it), one whose run truly cannot load is refused in one line on the command
line, a value given again in any spelling is taken, and a run written before these records resumes
without "settings differ"."""

from __future__ import annotations

import logging
import re
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from conftest import RegressTrainer, linear_data, quiet

import flaxlight
from flaxlight import cli, registry

X0 = np.zeros((1, 4), np.float32)
ADAM = {"optimizer": "adam", "lr": 1e-2}
OPT_IN = ("--allow-import", __name__)  # the run names its model by import path (a class of this file)


class ActMLP(nn.Module):
    """Its activation given as a function, or as the name of one of flax's (``"gelu"``)."""
    hidden: int = 8
    act: object = nn.relu
    dtype: object = jnp.float32

    @nn.compact
    def __call__(self, x, train: bool = False):
        act = getattr(nn, self.act) if isinstance(self.act, str) else self.act
        return nn.Dense(1, dtype=self.dtype)(act(nn.Dense(self.hidden, dtype=self.dtype)(x))).astype(jnp.float32)


class _Loss(flaxlight.TrainerModule):
    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        out, updates = state.apply_model(params, x, train=train, rng=rng)
        return jnp.mean((out - y) ** 2), ({}, updates)


class PicksGelu(_Loss):
    """The seed's pattern: the trainer picks its model, and puts a function among its hparams itself."""

    def __init__(self, hidden: int = 8, **kwargs):
        super().__init__(model_class=ActMLP, model_hparams={"hidden": hidden, "act": nn.gelu}, hidden=hidden, **kwargs)


class FillsAct(_Loss):
    """Takes model_hparams through **kwargs and sets the activation itself, from a name of its own."""

    def __init__(self, act_name: str = "gelu", **kwargs):
        kwargs["model_hparams"] = {**kwargs["model_hparams"], "act": {"gelu": nn.gelu, "relu": nn.relu}[act_name]}
        super().__init__(act_name=act_name, **kwargs)


class TakesAct(_Loss):
    """The seed's pattern with the function as the trainer's own argument: the text would be that argument."""

    def __init__(self, hidden: int = 8, act=nn.gelu, **kwargs):
        super().__init__(model_class=ActMLP, model_hparams={"hidden": hidden, "act": act}, **kwargs)


class HandsOn(_Loss):
    """An argument of its own; model_class / model_hparams handed on through **kwargs."""

    def __init__(self, w: float = 1.0, **kwargs):
        super().__init__(w=w, **kwargs)


registry.register_trainer("picks_gelu_for_by_name_tests", PicksGelu)
registry.register_trainer("takes_act_for_by_name_tests", TakesAct)


def _fit(trainer, epochs: int = 1, **kwargs):
    x, y = linear_data(64)
    return trainer.train_model((x, y), (x, y), num_epochs=epochs, batch_size=32, **kwargs)


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = cli.main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _config(tmp_path, trainer: str):
    config = tmp_path / f"{trainer}.yaml"
    config.write_text(yaml.safe_dump({
        "trainer": {"name": trainer, "max_epochs": 1, "enable_progress_bar": False, "enable_model_summary": False},
        "model": {"name": None},
        "optimizer": ADAM,
        "data": {"name": "sine", "batch_size": 32, "kwargs": {"num_train": 64, "num_val": 32, "num_test": 32}}}))
    return config


# --------------------------------------------------------------------------- a trainer that sets the function itself
def test_a_trainer_that_puts_a_function_in_its_model_hparams_itself_loads_its_run(tmp_path, capsys):
    """Its run was refused ('Pass it again: act=gelu') by load_from_checkpoint and `flaxlight test`,
    though the text never reaches the model: the trainer hands it nn.gelu itself. It loaded before."""
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        assert _cli(capsys, "fit", "-c", _config(tmp_path, "picks_gelu_for_by_name_tests"),
                    "--log-dir", tmp_path / "seed")[0] == 0
    code, out, err = _cli(capsys, "test", "--ckpt", tmp_path / "seed", *OPT_IN)
    assert code == 0 and "test/loss:" in out, err
    loaded = PicksGelu.load_from_checkpoint(tmp_path / "seed", exmp_input=np.zeros((1, 1), np.float32))
    assert loaded.model_hparams["act"] is nn.gelu
    # given again anyway, as the docs say of a function among model_hparams, in either spelling: the
    # same value is taken ("multiple values for keyword argument 'model_hparams'" before); another is refused
    for given in ({"act": nn.gelu}, {"model_hparams": {"hidden": 8, "act": nn.gelu}}):
        again = PicksGelu.load_from_checkpoint(tmp_path / "seed", exmp_input=np.zeros((1, 1), np.float32), **given)
        assert again.model_hparams["act"] is nn.gelu
    with pytest.raises(TypeError, match=r"^PicksGelu\.load_from_checkpoint: act='jax\..*relu' \(it sets act='jax\..*gelu'\): "
                                        r"PicksGelu\.__init__ picks its model itself .* Pass an argument of "
                                        r"PicksGelu\.__init__ instead \(hidden\)"):
        PicksGelu.load_from_checkpoint(tmp_path / "seed", exmp_input=np.zeros((1, 1), np.float32), act=nn.relu)
    # the fit's word on it says as much
    assert any("text only" in str(w.message) and "not needed where your trainer's __init__ sets it itself"
               in str(w.message) for w in said)

    fills = FillsAct(model_class=ActMLP, model_hparams={"hidden": 8}, exmp_input=X0, optimizer_hparams=ADAM,
                     **quiet(tmp_path, logger_params={"log_dir": str(tmp_path / "fills")}))
    with pytest.warns(UserWarning, match="text only"):
        _fit(fills)
    again = FillsAct.load_from_checkpoint(tmp_path / "fills", exmp_input=X0)
    x, _ = linear_data(8)
    np.testing.assert_array_equal(again.predict(x, batch_size=8), fills.predict(x, batch_size=8, which="best"))


# --------------------------------------------------------------------------- a run that truly cannot load
def test_a_run_whose_function_would_reach_the_model_is_refused_in_one_line_on_the_command_line(tmp_path, capsys):
    """It ended in a TypeError traceback whose advice (pass act=gelu) no command line can follow."""
    with pytest.warns(UserWarning, match="text only"):
        assert _cli(capsys, "fit", "-c", _config(tmp_path, "takes_act_for_by_name_tests"),
                    "--log-dir", tmp_path / "run")[0] == 0
    for command in ("test", "predict"):
        code, out, err = _cli(capsys, command, "--ckpt", tmp_path / "run", *OPT_IN)
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith(f"flaxlight {command}: error: the run's model_hparams act (a function: 'jax.")
        assert "the command line passes data only, so it cannot load this run. In Python, pass it again: " \
               "TakesAct.load_from_checkpoint(" in err and "exmp_input=..., act=gelu)" in err
    loaded = TakesAct.load_from_checkpoint(tmp_path / "run", exmp_input=np.zeros((1, 1), np.float32), act=nn.gelu)
    assert loaded.model_hparams["act"] is nn.gelu


def test_a_trainer_handing_model_hparams_on_is_told_what_to_pass_when_its_model_uses_the_text(tmp_path):
    """Its own __init__ (**kwargs) could set the function itself: the text is handed on, and the
    model calling it says what to pass, not "'str' object is not callable" with a note on shapes."""
    trainer = HandsOn(model_class=ActMLP, model_hparams={"act": jax.nn.gelu}, exmp_input=X0,
                      optimizer_hparams=ADAM, **quiet(tmp_path))
    with pytest.warns(UserWarning, match="text only"):
        _fit(trainer)
    with pytest.raises(TypeError) as info:
        HandsOn.load_from_checkpoint(tmp_path / "run", exmp_input=X0)
    assert re.fullmatch(r"HandsOn\.load_from_checkpoint: the run's model_hparams act \(a function: .*Pass it again: "
                        r"HandsOn\.load_from_checkpoint\(.*, exmp_input=\.\.\., act=gelu\)\.", str(info.value))
    assert not [note for note in getattr(info.value, "__notes__", ()) if note.startswith("flaxlight")]  # on shapes
    loaded = HandsOn.load_from_checkpoint(tmp_path / "run", exmp_input=X0, act=jax.nn.gelu)
    assert loaded.model_hparams["act"] is jax.nn.gelu


# --------------------------------------------------------------------------- given again, in another spelling
@pytest.mark.parametrize("given", [{"act": "gelu"}, {"model_hparams": {"act": "gelu"}}, {"act": nn.gelu}],
                         ids=["name", "model_hparams", "function"])
def test_a_function_given_again_in_a_spelling_the_model_takes_is_used(given, tmp_path):
    """act='gelu' (which the model takes) was refused as not given: the merged value was a string."""
    trainer = RegressTrainer(model_class=ActMLP, model_hparams={"act": nn.gelu}, exmp_input=X0,
                             optimizer_hparams=ADAM, **quiet(tmp_path))
    with pytest.warns(UserWarning, match="text only"):
        _fit(trainer)
    loaded = RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=X0, **given)
    x, _ = linear_data(8)
    np.testing.assert_allclose(loaded.predict(x, batch_size=8), trainer.predict(x, batch_size=8, which="best"),
                               rtol=1e-6)


def test_a_dtype_written_as_a_class_given_again_by_its_name_is_used(tmp_path):
    """dtype=float (the builtin: a class, kept as text) given again as dtype='float32' was refused."""
    trainer = RegressTrainer(model_class=ActMLP, model_hparams={"dtype": float}, exmp_input=X0,
                             optimizer_hparams=ADAM, **quiet(tmp_path))
    with pytest.warns(UserWarning, match=r"dtype \(a class: 'builtins\.float'\)"):
        _fit(trainer)
    loaded = RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=X0, dtype="float32")
    assert loaded.model_hparams["dtype"] == "float32"


# --------------------------------------------------------------------------- a run written before the records
def _as_written_before_the_records(run) -> None:
    """hparams.yaml as the code before dtype_hparams / by_name_hparams wrote it: no records, a JAX
    dtype by its class's path."""
    path = run / "hparams.yaml"
    saved = yaml.safe_load(path.read_text())
    for key in ("dtype_hparams", "by_name_hparams"):
        saved.pop(key)
    saved["model_hparams"]["dtype"] = "jax.numpy.float32"
    path.write_text(yaml.safe_dump(saved, sort_keys=False))


def test_resuming_a_run_written_before_the_records_with_its_settings_says_no_change(tmp_path, caplog, recwarn):
    """It said 'settings differ (model_hparams.dtype: 'jax.numpy.float32' -> 'float32'; dtype_hparams:
    None -> [...]; by_name_hparams: None -> [...])' and kept an hparams.1.yaml, at every resume."""
    hparams = {"act": nn.gelu, "dtype": jnp.float32}

    def trainer(optimizer_hparams=ADAM):
        return RegressTrainer(model_class=ActMLP, model_hparams=hparams, exmp_input=X0,
                              optimizer_hparams=optimizer_hparams, **quiet(tmp_path))

    with pytest.warns(UserWarning, match="text only"):
        _fit(trainer())
    _as_written_before_the_records(tmp_path / "run")
    recwarn.clear()
    with caplog.at_level(logging.INFO, logger="flaxlight"):
        _fit(trainer(), epochs=2, resume=True)
    assert "settings differ" not in caplog.text and not list((tmp_path / "run").glob("hparams.*.yaml"))
    said = [str(w.message) for w in recwarn if "text only" in str(w.message)]
    assert len(said) == 1  # the file lists it from now on: said once, as at a run's first write
    saved = yaml.safe_load((tmp_path / "run" / "hparams.yaml").read_text())
    assert saved["model_hparams"]["dtype"] == "float32" and saved["dtype_hparams"] and saved["by_name_hparams"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing new: not said again
        _fit(trainer(), epochs=3, resume=True)

    _as_written_before_the_records(tmp_path / "run")
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flaxlight"):  # a real change is said, and only it
        _fit(trainer({"optimizer": "adam", "lr": 3e-3}), epochs=4, resume=True)
    line = next(line for line in caplog.text.splitlines() if "settings differ" in line)
    assert "(optimizer_hparams.lr: 0.01 -> 0.003)" in line
    assert (tmp_path / "run" / "hparams.1.yaml").exists()
