"""Values that change during a run, read inside the jitted step: a trainer attribute read in
``loss_fn`` (``self.current_epoch``, ``self.global_step``) is compiled in as a constant, so it
warns; ``state.epoch`` / ``state.step`` are traced and advance (the documented annealing)."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import SigtermAt, TinyMLP, linear_data, quiet

import flaxlight

TRACED = "was read while flaxlight traced the"


class EpochBeta(flaxlight.TrainerModule):
    """Lightning's pattern: a KL-like weight annealed by ``self.current_epoch`` (frozen when jitted)."""

    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        pred, updates = state.apply_model(params, x, train=train, rng=rng)
        beta = min(1.0, self.current_epoch / 2) if train else 1.0
        return jnp.mean((pred - y) ** 2), ({"beta": beta}, updates)


class StepBeta(flaxlight.TrainerModule):
    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        pred, updates = state.apply_model(params, x, train=train, rng=rng)
        return jnp.mean((pred - y) ** 2), ({"step_seen": self.global_step * 1.0}, updates)


class StateEpochBeta(flaxlight.TrainerModule):
    """The documented way: ``state.epoch`` (epochs completed) is traced with the step."""

    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        pred, updates = state.apply_model(params, x, train=train, rng=rng)
        beta = jnp.minimum(1.0, state.epoch / 2)
        return jnp.mean((pred - y) ** 2), ({"beta": beta, "epoch_seen": state.epoch * 1.0}, updates)


def _trainer(cls, tmp_path, name="run", **kwargs):
    return cls(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=linear_data(1)[0],
               optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, **quiet(tmp_path / name, **kwargs))


def _loaders():
    return (flaxlight.ArrayLoader(*linear_data(64, 0), batch_size=16, shuffle=True, seed=0),
            flaxlight.ArrayLoader(*linear_data(32, 1), batch_size=16))


def _traced_reads(record) -> list:
    return [w for w in record if TRACED in str(w.message)]


def test_current_epoch_read_in_loss_fn_warns_that_the_step_compiles_it_as_a_constant(tmp_path):
    """The report's VAE: beta by self.current_epoch stayed at its first-epoch value in every epoch
    of a jitted run, with no word; it now warns at the loss's line, naming state.epoch."""
    trainer = _trainer(EpochBeta, tmp_path)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.train_model(*_loaders(), num_epochs=3)
    said = _traced_reads(record)
    assert said, [str(w.message) for w in record]
    assert len(said) <= 3  # once per trace (shapes, the step, ...), not once per step (12 steps)
    message = str(said[0].message)
    assert said[0].category is UserWarning and said[0].filename == __file__  # the loss's own line
    assert "EpochBeta.current_epoch" in message and "train step" in message and "constant" in message
    assert "state.epoch" in message and "0 in the first epoch" in message and "debug=True" in message
    assert "docs/models.md" in message
    assert [row["train/beta"] for row in trainer.history] == [0.5, 0.5, 0.5]  # what the warning is about


def test_global_step_read_in_loss_fn_warns_naming_state_step(tmp_path):
    trainer = _trainer(StepBeta, tmp_path)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.train_model(*_loaders(), num_epochs=2)
    said = _traced_reads(record)
    assert said and "StepBeta.global_step" in str(said[0].message) and "state.step" in str(said[0].message)
    assert any("eval step" in str(w.message) for w in said)  # the eval step reads it too
    assert trainer.global_step == 8  # the attribute itself still reads and counts as before


def test_debug_steps_read_trainer_attributes_live_without_a_warning(tmp_path):
    trainer = _trainer(EpochBeta, tmp_path, debug=True)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.train_model(*_loaders(), num_epochs=3)
    assert not _traced_reads(record)
    assert [row["train/beta"] for row in trainer.history] == [0.5, 1.0, 1.0]


@pytest.mark.parametrize("debug", [False, True], ids=["jit", "debug"])
def test_state_epoch_anneals_inside_the_step_without_a_warning(tmp_path, debug):
    """The documented replacement: state.epoch is 0 in the first epoch's train steps (Lightning's
    current_epoch), and the epochs completed in a validation after an epoch's training."""
    trainer = _trainer(StateEpochBeta, tmp_path, debug=debug)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=f".*{TRACED}")
        trainer.train_model(*_loaders(), num_epochs=4)
    history = trainer.history
    assert [row["train/beta"] for row in history] == [0.0, 0.5, 1.0, 1.0]
    assert [row["train/epoch_seen"] for row in history] == [0, 1, 2, 3]
    assert [row["val/epoch_seen"] for row in history] == [1, 2, 3, 4]


def test_state_epoch_annealing_resumes_mid_epoch_as_the_uninterrupted_run(tmp_path):
    """self.current_epoch read in the loss was traced again at the resume (another constant than
    the uninterrupted run's); state.epoch comes back from the checkpoint."""
    straight = _trainer(StateEpochBeta, tmp_path, "straight")
    straight.train_model(*_loaders(), num_epochs=4)
    with pytest.raises(SystemExit):
        _trainer(StateEpochBeta, tmp_path, callbacks=[SigtermAt(6)]).train_model(*_loaders(), num_epochs=4)
    resumed = _trainer(StateEpochBeta, tmp_path)
    resumed.train_model(*_loaders(), num_epochs=4, resume=True)
    assert [row["train/beta"] for row in resumed.history] == [0.0, 0.5, 1.0, 1.0]
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.state.params),
                 jax.device_get(straight.state.params))


def test_the_docs_say_current_epoch_counts_from_1_and_what_the_step_reads_instead(tmp_path):
    """from-lightning.md had no word that current_epoch (and the hooks' epoch) is 1 in the first
    epoch, Lightning's 0, nor that trainer attributes read in loss_fn are constants of the step."""
    import pathlib

    seen = []

    class Record(flaxlight.Callback):
        def on_train_epoch_start(self, trainer, epoch):
            seen.append((epoch, trainer.current_epoch))

    _trainer(StateEpochBeta, tmp_path, callbacks=[Record()]).train_model(*_loaders(), num_epochs=2)
    assert seen == [(1, 1), (2, 2)]  # what the docs say
    docs = pathlib.Path(__file__).resolve().parents[1] / "docs"
    lightning = (docs / "from-lightning.md").read_text()
    assert "`trainer.current_epoch` counts from **1**" in lightning and "where Lightning's is 0" in lightning
    differs = lightning[lightning.index("What differs"):]
    assert "`self.current_epoch`" in differs and "`state.epoch`" in differs and "`state.step`" in differs
    assert "rngs={\"noise\": noise_rng}" in differs
    models = (docs / "models.md").read_text()
    assert "## Values that change during training" in models and "state.epoch / self.warmup_epochs" in models
    assert "The trainer supplies one stream only, `dropout`" in models


def test_steps_run_under_jax_disable_jit_read_attributes_live_without_a_warning(tmp_path):
    """Under jax.disable_jit() the steps run as Python, as with debug=True: the value is read live
    at every step, so the 'compiled in as a constant' warning was false there (a review)."""
    trainer = _trainer(EpochBeta, tmp_path)
    # two steps an epoch (op by op, each step costs what a compile does)
    train, val = flaxlight.ArrayLoader(*linear_data(32, 0), batch_size=16, shuffle=True, seed=0), _loaders()[1]
    with warnings.catch_warnings(record=True) as record, jax.disable_jit():
        warnings.simplefilter("always")
        trainer.train_model(train, val, num_epochs=2)
    assert not _traced_reads(record)
    assert [row["train/beta"] for row in trainer.history] == [0.5, 1.0]
