"""A PyTorch Lightning user's spellings: Trainer arguments, callback hooks and ModelCheckpoint
arguments flaxlight writes otherwise are refused (or warned of) with flaxlight's way; what it
shares with Lightning (``every_n_epochs`` with ``save_top_k=-1``, ``best_model_path``) behaves so."""

import json
import os
import re
import warnings

import jax
import numpy as np
import pytest
from conftest import RegressTrainer, TinyMLP, linear_data, quiet

import flaxlight
from flaxlight.callbacks import ModelCheckpoint

X0 = np.zeros((1, 4), np.float32)
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _trainer(tmp_path, trainer_class=RegressTrainer, **kwargs):
    kwargs.setdefault("optimizer_hparams", {"optimizer": "adam", "lr": 1e-2})
    return trainer_class(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=X0,
                         **quiet(tmp_path, **kwargs))


def _steps(trainer):
    folder = os.path.join(trainer.log_dir, "checkpoints")
    return sorted(int(name) for name in os.listdir(folder) if name.isdigit())


# ---------------------------------------------------------------- Trainer arguments (finding 4)
@pytest.mark.parametrize("key, value, written", [
    ("max_epochs", 3, "trainer.train_model(train_loader, val_loader, num_epochs=3)"),
    ("accumulate_grad_batches", 4, "optimizer_hparams={..., 'accumulate_grad_batches': 4}"),
    ("gradient_clip_val", 0.5, "optimizer_hparams={..., 'gradient_clip': 0.5}"),
    ("precision", "bf16-mixed", "optimizer_hparams={..., 'precision': 'bf16'}"),
    ("deterministic", True, "XLA_FLAGS=--xla_gpu_deterministic_ops=true"),
    ("deterministic", True, "bit for bit, on the same machine with the same number of cores"),  # not across
    ("precision", 16, "fp16 ('16-mixed') is not offered: bf16 has float32's range and needs no loss scaling"),
    ("min_epochs", 2, "flaxlight has no minimum number of epochs"),
    ("num_sanity_val_steps", 0, "check_batches=False"),
    ("default_root_dir", "/tmp/x", "logger_params={'base_log_dir': '/tmp/x'}"),
    ("limit_test_batches", 10, "it is test()'s steps=N (batches to test on): trainer.test(data, steps=N)"),
    ("limit_predict_batches", 10, "it is predict()'s steps=N (batches to take): trainer.predict(data, steps=N)"),
])
def test_a_lightning_trainer_argument_is_refused_with_what_flaxlight_writes(tmp_path, key, value, written):
    with pytest.raises(TypeError) as caught:
        _trainer(tmp_path, **{key: value})
    message = str(caught.value)
    assert message.startswith(f"RegressTrainer got {key}={value!r}, an argument of Lightning's Trainer and none "
                              f"of flaxlight's: ")
    assert written in message and "Did you mean" not in message
    assert not (tmp_path / "run").exists()


def test_what_a_refusal_says_to_write_works_and_other_keywords_are_still_kept(tmp_path, regression_loaders, capsys,
                                                                              caplog):
    train, val, _ = regression_loaders
    with pytest.raises(TypeError, match="gradient_clip_val=0.5, an argument of Lightning's Trainer"):
        _trainer(tmp_path, gradient_clip_val=0.5, teacher="small")
    trainer = _trainer(tmp_path, optimizer_hparams={"optimizer": "adam", "lr": 1e-2, "accumulate_grad_batches": 2,
                                                    "gradient_clip": 0.5, "precision": "bf16"},
                       logger_params={"base_log_dir": str(tmp_path / "runs")}, check_batches=False, teacher="small")
    assert trainer.extra_hparams == {"teacher": "small"}  # a keyword of the user's own, as before
    assert "extra hparams kept in the run's config (no trainer option reads them): teacher." in capsys.readouterr().err
    trainer.train_model(train, val, num_epochs=2)
    assert trainer.current_epoch == 2 and trainer.log_dir.startswith(str(tmp_path / "runs"))
    # A run recorded before the refusal, with max_epochs among its extra hparams, still loads.
    hparams = os.path.join(trainer.log_dir, "hparams.yaml")
    with open(hparams, "a") as f:
        f.write("max_epochs: 3\n")
    with caplog.at_level("INFO", logger="flaxlight"):
        loaded = RegressTrainer.load_from_checkpoint(trainer.log_dir, exmp_input=X0)
    assert loaded.extra_hparams == {"teacher": "small"}
    assert "hparams.yaml holds max_epochs, Lightning's Trainer argument(s)" in caplog.text
    # "on CPU the same seeds give the same parameters, bit for bit" (what deterministic=True is told)
    twins = [_trainer(tmp_path / str(i), enable_checkpointing=False) for i in range(2)]
    for twin in twins:
        twin.train_model(train, val, num_epochs=1)
    for a, b in zip(*(jax.tree_util.tree_leaves(twin.state.params) for twin in twins)):
        np.testing.assert_array_equal(a, b)
    # The config's spelling of the same Lightning keys is still refused there, with its own hint.
    from flaxlight.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=r"trainer\.gradient_clip_val'\. In flaxlight that is optimizer\.gradient_clip"):
        load_config({"trainer": {"name": "regression", "gradient_clip_val": 0.5}, "model": {"name": "mlp_regressor"},
                     "data": {"name": "sine"}})


class Decoding(RegressTrainer):
    """A trainer of the user's with its own hparam named as a Lightning Trainer argument, passed up so
    that the run records it (hparams.yaml) and load_from_checkpoint gives it back."""

    def __init__(self, *args, strategy="greedy", **kwargs):
        super().__init__(*args, strategy=strategy, **kwargs)
        self.strategy = strategy


class MoreDecoding(Decoding):  # declares nothing itself: its base's keyword is still its own
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)


def test_a_lightning_name_the_trainer_class_declares_is_its_own_hparam(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path, trainer_class=Decoding, strategy="beam")
    assert trainer.strategy == "beam" and trainer.extra_hparams == {"strategy": "beam"}
    trainer.train_model(train, val, num_epochs=1)
    assert Decoding.load_from_checkpoint(trainer.log_dir, exmp_input=X0).strategy == "beam"
    assert _trainer(tmp_path / "more", trainer_class=MoreDecoding, strategy="beam").extra_hparams == {
        "strategy": "beam"}
    with pytest.raises(TypeError, match="RegressTrainer got strategy='beam', an argument of Lightning's Trainer"):
        _trainer(tmp_path / "plain", strategy="beam")  # a class that does not declare it: refused as before


def test_an_older_run_recording_a_declared_lightning_name_loads_with_it(tmp_path, regression_loaders, caplog):
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path)
    trainer.train_model(train, val, num_epochs=1)
    with open(os.path.join(trainer.log_dir, "hparams.yaml"), "a") as f:  # as Decoding's run recorded it before
        f.write("strategy: beam\n")
    with caplog.at_level("INFO", logger="flaxlight"):
        loaded = Decoding.load_from_checkpoint(trainer.log_dir, exmp_input=X0)
    assert loaded.strategy == "beam" and loaded.extra_hparams == {"strategy": "beam"}
    assert "Lightning's Trainer argument" not in caplog.text


# ---------------------------------------------------------------- callback hooks (finding 6)
def test_lightning_hook_names_are_warned_of_at_construction_with_the_hook_to_use(tmp_path):
    class Ported(flaxlight.Callback):
        def on_train_start(self, trainer, pl_module=None): ...
        def on_train_batch_end(self, trainer, *args): ...
        def on_validation_epoch_end(self, trainer, *args): ...
        def on_save_checkpoint(self, trainer, *args): ...
        def on_validaton_end(self, trainer, epoch, metrics): ...  # misspelt
        def on_validation_end(self, trainer, epoch, metrics): ...  # flaxlight's: no warning

    class Fine(flaxlight.Callback):  # hooks as flaxlight declares them, other signatures that fit: nothing said
        every_n_steps = 1

        def on_step(self, trainer, step): ...
        def on_train_epoch_end(self, trainer, epoch, metrics=None): ...
        def on_validation_end(self, trainer, *args): ...
        def on_fit_end(self, trainer, **extra): ...

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(tmp_path, callbacks=[Ported(), Fine()])
    said = sorted(str(w.message) for w in caught if "is never called" in str(w.message))
    assert len(said) == 5 and not any("Fine" in str(w.message) for w in caught)
    assert ("Ported.on_train_batch_end is never called: flaxlight.Callback has no hook 'on_train_batch_end' "
            "(Lightning's). Use on_step(trainer, step) with the class attribute every_n_steps = 1") in said[1]
    assert said[2].endswith("Use on_fit_start(trainer).")
    assert said[3].endswith("Use on_validation_end(trainer, epoch, metrics).")
    assert "Use state_dict(): what it returns is saved in every checkpoint" in said[0]
    assert said[4].endswith("no hook 'on_validaton_end'. Did you mean 'on_validation_end'? (A method of yours that "
                            "your hooks call, not meant as 'on_validation_end': name it less like it.)")
    assert all(w.filename == __file__ for w in caught if "is never called" in str(w.message))


def test_a_helper_named_on_something_is_left_alone(tmp_path, regression_loaders):
    """A callback's own on_* helper, called by its hooks, is no misspelt hook: nothing is said, so the
    trainer is built under -W error too."""
    train, val, _ = regression_loaders

    class Improvements(flaxlight.Callback):
        def __init__(self):
            self.best, self.improved_at = None, []

        def on_validation_end(self, trainer, epoch, metrics):
            if self.best is None or metrics["val/loss"] < self.best:
                self.on_improvement(trainer, metrics["val/loss"])

        def on_improvement(self, trainer, loss):
            self.best = loss
            self.improved_at.append(trainer.global_step)

    callback = Improvements()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer = _trainer(tmp_path, callbacks=[callback])
    trainer.train_model(train, val, num_epochs=2)
    assert callback.improved_at[0] == 8


def test_a_hook_whose_pl_module_defaults_is_called_with_the_default(tmp_path, regression_loaders):
    train, val, _ = regression_loaders

    class DualUse(flaxlight.Callback):  # Lightning's call or flaxlight's
        def on_fit_start(self, trainer, pl_module=None):
            self.given = pl_module

    class EpochFirst(flaxlight.Callback):  # flaxlight's call would give pl_module the epoch: refused
        def on_train_epoch_start(self, trainer, pl_module=None): ...

    callback = DualUse()
    _trainer(tmp_path, callbacks=[callback]).train_model(train, val, num_epochs=1)
    assert callback.given is None
    with pytest.raises(TypeError, match=r"EpochFirst\.on_train_epoch_start\(trainer, pl_module=None\) cannot take what "
                                        r"flaxlight passes: it calls on_train_epoch_start\(trainer, epoch\)\. It is "
                                        r"written as Lightning's hook"):
        _trainer(tmp_path / "other", callbacks=[EpochFirst()])


@pytest.mark.parametrize("hook, signature, expected", [
    ("on_train_epoch_end", "(self, trainer, pl_module)", "on_train_epoch_end(trainer, epoch, metrics)"),
    ("on_fit_start", "(self, trainer, pl_module)", "on_fit_start(trainer)"),
    ("on_train_epoch_start", "(self, trainer, pl_module)", "on_train_epoch_start(trainer, epoch)"),  # same arity
    ("on_validation_end", "(self, trainer)", "on_validation_end(trainer, epoch, metrics)"),
])
def test_a_hook_with_another_signature_is_refused_before_training(tmp_path, hook, signature, expected):
    namespace = {}
    exec(f"def {hook}{signature}: pass", namespace)
    Ported = type("Ported", (flaxlight.Callback,), {hook: namespace[hook]})
    with pytest.raises(TypeError) as caught:
        _trainer(tmp_path, callbacks=[Ported()])
    message = str(caught.value)
    plain = signature.replace("self, ", "")
    assert message.startswith(f"Ported.{hook}{plain} cannot take what flaxlight passes: it calls {expected}.")
    assert f"Write def {expected.replace('(', '(self, ')}" in message
    assert ("in flaxlight the trainer is both" in message) == ("pl_module" in signature)
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- every_n_epochs with save_top_k=-1 (finding 5)
class FirstIsBest(RegressTrainer):
    def is_new_model_better(self, new_metrics, old_metrics):
        return old_metrics is None


class LatestIsBest(RegressTrainer):
    def is_new_model_better(self, new_metrics, old_metrics):
        return True


@pytest.mark.parametrize("trainer_class, kept", [(LatestIsBest, [16, 32]), (FirstIsBest, [8, 16, 32])])
def test_every_n_epochs_with_save_top_k_minus_one_keeps_those_epochs_and_the_best(tmp_path, regression_loaders,
                                                                                  trainer_class, kept):
    """8 steps per epoch, 4 epochs, validation at each: Lightning keeps epochs 2 and 4; flaxlight
    also keeps the best while it is the best (test() and which="best" load it)."""
    train, val, _ = regression_loaders
    checkpoint = ModelCheckpoint(every_n_epochs=2, save_top_k=-1)
    trainer = _trainer(tmp_path, trainer_class=trainer_class, callbacks=[checkpoint])
    trainer.train_model(train, val, num_epochs=4)
    assert _steps(trainer) == kept
    assert checkpoint.best_step == (8 if trainer_class is FirstIsBest else 32)
    assert trainer.test(val, which="best")  # the best checkpoint is there to test


def test_every_n_steps_with_save_top_k_minus_one_keeps_those_steps_not_each_validation(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path, trainer_class=FirstIsBest,
                       callbacks=[ModelCheckpoint(every_n_steps=12, save_top_k=-1, save_last=False)])
    trainer.train_model(train, val, num_epochs=4)  # validations at 8, 16, 24, 32; the first is the best
    assert _steps(trainer) == [8, 12, 24]


class LogScore(flaxlight.Callback):
    """Logs ``val/err`` = ``scores[epoch]`` at each validation (ModelCheckpoint ranks by it)."""

    def __init__(self, scores):
        self.scores = scores

    def on_validation_end(self, trainer, epoch, metrics):
        trainer.log_metrics({"val/err": self.scores[epoch]})


def _scored_trainer(tmp_path, scores):
    checkpoint = ModelCheckpoint(monitor="val/err", every_n_epochs=2, save_top_k=-1)
    return _trainer(tmp_path, callbacks=[LogScore(scores), checkpoint], monitor="val/err"), checkpoint


def test_a_rewind_to_a_snapshot_finds_the_best_its_ranking_names(tmp_path, regression_loaders):
    """Epoch 1's checkpoint (step 8) is the best when epoch 2's snapshot (16) is written, and is beaten
    at epoch 3: 16's saved ranking names 8, so 8 stays, and a rewind to 16 finds and tests it."""
    train, val, _ = regression_loaders
    scores = {1: 1.0, 2: 5.0, 3: 0.5, 4: 3.0}
    trainer, checkpoint = _scored_trainer(tmp_path, scores)
    trainer.train_model(train, val, num_epochs=4)
    assert _steps(trainer) == [8, 16, 24, 32] and checkpoint.best_step == 24
    scores.update({3: 9.0, 4: 9.0})  # the rewound run's epochs 3 and 4 do worse
    rewound, checkpoint = _scored_trainer(tmp_path, scores)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rewound.train_model(train, val, num_epochs=4, resume_from=str(tmp_path / "run" / "checkpoints" / "16"))
        tested = rewound.test(val)
    assert checkpoint.best_step == 8 and checkpoint.best_model_score == 1.0
    assert checkpoint.best_model_path == str(tmp_path / "run" / "checkpoints" / "8")
    assert os.path.isdir(checkpoint.best_model_path)
    assert not [w for w in caught if "best checkpoint" in str(w.message)]
    best = RegressTrainer.load_from_checkpoint(checkpoint.best_model_path, exmp_input=X0)
    assert best.global_step == 8 and best.test(val)["test/loss"] == pytest.approx(tested["test/loss"])


# ---------------------------------------------------------------- ModelCheckpoint's Lightning names (finding 7)
@pytest.mark.parametrize("key, value, written", [
    ("every_n_train_steps", 100, "It is Lightning's; in flaxlight: every_n_steps=100."),
    ("dirpath", "ckpts", "choose the run's folder with the trainer's logger_params={'log_dir': 'ckpts'}"),
    ("filename", "{epoch}-{val_loss:.2f}", "checkpoints are named by their step, <log_dir>/checkpoints/<step>/"),
    ("every_n_epoch", 2, "Did you mean 'every_n_epochs'?"),
])
def test_lightning_model_checkpoint_arguments_are_answered_with_flaxlights(key, value, written):
    with pytest.raises(TypeError) as caught:
        ModelCheckpoint(**{key: value})
    message = str(caught.value)
    assert message.startswith(f"ModelCheckpoint got an unexpected keyword argument {key!r}.")
    assert written in message and "It takes monitor, mode, save_top_k, save_last, every_n_epochs" in message
    # A config naming it is refused by the config's own check, at its key (the file's line).
    from flaxlight.config import ConfigError, load_config
    with pytest.raises(ConfigError, match=rf"Unknown key 'callbacks\[0\]\.args\.{key}': callback ModelCheckpoint"):
        load_config({"trainer": {"name": "regression"}, "data": {"name": "sine"},
                     "model": {"name": "mlp_regressor", "hparams": {"hidden_dims": [4], "output_dim": 1}},
                     "callbacks": [{"name": "ModelCheckpoint", "args": {key: value}}]})


def test_best_model_path_and_score_name_the_best_checkpoint(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    checkpoint = ModelCheckpoint(monitor="val/loss", save_top_k=2)
    trainer = _trainer(tmp_path, callbacks=[checkpoint])
    assert trainer.checkpoint_callback is checkpoint
    assert checkpoint.best_model_path is None and checkpoint.best_model_score is None
    trainer.train_model(train, val, num_epochs=3)
    best = json.loads((tmp_path / "run" / "metrics" / "best_eval.json").read_text())
    assert checkpoint.best_model_path == str(tmp_path / "run" / "checkpoints" / str(checkpoint.best_step))
    assert os.path.isdir(checkpoint.best_model_path)
    assert checkpoint.best_model_score == pytest.approx(best["val/loss"])
    loaded = RegressTrainer.load_from_checkpoint(checkpoint.best_model_path, exmp_input=X0)
    assert loaded.global_step == checkpoint.best_step
    with pytest.raises(AttributeError, match=r"no attribute 'last_model_path' \(Lightning's\): last_step is the "
                                             r"newest checkpoint's step"):
        checkpoint.last_model_path
    assert _trainer(tmp_path / "none", enable_checkpointing=False).checkpoint_callback is None


@pytest.mark.parametrize("given", ["trainer", "checkpoint"])
def test_best_model_score_follows_the_trainers_monitor_as_an_explicit_checkpoints(tmp_path, regression_loaders, given):
    """The VAE report: MyTrainer(..., monitor="val/elbo", mode="max") with the default checkpoint
    chose the best checkpoint by it, yet best_model_score was None (an explicit
    ModelCheckpoint(monitor=...) gave the score). Both give it now, after a resume too."""
    from conftest import SigtermAt

    train, val, _ = regression_loaders
    scores = {1: 3.0, 2: 1.0, 3: 2.0}  # the best is epoch 2's (step 16), not the last

    def trainer(callbacks=()):
        monitor = {"monitor": "val/err"} if given == "trainer" else \
            {"callbacks": [ModelCheckpoint(monitor="val/err")]}
        monitor["callbacks"] = [LogScore(scores), *callbacks, *monitor.get("callbacks", [])]
        return _trainer(tmp_path, **monitor)

    straight = trainer()
    straight.train_model(train, val, num_epochs=3)
    checkpoint = straight.checkpoint_callback
    assert checkpoint.best_step == 16 and checkpoint.best_model_score == 1.0
    assert checkpoint.best_model_path == str(tmp_path / "run" / "checkpoints" / "16")
    assert os.path.isdir(checkpoint.best_model_path)
    with pytest.raises(SystemExit):
        trainer(callbacks=[SigtermAt(20)]).train_model(train, val, num_epochs=3, overwrite=True)
    resumed = trainer()
    resumed.train_model(train, val, num_epochs=3, resume=True)
    assert resumed.checkpoint_callback.best_model_score == 1.0
    assert resumed.checkpoint_callback.best_model_path == str(tmp_path / "run" / "checkpoints" / "16")
    loaded = RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=X0)
    assert loaded.global_step == 16  # the best, as best_model_path names it


def test_without_a_monitor_best_model_score_is_none_and_the_path_names_the_best(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path)  # the seed's rule (val/loss, the default) ranks; no monitor given
    trainer.train_model(train, val, num_epochs=2)
    checkpoint = trainer.checkpoint_callback
    assert checkpoint.best_model_score is None
    assert checkpoint.best_model_path == str(tmp_path / "run" / "checkpoints" / str(checkpoint.best_step))


def test_a_checkpoint_subclass_may_assign_best_model_path_and_score(tmp_path, regression_loaders):
    """A subclass that keeps these names itself (as Lightning's code may) assigns them; reads then
    return what it assigned, and flaxlight's best checkpoint is still the one kept and tested."""
    train, val, _ = regression_loaders

    class OwnPath(ModelCheckpoint):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.best_model_path, self.best_model_score = "", None  # as Lightning's __init__ sets them

        def on_validation_end(self, trainer, epoch, metrics):
            super().on_validation_end(trainer, epoch, metrics)
            self.best_model_path, self.best_model_score = f"step {self.best_step}", -1.0

    checkpoint = OwnPath(monitor="val/loss")
    assert checkpoint.best_model_path == "" and checkpoint.best_model_score is None
    trainer = _trainer(tmp_path, callbacks=[checkpoint])
    trainer.train_model(train, val, num_epochs=2)
    assert checkpoint.best_model_path == f"step {checkpoint.best_step}" and checkpoint.best_model_score == -1.0
    assert checkpoint.best_step in _steps(trainer)
    assert trainer.test(val)["test/loss"] > 0


def test_a_trainer_subclass_may_assign_checkpoint_callback(tmp_path, regression_loaders):
    train, val, _ = regression_loaders

    class KeepsItsOwn(RegressTrainer):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.checkpoint_callback = "mine"

    trainer = _trainer(tmp_path, trainer_class=KeepsItsOwn)
    assert trainer.checkpoint_callback == "mine"
    trainer.train_model(train, val, num_epochs=1)  # the default ModelCheckpoint still saves the run's
    assert trainer.checkpoint_callback == "mine" and _steps(trainer) == [8]


# ---------------------------------------------------------------- docs (finding 10 and the above)
def test_from_lightning_says_what_differs():
    text = open(os.path.join(ROOT, "docs", "from-lightning.md")).read()
    for said in ("`val_check_interval=N` counts global steps", "`max_epochs`", "`best_model_path`",
                 "`trainer.checkpoint_callback`", "`on_train_batch_end`", "(trainer, pl_module)",
                 "`ModelCheckpoint(every_n_epochs=N, save_top_k=-1)` keeps a snapshot every N epochs", "`dirpath`",
                 "`filename`", "`on_fit_start(self, trainer, pl_module=None)`", "`on_improvement`",
                 "`super().__init__(*args, strategy=strategy, **kwargs)`"):
        assert said in text, said


@pytest.mark.parametrize("key, value", [("resume", True), ("overwrite", True), ("resume_from", "runs/x"),
                                        ("steps_per_epoch", 10)])
def test_train_model_keywords_given_to_the_constructor_are_refused_naming_train_model(tmp_path, key, value):
    """They were kept as extra hparams with an info line and did nothing (resume=True started over)."""
    with pytest.raises(TypeError, match=rf"got {key}={value!r}, a keyword of train_model, not of the trainer: pass "
                                        rf"it there, trainer.train_model\(\.\.\., {key}={value!r}\)"):
        _trainer(tmp_path, **{key: value})


def test_num_epochs_given_to_the_constructor_is_recorded_with_a_warning_saying_train_model_sets_it(tmp_path):
    with pytest.warns(UserWarning, match=r"got num_epochs=3: it is recorded in the run's config, but only "
                                         r"train_model's num_epochs is used") as caught:
        _trainer(tmp_path, num_epochs=3)
    assert caught[0].filename == __file__  # at the user's line


def test_a_run_whose_hparams_hold_train_model_keywords_still_loads(tmp_path):
    """Runs saved before they were refused kept them as extra hparams: loading such a run failed
    with the new TypeError; num_epochs / batch_size (still recorded) warned on every load."""
    import yaml

    x, y = linear_data(32, 0)
    with pytest.warns(UserWarning, match="num_epochs=3: it is recorded"):
        trainer = _trainer(tmp_path, num_epochs=3, batch_size=8)
    trainer.train_model((x, y), (x, y), num_epochs=1, batch_size=8)
    hparams_file = os.path.join(trainer.log_dir, "hparams.yaml")
    with open(hparams_file) as f:
        hparams = yaml.safe_load(f)
    hparams.update(resume=True, overwrite=False)  # what such an earlier run's file holds
    with open(hparams_file, "w") as f:
        yaml.safe_dump(hparams, f)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        loaded = RegressTrainer.load_from_checkpoint(trainer.log_dir, exmp_input=X0)
    np.testing.assert_allclose(loaded.predict(x, batch_size=8), trainer.predict(x, batch_size=8, which="best"),
                               rtol=1e-6)


# ---------------------------------------------------------------- Lightning's / Keras' method names
@pytest.mark.parametrize("name, written", [
    ("fit", "trainer.train_model(train_loader, val_loader, num_epochs=10)"),
    ("validate", "trainer.eval_model(val_loader, log_prefix='val/')"),
    ("evaluate", "trainer.eval_model((x, y), log_prefix='val/', batch_size=256)"),
    ("log", "return loss, {'acc': acc}"),
    ("log_dict", "trainer.log_metrics({'val/f1': f1, ...})"),
    ("compile", "optimizer_hparams={'optimizer': 'adam', 'lr': 1e-3}"),
    ("summary", "trainer.print_tabulate(exmp_input)"),
    ("save_checkpoint", "trainer.save_model()"),
    ("freeze", "optimizer_hparams={..., 'freeze': ['Dense_0']}"),
    ("freeze", "predict(), test() and export() run the model in eval mode"),
    ("unfreeze", "optimizer_hparams that hold no 'freeze'"),
    ("unfreeze", "'Gradual unfreezing'"),
    ("to_onnx", "is trainer.export(path)"),
    ("to_torchscript", "trainer.export(path, which='current')"),
    ("save", "trainer.save_model()"),
    ("save", "MyTrainer.load_from_checkpoint(log_dir, exmp_input=x[:1])"),
    ("save_weights", "trainer.save_model()"),
    ("load_weights", "MyTrainer.load_from_checkpoint(log_dir, exmp_input=x[:1])"),
    ("load_weights", "trainer.load_model()"),
    ("eval", "eval mode (train=False)"),
    ("train", "NNX's and PyTorch's model.train() needs nothing here: the trainer switches modes itself"),
    ("train", "To train, call trainer.train_model(train_loader, val_loader, num_epochs=10)"),
    ("half", "optimizer_hparams={..., 'precision': 'bf16'}"),
    ("logged_metrics", "is trainer.callback_metrics"),
    ("logged_metrics", "the rows of trainer.history"),
    ("estimated_stepping_batches", "trainer.optimizer_plan.num_updates"),
    ("estimated_stepping_batches", "a function given as optimizer_hparams is called with it"),
    ("lightning_module", "is the trainer itself here"),
])
def test_lightning_and_keras_method_names_say_what_to_call(tmp_path, name, written):
    """trainer.fit / validate / evaluate and self.log were a bare AttributeError; so were Lightning's
    freeze / unfreeze / to_onnx / to_torchscript and Keras' save / save_weights / load_weights."""
    trainer = _trainer(tmp_path)
    with pytest.raises(AttributeError) as info:
        getattr(trainer, name)
    message = str(info.value)
    assert message.startswith(f"'RegressTrainer' object has no attribute {name!r}: ") and written in message
    assert "docs/from-lightning.md" in message
    assert getattr(trainer, "no_such_thing", 42) == 42 and not hasattr(trainer, "fit")  # others: as before


def test_what_the_method_hints_name_exists():
    """Each trainer method a hint names (trainer.export(...), MyTrainer.load_from_checkpoint(...))
    is one the trainer has."""
    from flaxlight.options import FOREIGN_TRAINER_METHODS

    named = {name for hint in FOREIGN_TRAINER_METHODS.values()  # less the foreign names they quote
             for name in re.findall(r"\b(?:trainer|MyTrainer)\.(\w+)\(", hint)} - set(FOREIGN_TRAINER_METHODS)
    assert {"export", "save_model", "load_model", "load_from_checkpoint", "train_model"} <= named
    assert [name for name in sorted(named) if not hasattr(flaxlight.TrainerModule, name)] == []


def test_a_property_of_yours_that_fails_names_what_it_missed(tmp_path):
    """The hint's __getattr__ hid a property's own AttributeError: it named the property (review)."""
    class WithProperty(RegressTrainer):
        @property
        def my_prop(self):
            return self.missing_thing

    trainer = _trainer(tmp_path, trainer_class=WithProperty)
    with pytest.raises(AttributeError, match="has no attribute 'missing_thing'"):
        trainer.my_prop


def test_self_log_in_loss_fn_fails_before_training_saying_to_return_the_metric(tmp_path, regression_loaders):
    class Logging(RegressTrainer):
        def loss_fn(self, params, batch, *, train, rng, state):
            x, y = batch
            pred, updates = state.apply_model(params, x, train=train, rng=rng)
            loss = ((pred - y) ** 2).mean()
            self.log("mse", loss)
            return loss, ({}, updates)

    trainer = _trainer(tmp_path, trainer_class=Logging)
    with pytest.raises(AttributeError, match=r"no attribute 'log': Lightning's self\.log\('acc', acc\) in a step is a "
                                             r"value of loss_fn's metrics: return loss, \{'acc': acc\}"):
        trainer.train_model(*regression_loaders[:2], num_epochs=1)
    assert trainer.global_step == 0


# ---------------------------------------------------------------- LightningModule methods on a trainer
@pytest.mark.parametrize("name, instead", [
    ("training_step", "Instead: loss_fn(self, params, batch, *, train, rng, state) returning (loss, metrics)"),
    ("validation_step", "Instead: the same loss_fn with train=False: its metrics are logged as val/..."),
    ("test_step", "Instead: the same loss_fn with train=False: its metrics are logged as test/..."),
    ("predict_step", "Instead: predict() returns the model's eval-mode outputs"),
    ("configure_optimizers", "Instead: optimizer_hparams={'optimizer': 'adamw'"),
    ("on_save_checkpoint", "Instead: what must travel with the run goes in a field of a flaxlight.TrainState"),
    ("on_load_checkpoint", "a Callback's state_dict() / load_state_dict() (restored at a resume)"),
    ("on_train_epoch_end", "Instead: on_training_epoch_end(epoch_idx), or a Callback's on_train_epoch_end("),
    ("optimizer_step", "Instead: the gradients exist only inside the jitted train step"),
    ("train_dataloader", "Instead: the loaders are given to the call: train_model(train_loader, val_loader"),
])
def test_a_lightning_module_method_on_a_trainer_is_warned_of_naming_what_flaxlight_calls(tmp_path, name, instead):
    """A predict_step / on_save_checkpoint / configure_optimizers written on the trainer was silently never
    called: predict returned plain outputs, the scaler never reached the checkpoint (trials7 forecast 3)."""
    ported = type("Ported", (RegressTrainer,), {name: lambda self, *args: None})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(tmp_path, trainer_class=ported)
    said = [str(w.message) for w in caught if "is never called" in str(w.message)]
    assert len(said) == 1 and said[0].startswith(f"Ported.{name} is never called: flaxlight.TrainerModule has no "
                                                 f"method {name!r} (a LightningModule's). ")
    assert instead in said[0] and "docs/from-lightning.md" in said[0]
    assert all(w.filename == __file__ for w in caught if "is never called" in str(w.message))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once: another trainer of the class, or of a subclass, says nothing
        _trainer(tmp_path, trainer_class=ported)
        _trainer(tmp_path, trainer_class=type("Sub", (ported,), {}))


def test_methods_flaxlight_calls_and_a_mixins_lightning_method_are_told_apart(tmp_path):
    class Seed(RegressTrainer):  # the seed's hooks, which flaxlight calls (on_validation_epoch_end is Lightning's too)
        def on_validation_epoch_end(self, epoch_idx, eval_metrics, val_loader): ...
        def on_training_epoch_end(self, epoch_idx): ...
        def predict_rollout(self, x): ...

    class LightningBits:  # no trainer: its predict_step reaches a trainer through inheritance
        def predict_step(self, batch, batch_idx=0): ...

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _trainer(tmp_path, trainer_class=Seed)
        _trainer(tmp_path, trainer_class=type("Mixed", (LightningBits, RegressTrainer), {}))
        _trainer(tmp_path, trainer_class=type("OtherMixed", (LightningBits, RegressTrainer), {}))
    said = [str(w.message) for w in caught]
    assert len(said) == 1 and said[0].startswith("Mixed.predict_step is never called"), said


@pytest.mark.parametrize("hook, written, expected", [
    ("on_validation_epoch_end", lambda self: None, "def on_validation_epoch_end(self, epoch_idx, eval_metrics, "
                                                   "val_loader)"),
    ("on_training_epoch_end", lambda self: None, "def on_training_epoch_end(self, epoch_idx)"),
    ("on_training_start", lambda self, trainer: None, "def on_training_start(self)"),
    ("on_training_end", staticmethod(lambda trainer: None), "def on_training_end(self)"),
])
def test_a_trainer_hook_that_cannot_take_the_loops_arguments_is_refused_when_built(tmp_path, hook, written,
                                                                                  expected):
    """LightningModule's on_validation_epoch_end(self) on the trainer failed after the first epoch had
    trained, with Python's bare "takes 1 positional argument but 4 were given" (trials21 porter 3)."""
    with pytest.raises(TypeError, match=rf"^Ported\.{hook}\(.*\) cannot take what flaxlight passes: the trainer "
                                        rf"calls self\.{hook}\(.*\)\..* Write {re.escape(expected)} \(see "
                                        rf"flaxlight\.TrainerModule\.{hook}"):
        _trainer(tmp_path, trainer_class=type("Ported", (RegressTrainer,), {hook: written}))


def test_trainer_hooks_with_other_names_or_star_args_are_called(tmp_path, regression_loaders):
    calls = []

    class Flexible(RegressTrainer):
        def on_validation_epoch_end(self, *args, **kwargs):
            calls.append(("val", len(args)))

        def on_training_epoch_end(self, epoch, extra=None):
            calls.append(("train", epoch))

        on_training_start = staticmethod(lambda *args: calls.append(("start", args)))

    class Sub(Flexible):  # inherits them: checked as its own
        pass

    train, val, _ = regression_loaders
    _trainer(tmp_path, trainer_class=Sub).train_model(train, val, num_epochs=1)
    assert calls == [("start", ()), ("train", 1), ("val", 3)]
    with pytest.raises(TypeError, match=r"LightningModule's on_validation_epoch_end\(self\) takes no arguments"):
        _trainer(tmp_path, trainer_class=type("Ported", (RegressTrainer,), {"on_validation_epoch_end": lambda self: 0}))


@pytest.mark.parametrize("value, said", [
    (0.5, "val_check_interval=0.5 is Lightning's fraction of an epoch; flaxlight takes a number of train steps "
          "(batches), counted over the run: val_check_interval=round(0.5 * batches per epoch) (with 20 batches per "
          "epoch: 10), and validates at each epoch's end as well. A whole epoch (1.0) is the default: drop it"),
    (1.0, "val_check_interval=1.0 is Lightning's default, a whole epoch: flaxlight validates at each epoch's end "
          "without it"),
    (3.0, "val_check_interval must be a positive int (a number of train steps), or None; got 3.0"),
])
def test_lightnings_fraction_of_an_epoch_says_what_to_write(tmp_path, value, said):
    """val_check_interval=0.5 / 1.0 (Lightning's default) got "must be a positive int (or None)" only."""
    with pytest.raises(ValueError, match=re.escape(said)):
        _trainer(tmp_path, val_check_interval=value)
    with pytest.raises(ValueError, match=re.escape("val_check_interval must be a positive int (or None); got 0")):
        _trainer(tmp_path, val_check_interval=0)
