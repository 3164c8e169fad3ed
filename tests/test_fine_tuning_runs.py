"""Fine-tuning a trained run, as a Lightning or Keras user does it: ``load_from_checkpoint`` then
``train_model``. The run trained into must stay complete (``overwrite=True`` leaves its own
``hparams.yaml``), Lightning's hparam override (``num_classes=5``) must not be kept silently,
``strict`` / ``skip_mismatch`` are refused with the way to a partial load, a fine-tune resumed
before its first checkpoint ends with the records of an uninterrupted one, a head-only shape
mismatch says how to fine-tune (a partial load), not to check ``exmp_input``, optimizer_hparams given
to a load name the run's settings they leave out, and a fine-tune resumed by a plain constructor
keeps the run's seed in its record."""

from __future__ import annotations

import csv
import hashlib
import logging
import shutil
from pathlib import Path

import jax
import pytest
import yaml
from conftest import FailAt, RegressTrainer, TinyMLP, TinyNNX, linear_data

import flaxlight
from flaxlight.callbacks import ModelCheckpoint
from flaxlight.checkpoint import ModelMismatchError

X0 = linear_data(1)[0]
SGD = {"optimizer": "sgd", "lr": 1e-2, "schedule": "constant"}


def _loaders():
    """256 examples: 8 batches of 32 per epoch."""
    return (flaxlight.ArrayLoader(*linear_data(256, 0), batch_size=32, shuffle=True, seed=0),
            flaxlight.ArrayLoader(*linear_data(64, 1), batch_size=32))


def _base(run: Path, num_epochs: int = 3, model_class=TinyMLP, **options) -> RegressTrainer:
    """The source run: 8 steps per epoch."""
    trainer = RegressTrainer(model_class=model_class, model_hparams={"hidden_dims": [8]},
                             optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, exmp_input=X0,
                             logger_params={"log_dir": str(run), "logger_type": "csv"}, enable_progress_bar=False,
                             enable_model_summary=False, **options)
    trainer.train_model(*_loaders(), num_epochs=num_epochs)
    return trainer


def _load(run: Path, **overrides) -> RegressTrainer:
    return RegressTrainer.load_from_checkpoint(run, exmp_input=X0, enable_progress_bar=False, **overrides)


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _rows(run: Path) -> list[dict]:
    """``metrics.csv``'s rows, less the wall-clock epoch_time."""
    with open(run / "metrics.csv") as f:
        return [{key: value for key, value in row.items() if key != "epoch_time" and value} for row in csv.DictReader(f)]


def _steps(run: Path) -> list[int]:
    folder = run / "checkpoints"
    return sorted(int(name.name) for name in folder.iterdir() if name.name.isdigit()) if folder.is_dir() else []


# ----------------------------------------------------------------- 1. overwrite=True leaves a complete run
def test_overwrite_on_a_trainer_loaded_from_its_own_run_writes_the_new_runs_hparams(tmp_path):
    """The Lightning user's fine-tune with no log_dir, then overwrite=True as the refusal allows: the
    run's hparams.yaml was deleted and never written again, so nothing could load the new run."""
    run = tmp_path / "run"
    _base(run, num_epochs=2)
    tuned = _load(run, which="last", optimizer_hparams=SGD)
    tuned.train_model(*_loaders(), num_epochs=1, overwrite=True)
    assert tuned.global_step == 24 and _steps(run) == [24]
    recorded = yaml.safe_load((run / "hparams.yaml").read_text())
    assert recorded["optimizer_hparams"]["optimizer"] == "sgd"  # the new run's, not the replaced one's
    again = _load(run, which="last")  # the new run loads, with its own settings
    assert again.global_step == 24 and again.optimizer_hparams["optimizer"] == "sgd"
    assert [row["step"] for row in _rows(run)] == ["24", "24"]  # its epoch's train and val rows only


@pytest.mark.filterwarnings("ignore:the trainer. monitor='val/loss' with mode='max':UserWarning")
def test_training_into_the_run_a_trainer_was_loaded_from_is_refused_naming_the_fine_tune_way(tmp_path):
    """No log_dir given (Lightning would start a new version_N): the refusal said only "resume=True
    ... or overwrite=True", and overwrite=True deletes the checkpoint being fine-tuned from."""
    run = tmp_path / "run"
    with pytest.warns(UserWarning, match="reads as a metric to minimize"):  # the best: epoch 1's (step 8)
        _base(run, num_epochs=2, monitor="val/loss", mode="max")
    before = _digests(run)
    tuned = _load(run, optimizer_hparams=SGD)
    assert tuned.global_step == 8
    with pytest.raises(FileExistsError) as refused:
        tuned.train_model(*_loaders(), num_epochs=1)
    message = str(refused.value)
    assert "To fine-tune" in message and "logger_params={'log_dir': <a new folder>}" in message
    assert f"load_from_checkpoint({str(run / 'checkpoints' / '8')!r}" in message
    assert "resume=True" in message and "step 16, not the loaded model of step 8" in message
    assert "overwrite=True deletes the run being loaded from: its checkpoints (step 8 among them), hparams.yaml" in message
    assert _digests(run) == before
    copy = _load(run / "checkpoints" / "8", optimizer_hparams=SGD, logger_params={"log_dir": str(tmp_path / "ft")})
    copy.train_model(*_loaders(), num_epochs=1)  # the way it names works, and the source stays as it was
    assert copy.global_step == 16 and (tmp_path / "ft" / "hparams.yaml").is_file() and _digests(run) == before


def test_overwrite_after_load_model_set_the_model_back_replaces_the_run(tmp_path):
    """The refusal of a second branch names overwrite=True "to replace the run"; it wrote the new
    branch over the old one instead (checkpoint 48 and the old epochs' rows stayed)."""
    run = tmp_path / "run"
    with pytest.warns(UserWarning, match="reads as a metric to minimize"):
        trainer = _base(run, num_epochs=6, callbacks=[ModelCheckpoint(monitor="val/loss", mode="max")])
    trainer.load_model()  # the best: the first epoch's (step 8)
    with pytest.raises(FileExistsError, match=r"(?s)later checkpoints \(48\).*pass overwrite=True to replace the run"):
        trainer.train_model(*_loaders(), num_epochs=2)
    trainer.train_model(*_loaders(), num_epochs=2, overwrite=True)
    assert trainer.global_step == 24
    assert max(_steps(run)) == 24 and 48 not in _steps(run)
    assert [int(row["step"]) for row in _rows(run)] == [16, 16, 24, 24]
    assert sorted(p.name for p in (run / "metrics").glob("eval_*.json")) == ["eval_epoch_002.json",
                                                                           "eval_epoch_003.json"]
    assert (run / "hparams.yaml").is_file() and _load(run, which="last").global_step == 24


def test_overwrite_on_a_trainer_at_its_runs_newest_step_goes_on_in_its_run(tmp_path):
    """The guard: a trainer that wrote its run, at its newest step, continues it (nothing replaced)."""
    run = tmp_path / "run"
    trainer = _base(run, num_epochs=1)
    trainer.train_model(*_loaders(), num_epochs=1, overwrite=True)
    assert _steps(run)[-1] == 16 and [row["step"] for row in _rows(run)] == ["8", "8", "16", "16"]


# ----------------------------------------------------------------- 4. Lightning's and Keras' keywords at load
def test_a_model_hparam_given_to_load_from_checkpoint_is_the_models(tmp_path, caplog):
    """load_from_checkpoint(run, num_classes=5) kept the saved model and recorded num_classes as an
    extra hparam that nothing read; as in Lightning, it now builds the model with it."""
    run = tmp_path / "run"
    _base(run, num_epochs=1)
    with caplog.at_level(logging.INFO, logger="flaxlight"):
        tuned = _load(run, dropout_prob=0.5, logger_params={"log_dir": str(tmp_path / "ft")})
    assert tuned.model_hparams == {"hidden_dims": [8], "dropout_prob": 0.5}
    assert "dropout_prob" not in tuned.extra_hparams and "dropout_prob=0.5, an argument of the model TinyMLP" in caplog.text
    tuned.train_model(*_loaders(), num_epochs=1)
    recorded = yaml.safe_load((tmp_path / "ft" / "hparams.yaml").read_text())
    assert recorded["model_hparams"] == {"hidden_dims": [8], "dropout_prob": 0.5} and "dropout_prob" not in recorded


def test_a_trainer_setting_the_run_saved_stays_the_trainers_though_the_model_has_that_name(tmp_path):
    """A run saved dropout_prob=0.1 beside model_hparams (the trainer's own extra hparam): an override
    of it went into model_hparams, where the trainer kept 0.1 (review)."""
    run = tmp_path / "run"
    _base(run, num_epochs=1, dropout_prob=0.1)
    tuned = _load(run, dropout_prob=0.3, logger_params={"log_dir": str(tmp_path / "ft")})
    assert tuned.extra_hparams["dropout_prob"] == 0.3 and tuned.model_hparams == {"hidden_dims": [8]}


def test_a_model_hparam_that_changes_the_head_fails_loudly_with_the_fine_tuning_way(tmp_path):
    """output_dim=3 (a new head) trained the old 1-output head and recorded output_dim: 3."""
    run = tmp_path / "run"
    _base(run, num_epochs=1)
    with pytest.raises(ModelMismatchError) as raised:
        _load(run, output_dim=3, logger_params={"log_dir": str(tmp_path / "ft")})
    message = str(raised.value)
    assert "params/Dense_1/bias: checkpoint (1,), model (3,)" in message
    assert "layers Dense_0 fit the checkpoint; only Dense_1 differs" in message
    assert 'docs/models.md, section "Fine-tuning"' in message
    assert "exmp_input" not in message  # the input is not at fault when only output sizes differ


def test_a_model_hparam_beside_model_hparams_is_refused_naming_one_dict(tmp_path):
    run = tmp_path / "run"
    _base(run, num_epochs=1)
    with pytest.raises(TypeError, match=r"output_dim=3, an argument of the model TinyMLP, and model_hparams=.*"
                                        r"model_hparams=\{'hidden_dims': \[8\], 'output_dim': 3\}"):
        _load(run, output_dim=3, model_hparams={"hidden_dims": [8]})


@pytest.mark.parametrize("keyword", [{"strict": False}, {"skip_mismatch": True}, {"strict": True}])
def test_partial_load_keywords_are_refused_naming_the_recipe(tmp_path, keyword):
    """strict=False (Lightning) and skip_mismatch=True (Keras) were kept as extra hparams and did nothing."""
    run = tmp_path / "run"
    _base(run, num_epochs=1)
    before = _digests(run)
    with pytest.raises(TypeError) as refused:
        _load(run, model_hparams={"hidden_dims": [8], "output_dim": 3}, **keyword)
    message = str(refused.value)
    assert f"{next(iter(keyword))}={next(iter(keyword.values()))!r}" in message
    assert 'docs/models.md, section "Fine-tuning"' in message and "restores every parameter" in message
    assert _digests(run) == before


def test_lightnings_other_load_keywords_are_refused_naming_what_to_do_instead(tmp_path):
    """map_location='cpu', hparams_file=..., weights_only=True were kept as extra hparams and did nothing."""
    run = tmp_path / "run"
    _base(run, num_epochs=1)
    before = _digests(run)
    for keyword, instead in (("map_location", "with jax.default_device(jax.devices('cpu')[0]): trainer = "),
                             ("hparams_file", "give the settings that should differ as keywords instead"),
                             ("weights_only", "never pickles")):
        with pytest.raises(TypeError, match=rf"load_from_checkpoint got {keyword}=.*Lightning's load_from_checkpoint") \
                as refused:
            _load(run, **{keyword: "cpu"})
        assert instead in str(refused.value) and _digests(run) == before
    with jax.default_device(jax.devices("cpu")[0]):  # the recipe map_location='cpu' is told
        loaded = _load(run)
    assert {device.platform for leaf in jax.tree.leaves(loaded.state.params) for device in leaf.devices()} == {"cpu"}


# ----------------------------------------------------------------- 5. a fine-tune resumed before its first checkpoint
def test_a_fine_tune_resumed_before_its_first_checkpoint_ends_with_an_uninterrupted_runs_records(tmp_path, caplog):
    """The failed attempt's epoch rows were kept and the resumed run wrote them again (duplicate rows
    at step 32); a fresh run in the same situation had clean records."""
    run = tmp_path / "run"
    _base(run, num_epochs=3)  # the best and last: step 24

    def fine_tune(folder, *callbacks, resume=False):
        tuned = _load(run, which="last", optimizer_hparams=SGD, logger_params={"log_dir": str(folder)},
                      callbacks=[ModelCheckpoint(every_n_epochs=5, save_top_k=0), *callbacks])
        tuned.train_model(*_loaders(), num_epochs=3, resume=resume)
        return tuned

    fine_tune(tmp_path / "straight")
    with pytest.raises(RuntimeError, match="data error at step 35"):
        fine_tune(tmp_path / "cut", FailAt(35))  # in its 2nd epoch, with no checkpoint of its own yet
    assert not _steps(tmp_path / "cut") and [row["step"] for row in _rows(tmp_path / "cut")] == ["32", "32"]
    with caplog.at_level(logging.INFO, logger="flaxlight"):
        resumed = fine_tune(tmp_path / "cut", resume=True)
    assert resumed.global_step == 48
    assert _rows(tmp_path / "cut") == _rows(tmp_path / "straight")
    aside = tmp_path / "cut" / "abandoned" / "after_step_24"
    assert [row["step"] for row in _rows(aside)] == ["32", "32"] and "set aside in" in caplog.text
    assert sorted(p.name for p in (tmp_path / "cut" / "metrics").iterdir()) == \
        sorted(p.name for p in (tmp_path / "straight" / "metrics").iterdir())


# ----------------------------------------------------------------- 7. the mismatch message for fine-tuning
def test_an_nnx_models_mismatch_gives_no_exmp_input_note(tmp_path):
    """NNX models take their input sizes from model_hparams, not from exmp_input: the note that a
    wrong exmp_input may be at fault was wrong there."""
    run = tmp_path / "run"
    _base(run, num_epochs=1, model_class=TinyNNX)
    with pytest.raises(ModelMismatchError) as raised:
        _load(run, model_hparams={"hidden_dims": [8], "output_dim": 3})
    assert "exmp_input" not in str(raised.value) and "hparams.yaml" in str(raised.value)
    with pytest.raises(TypeError, match="dot_general") as raised:  # an input size exmp_input does not fit: when built
        _load(run, model_hparams={"hidden_dims": [8], "din": 6})
    assert "flaxlight: TinyNNX(hidden_dims=[8], din=6) cannot be called on exmp_input" in raised.value.__notes__[-1]
    head = _load_error(run, {"hidden_dims": [8], "output_dim": 3})
    assert "params/head/kernel: checkpoint (8, 1), model (8, 3)" in head and "only head differs" in head
    assert "Fine-tuning" in head


def _load_error(run: Path, model_hparams: dict) -> str:
    with pytest.raises(ModelMismatchError) as raised:
        _load(run, model_hparams=model_hparams)
    return str(raised.value)


def test_a_linen_models_wrong_exmp_input_is_still_named(tmp_path):
    """The guard: a Linen model's first layer shaped from a wrong exmp_input keeps its note."""
    run = tmp_path / "run"
    _base(run, num_epochs=1)
    with pytest.raises(ModelMismatchError, match=r"(?s)Dense_0/kernel: checkpoint \(4, 8\), model \(1, 8\).*"
                                                 r"x\[0\] instead of x\[:1\]"):
        RegressTrainer.load_from_checkpoint(run, exmp_input=X0[0])


# ----------------------------------------------------------------- an optimizer override with or without ema_decay
def _same_params(a, b) -> bool:
    import jax
    import numpy as np
    return all(np.array_equal(x, y) for x, y in zip(jax.tree.leaves(a.state.params), jax.tree.leaves(b.state.params)))


def test_a_fine_tune_adding_ema_decay_loads_the_runs_weights_and_trains(tmp_path):
    """The run kept no average: optimizer_hparams with ema_decay failed "holds the state of a different
    optimizer" (and advised with_optimizer=False, the default); its weights load and train now."""
    _base(tmp_path / "run", num_epochs=2)
    tuned = _load(tmp_path / "run", optimizer_hparams={**SGD, "ema_decay": 0.9},
                  logger_params={"log_dir": str(tmp_path / "ft")})
    assert _same_params(tuned, _load(tmp_path / "run"))
    tuned.train_model(*_loaders(), num_epochs=1)
    assert tuned.global_step == 24


def test_a_fine_tune_of_an_ema_run_with_another_optimizer_starts_from_the_average_the_run_validated(tmp_path):
    """The run's validation (and its best checkpoint's score) measured its moving average: a load with
    another optimizer took the raw weights instead."""
    run = tmp_path / "run"
    RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=X0,
                   optimizer_hparams={"optimizer": "adam", "lr": 1e-2, "ema_decay": 0.9},
                   logger_params={"log_dir": str(run), "logger_type": "csv"}, enable_progress_bar=False,
                   enable_model_summary=False).train_model(*_loaders(), num_epochs=2)
    served = _load(run)  # the run's own optimizer: its average
    tuned = _load(run, optimizer_hparams=SGD, logger_params={"log_dir": str(tmp_path / "ft")})
    assert _same_params(tuned, served) and tuned.optimizer_hparams == SGD
    assert tuned.eval_model(_loaders()[1])["loss"] == served.eval_model(_loaders()[1])["loss"]
    tuned.train_model(*_loaders(), num_epochs=1)
    assert tuned.global_step == 24


def _my_schedule(count):
    return 1e-2 * 0.99 ** count


def test_an_ema_run_with_a_schedule_of_yours_loaded_with_its_settings_again_serves_the_average(tmp_path, caplog):
    """hparams.yaml records the function by name: the settings given again stand for it (the load served
    the raw weights; review). Loading with another optimizer says nothing of the run's own (it warned of
    an L2 penalty and bf16 missing from "your step")."""
    hparams = {"optimizer": "adam", "schedule": _my_schedule, "ema_decay": 0.5}
    run = tmp_path / "run"
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=X0,
                             optimizer_hparams=hparams, logger_params={"log_dir": str(run), "logger_type": "csv"},
                             enable_progress_bar=False, enable_model_summary=False)
    trainer.train_model(*_loaders(), num_epochs=1)
    average = flaxlight.ema_params(trainer.state)
    loaded = _load(run, which="last", optimizer_hparams=hparams)
    import jax
    import numpy as np
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(loaded.state.params), jax.tree.leaves(average)))
    with caplog.at_level(logging.WARNING, logger="flaxlight"):
        _load(run, which="last", optimizer_hparams={**SGD, "weight_decay": 1e-3, "weight_decay_mode": "l2",
                                                    "precision": "bf16"}, logger_params={"log_dir": str(tmp_path / "f")})
    assert "your own" not in caplog.text.lower() and "step" not in caplog.text


# ----------------------------------------------------------------- 8. what a fine-tune keeps of the run's settings
BF16_FROZEN = {"optimizer": "adamw", "lr": 1e-2, "weight_decay": 1e-2, "freeze": ["Dense_0"], "precision": "bf16"}


def test_optimizer_hparams_given_to_a_load_name_the_run_settings_they_leave_out(tmp_path, caplog):
    """optimizer_hparams={'lr': 1e-4} on a bf16 run with freeze trained in fp32 with nothing frozen,
    and nothing said: they replace the run's whole (kept so), and now an info line says what is left out."""
    run = tmp_path / "run"
    RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, optimizer_hparams=BF16_FROZEN,
                   exmp_input=X0, logger_params={"log_dir": str(run), "logger_type": "csv"},
                   enable_progress_bar=False, enable_model_summary=False).train_model(*_loaders(), num_epochs=1)
    with caplog.at_level(logging.INFO, logger="flaxlight"):
        tuned = _load(run, optimizer_hparams={"lr": 1e-3}, logger_params={"log_dir": str(tmp_path / "ft")})
    said = " ".join(line for line in caplog.text.splitlines() if "replace the run's" in line)
    assert tuned.optimizer_hparams == {"lr": 1e-3}  # replaced whole, as documented
    assert "precision='bf16' (now 'fp32')" in said and "freeze=['Dense_0'] (now [])" in said
    assert "weight_decay=0.01 (now 0.0001)" in said
    assert "optimizer=" not in said and "lr=0.01" not in said and "schedule=" not in said  # given, or the same now
    old = yaml.safe_load((run / "hparams.yaml").read_text())["optimizer_hparams"]
    assert f"yaml.safe_load(open({str(run / 'hparams.yaml')!r}))['optimizer_hparams']" in said
    assert "optimizer_hparams={**old, 'lr': 0.001}" in said
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="flaxlight"):
        kept = _load(run, optimizer_hparams={**old, "lr": 1e-3}, logger_params={"log_dir": str(tmp_path / "ft2")})
    assert "replace the run's" not in caplog.text  # the recipe said keeps them all
    kept.train_model(*_loaders(), num_epochs=1)
    recorded = yaml.safe_load((tmp_path / "ft2" / "hparams.yaml").read_text())["optimizer_hparams"]
    assert recorded == {**old, "lr": 1e-3}


def test_a_fine_tune_resumed_by_a_plain_constructor_keeps_the_runs_seed_and_says_why(tmp_path, caplog):
    """It warned "settings differ (seed: 0 -> 42; enable_model_summary: False -> None): they apply from
    now on" and recorded seed 42: the keys come from the checkpoint (seed changes nothing), and
    enable_model_summary=False was load_from_checkpoint's, never the user's. The resume message
    counted the model's epochs, the progress lines and num_epochs the run's."""
    run, ft = tmp_path / "run", tmp_path / "ft"
    dropout = {"hidden_dims": [8], "dropout_prob": 0.2}  # random keys at every step
    RegressTrainer(model_class=TinyMLP, model_hparams=dropout, optimizer_hparams=SGD, exmp_input=X0, seed=0,
                   logger_params={"log_dir": str(run), "logger_type": "csv"}, enable_progress_bar=False,
                   enable_model_summary=False).train_model(*_loaders(), num_epochs=2)
    _load(run, logger_params={"log_dir": str(ft)}).train_model(*_loaders(), num_epochs=1)
    assert "enable_model_summary" not in (ft / "hparams.yaml").read_text()
    shutil.copytree(ft, tmp_path / "ft_seed0")

    def resume(folder, **seed):
        trainer = RegressTrainer(model_class=TinyMLP, model_hparams=dropout, optimizer_hparams=SGD, exmp_input=X0,
                                 logger_params={"log_dir": str(folder), "logger_type": "csv"},
                                 enable_progress_bar=False, **seed)
        trainer.train_model(*_loaders(), num_epochs=2, resume=True)
        return trainer

    with caplog.at_level(logging.INFO, logger="flaxlight"):
        plain = resume(ft)  # the default seed, 42
    said = " ".join(caplog.text.split())
    assert "settings differ" not in said and not list(ft.glob("hparams.*.yaml"))
    assert yaml.safe_load((ft / "hparams.yaml").read_text())["seed"] == 0  # the seed the run's keys come from
    assert "go on from its checkpoint 24, so seed=42 changes none of them, and hparams.yaml keeps the run's seed, 0" \
        in said
    assert "(the end of epoch 1; the model's epoch 3, after the 2 it trained before this run)" in said
    assert _same_params(plain, resume(tmp_path / "ft_seed0", seed=0))  # the seed given changed nothing
