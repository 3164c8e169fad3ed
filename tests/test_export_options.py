"""``trainer.export`` as a user meets it: which model it writes by default, for which platforms,
what ``export.json`` says, and the errors for a bad ``batch_size`` or a file that is no artifact."""

import json
import os
import warnings

import flax.linen as nn
import jax
import numpy as np
import optax
import pytest

import flaxlight
from conftest import ClassifyTrainer, TinyMLP, TinyNNX, quiet
from test_export import TwoInputs, TwoInputTrainer


def _data(n=96, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    return x, (x[:, 0] + 0.5 * x[:, 1] > 0).astype(np.int32)


def _trained(tmp_path, **kwargs):
    x, y = _data()
    kwargs.setdefault("optimizer_hparams", {"optimizer": "adam", "lr": 1e-2})
    trainer = ClassifyTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [16], "output_dim": 2},
                              exmp_input=x[:1], **quiet(tmp_path, **kwargs))
    trainer.train_model((x, y), (x[:32], y[:32]), num_epochs=3, batch_size=16)
    return trainer, x


def _info(folder):
    return json.loads((folder / "export.json").read_text())


def test_export_of_a_loaded_trainer_serves_the_checkpoint_it_loaded(tmp_path):
    """export() wrote the run's best checkpoint for a trainer loaded from another one (predict and
    test use the loaded one): the artifact was not the model the user had loaded."""
    _, x = _trained(tmp_path, callbacks=[flaxlight.ModelCheckpoint(save_top_k=-1)])  # every epoch's kept
    steps = sorted(int(name) for name in os.listdir(tmp_path / "run" / "checkpoints") if name.isdigit())
    assert len(steps) == 3
    loaded = ClassifyTrainer.load_from_checkpoint(tmp_path / "run" / "checkpoints" / str(steps[0]), exmp_input=x[:1],
                                                  logger_params={"log_dir": str(tmp_path / "eval")})
    served = flaxlight.load_exported(loaded.export(tmp_path / "export"))
    np.testing.assert_allclose(np.asarray(served(x)), loaded.predict(x, batch_size=32), rtol=1e-5, atol=1e-6)
    assert _info(tmp_path / "export")["step"] == steps[0] == loaded.global_step
    assert _info(tmp_path / "export")["which"] == "current"
    last = ClassifyTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=x[:1], which="last",
                                                logger_params={"log_dir": str(tmp_path / "eval_last")})
    last.export(tmp_path / "export_last")
    assert _info(tmp_path / "export_last")["step"] == steps[-1]


def test_export_after_training_still_writes_the_best_checkpoint(tmp_path):
    trainer, x = _trained(tmp_path)
    trainer.export(tmp_path / "export")
    info = _info(tmp_path / "export")
    assert info["which"] == "best" and info["platforms"] == [jax.export.default_export_platform()]  # 'cuda', not 'gpu'


def test_export_after_training_says_when_the_best_checkpoint_is_not_the_current_state(tmp_path, caplog):
    """After training, export() wrote the best checkpoint where predict() uses the state now: the
    two differed (by 0.14 in a trial) with no word of it."""
    with warnings.catch_warnings():  # a monitor read as a score, kept at its worst: the best is the first epoch
        warnings.simplefilter("ignore", UserWarning)
        trainer, x = _trained(tmp_path, monitor="val/loss", mode="max")
    assert trainer.global_step == 18
    with caplog.at_level("INFO", logger="flaxlight"):
        trainer.export(tmp_path / "export")
    assert _info(tmp_path / "export")["step"] == 6
    assert ("export: writing the best checkpoint (step 6), export's default after training (the model test() uses), "
            "not the trainer's current state (step 18), which predict() uses by default. trainer.export(path, "
            "which='current') exports the current state.") in caplog.text
    caplog.clear()
    with caplog.at_level("INFO", logger="flaxlight"), warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        trainer.export(tmp_path / "export_best", which="best")   # asked for: nothing to say
        trainer.export(tmp_path / "export_now", which="current")
        loaded = ClassifyTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=x[:1],
                                                      logger_params={"log_dir": str(tmp_path / "eval")})
        loaded.export(tmp_path / "export_loaded")              # its current state is the checkpoint it loaded
    assert "export: writing" not in caplog.text
    assert _info(tmp_path / "export_loaded")["step"] == 6 and _info(tmp_path / "export_now")["step"] == 18


@pytest.mark.parametrize("model_class, model_hparams, precision", [
    (TinyMLP, {"hidden_dims": [64], "output_dim": 10, "batch_norm": True}, "fp32"),
    (TinyNNX, {"din": 8, "hidden_dims": [64], "output_dim": 10, "batch_norm": True}, "bf16"),
])
def test_the_artifact_serves_predicts_outputs(tmp_path, model_class, model_hparams, precision):
    """export closed over the variables, which XLA folded as constants where predict() takes them
    as arguments: a BatchNorm model's artifact was 2e-7 to 5e-7 from predict() (fp32 and bf16)."""
    x, y = _data()
    trainer = ClassifyTrainer(model_class=model_class, model_hparams=model_hparams, exmp_input=x[:1],
                              optimizer_hparams={"optimizer": "adam", "lr": 1e-2, "precision": precision},
                              **quiet(tmp_path))
    trainer.train_model((x, y), (x[:32], y[:32]), num_epochs=2, batch_size=16)
    expected = trainer.predict(x, batch_size=96)
    served = np.asarray(flaxlight.load_exported(trainer.export(tmp_path / "export", which="current"))(x))
    if jax.default_backend() == "cpu":  # the same machine, the same operations: bit for bit
        np.testing.assert_array_equal(served, expected)
    else:  # programs compiled apart: within float32 rounding (docs/models.md)
        np.testing.assert_allclose(served, expected, rtol=1e-5, atol=1e-6)


def test_an_artifact_exported_for_cpu_and_cuda_from_a_cpu_runs_on_the_cpu(tmp_path):
    """There was no platforms= option: an artifact ran only on the platform it was exported on."""
    trainer, x = _trained(tmp_path)
    written = trainer.export(tmp_path / "export", platforms=("cpu", "cuda"))
    exported = jax.export.deserialize(bytearray(open(written, "rb").read()))
    assert exported.platforms == ("cpu", "cuda")
    assert _info(tmp_path / "export")["platforms"] == ["cpu", "cuda"]
    np.testing.assert_allclose(np.asarray(flaxlight.load_exported(written)(x)),
                               trainer.predict(x, batch_size=32, which="best"), rtol=1e-5, atol=1e-6)
    here = jax.export.default_export_platform()
    elsewhere = "cuda" if here == "cpu" else "cpu"  # on a GPU, an artifact for the CPU alone is the foreign one
    trainer.export(tmp_path / "export_other", platforms=elsewhere)  # one name alone
    with pytest.raises(ValueError, match=f"exported for platforms .*{elsewhere}.* but it is used on .*{here}"):
        flaxlight.load_exported(tmp_path / "export_other")(x)
    with pytest.raises(ValueError, match=r"platforms must name one or more of 'cpu', 'cuda', 'rocm', 'tpu' \('gpu' "
                                         r"is 'cuda' for NVIDIA, 'rocm' for AMD\).*got \('cpu', 'gpu'\)"):
        trainer.export(tmp_path / "bad", platforms=("cpu", "gpu"))
    assert not (tmp_path / "bad").exists()


@pytest.mark.parametrize("batch_size", [0, -1, 2.5, True, "8"])
def test_a_batch_size_that_is_not_a_whole_number_from_1_is_refused(tmp_path, batch_size):
    """0 and 2.5 were accepted (an artifact of batch 0, or 2 for 2.5), -1 gave a raw MLIR error."""
    trainer, _ = _trained(tmp_path)
    with pytest.raises(ValueError, match=rf"export's batch_size must be a whole number >= 1 .* or None \(any batch "
                                         rf"size, the default\); got {batch_size!r}"):
        trainer.export(tmp_path / "export", batch_size=batch_size)
    assert not (tmp_path / "export").exists()
    trainer.export(tmp_path / "export", batch_size=np.int64(4))
    assert _info(tmp_path / "export")["inputs"][0]["shape"] == [4, 8]


class DictInDictOut(nn.Module):
    @nn.compact
    def __call__(self, inputs, train: bool = False):
        h = nn.relu(nn.Dense(8)(inputs["image"]) + nn.Dense(8)(inputs["meta"]))
        return {"logits": nn.Dense(2)(h), "features": h}


class DictTrainer(flaxlight.TrainerModule):
    def loss_fn(self, params, batch, *, train, rng, state):
        inputs, y = batch
        out, updates = state.apply_model(params, inputs, train=train, rng=rng)
        return optax.softmax_cross_entropy_with_integer_labels(out["logits"], y).mean(), ({}, updates)


def test_export_json_names_dict_inputs_and_outputs_and_its_load_line_runs(tmp_path):
    """export.json listed a dict input's and a dict output's leaves without their keys, and its
    load hint called the artifact as call(x), which a dict-input model does not take."""
    x, y = _data()
    inputs = {"image": x[:, :6], "meta": x[:, 6:]}
    trainer = DictTrainer(model_class=DictInDictOut, model_hparams={}, optimizer_hparams={"optimizer": "adam"},
                          exmp_input=jax.tree.map(lambda a: a[:1], inputs), **quiet(tmp_path))
    trainer.train_model((inputs, y), None, num_epochs=1, batch_size=16)
    trainer.export(tmp_path / "export", which="current")
    info = _info(tmp_path / "export")
    assert info["inputs"] == [{"name": "image", "shape": [None, 6], "dtype": "float32"},
                              {"name": "meta", "shape": [None, 2], "dtype": "float32"}]
    assert info["outputs"] == [{"path": "outputs['features']", "shape": [None, 8], "dtype": "float32"},
                               {"path": "outputs['logits']", "shape": [None, 2], "dtype": "float32"}]
    assert info["load"].endswith(".call({'image': image, 'meta': meta})")
    namespace = {"jax": jax, "image": inputs["image"][:5], "meta": inputs["meta"][:5]}
    cwd = os.getcwd()
    try:  # the line as a user pastes it, in the export folder
        os.chdir(tmp_path / "export")
        exec(info["load"], namespace)
    finally:
        os.chdir(cwd)
    expected = trainer.predict(jax.tree.map(lambda a: a[:5], inputs), batch_size=5)
    np.testing.assert_allclose(np.asarray(namespace["outputs"]["logits"]), expected["logits"], rtol=1e-5, atol=1e-6)


def test_export_json_of_a_model_of_two_inputs_calls_it_with_both(tmp_path):
    x, _ = _data()
    trainer = TwoInputTrainer(model_class=TwoInputs, model_hparams={}, optimizer_hparams={"optimizer": "adam"},
                              exmp_input=(x[:1, :5], x[:1, 5:]), **quiet(tmp_path))
    trainer.export(tmp_path / "export", which="current")
    info = _info(tmp_path / "export")
    assert [entry["name"] for entry in info["inputs"]] == ["x0", "x1"]
    assert info["load"].endswith(".call(x0, x1)") and info["outputs"][0]["path"] == "outputs"


def test_loading_a_file_that_is_not_an_artifact_names_it(tmp_path):
    """A text file gave flatbuffers' "unpack_from requires a buffer of at least 1819043180 bytes"."""
    (tmp_path / "notes.txt").write_text("hello")
    with pytest.raises(ValueError, match=r"notes.txt is not a jax.export artifact \(the model.jax_exported file "
                                         r"trainer.export writes.*Give the folder trainer.export wrote"):
        flaxlight.load_exported(tmp_path / "notes.txt")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "model.jax_exported").write_bytes(b"\x00" * 64)
    with pytest.raises(ValueError, match="model.jax_exported is not a jax.export artifact"):
        flaxlight.load_exported(tmp_path / "folder")


def test_export_of_a_bf16_run_computes_as_predict_and_validation_do(tmp_path):
    """export ran the forward pass in fp32 for a precision='bf16' run, whose predict() and
    validation compute in bf16: the served outputs differed from predict's by about 1e-2."""
    trainer, x = _trained(tmp_path, optimizer_hparams={"optimizer": "adam", "lr": 1e-2, "precision": "bf16"})
    expected = trainer.predict(x, batch_size=96, which="best")
    served = flaxlight.load_exported(trainer.export(tmp_path / "export"))
    np.testing.assert_allclose(np.asarray(served(x)), expected, atol=1e-6)
    assert _info(tmp_path / "export")["precision"] == "bf16"
    full = flaxlight.load_exported(trainer.export(tmp_path / "export_fp32", which="current", precision="fp32"))
    state = trainer.state
    np.testing.assert_allclose(np.asarray(full(x)), state.apply_model(state.params, x, train=False)[0],
                               rtol=1e-5, atol=1e-6)
    assert _info(tmp_path / "export_fp32")["precision"] == "fp32"
    with pytest.raises(ValueError, match=r"precision must be one of \('fp32', 'bf16'\) or None \(the run's\); got "
                                         r"'fp16'"):
        trainer.export(tmp_path / "export_fp16", precision="fp16")


def test_cli_export_takes_platforms_and_precision(tmp_path, capsys):
    from pathlib import Path

    from flaxlight import cli

    configs = Path(__file__).resolve().parents[1] / "examples" / "configs"
    run = tmp_path / "sine"
    quiet_cli = ["trainer.enable_progress_bar=false", "trainer.enable_model_summary=false"]
    assert cli.main(["fit", "--config", str(configs / "sine_regression.yaml"), "trainer.max_epochs=1",
                     "trainer.check_val_every_n_epoch=1", "data.batch_size=50", "data.eval_batch_size=500", *quiet_cli,
                     "--log-dir", str(run)]) == 0
    assert cli.main(["export", "--ckpt", str(run), "-o", str(tmp_path / "export"), "--platforms", "cpu,cuda"]) == 0
    assert _info(tmp_path / "export")["platforms"] == ["cpu", "cuda"]
    assert _info(tmp_path / "export")["precision"] == "fp32"  # the run's
    assert cli.main(["export", "--ckpt", str(run), "-o", str(tmp_path / "export_bf16"), "--precision", "bf16"]) == 0
    assert _info(tmp_path / "export_bf16")["precision"] == "bf16"
    capsys.readouterr()
    with pytest.raises(SystemExit) as usage:
        cli.main(["export", "--ckpt", str(run), "--platforms", "cpu,gpu"])
    assert usage.value.code == 2
    assert "expected platforms among cpu, cuda, rocm, tpu" in capsys.readouterr().err
