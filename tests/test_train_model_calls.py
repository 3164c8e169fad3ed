"""A second ``train_model`` call on the same trainer goes on with the run's best (as Keras' and
Lightning's checkpoint callbacks across ``fit`` calls) and never overwrites the first call's
per-epoch validation files; ``resume=True`` afterwards agrees."""

import json
import os

import numpy as np
import pytest

import flaxlight
from conftest import RegressTrainer, TinyMLP, linear_data, quiet

X, Y = linear_data(256, 0)
XV, YV = linear_data(64, 1)


def _trainer(tmp_path, callbacks, lr=1e-2):
    return RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [16]},
                          optimizer_hparams={"optimizer": "adam", "lr": lr}, exmp_input=X[:1],
                          callbacks=[cb() for cb in callbacks], **quiet(tmp_path))


def _metrics(tmp_path):
    folder = tmp_path / "run" / "metrics"
    return {name: json.loads((folder / name).read_text()) for name in sorted(os.listdir(folder))}


def _steps(tmp_path):
    return sorted(int(name) for name in os.listdir(tmp_path / "run" / "checkpoints") if name.isdigit())


@pytest.mark.parametrize("callbacks", [[], [lambda: flaxlight.ModelCheckpoint(monitor="val/loss", mode="min")]],
                         ids=["trainer_rule", "checkpoint_monitor"])
def test_a_worse_second_call_leaves_the_runs_best_and_the_first_calls_files(tmp_path, callbacks):
    """The second call started "best" afresh: its worse model became which="best", best_eval.json
    and load_from_checkpoint's, and its epochs 1, 2 overwrote the first call's eval_epoch files."""
    trainer = _trainer(tmp_path, callbacks)
    first = trainer.train_model((X, Y), (XV, YV), num_epochs=3, batch_size=32)
    after_first = _metrics(tmp_path)
    best_step = RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=X[:1],
                                                    logger_params={"log_dir": str(tmp_path / "a")}).global_step
    best_outputs = trainer.predict(XV, batch_size=64, which="best")

    second = trainer.train_model((X, -Y), (XV, YV), num_epochs=2, batch_size=32)  # learns the wrong sign: worse
    assert [row["val/loss"] for row in second.history] > [first["val/loss"]] * 2
    assert second["val/loss"] == first["val/loss"]  # the run's best, as Keras' ModelCheckpoint.best
    files = _metrics(tmp_path)
    assert sorted(files) == ["best_eval.json"] + [f"eval_epoch_{epoch:03d}.json" for epoch in range(1, 6)]
    assert {name: files[name] for name in after_first} == after_first  # nothing of the first call rewritten
    assert files["eval_epoch_005.json"]["val/loss"] == pytest.approx(second.history[-1]["val/loss"])
    np.testing.assert_array_equal(trainer.predict(XV, batch_size=64, which="best"), best_outputs)
    assert best_step in _steps(tmp_path)
    loaded = RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=X[:1],
                                                 logger_params={"log_dir": str(tmp_path / "b")})
    assert loaded.global_step == best_step

    resumed = _trainer(tmp_path, callbacks)  # another process continuing the run: its best is still the first's
    third = resumed.train_model((X, -Y), (XV, YV), num_epochs=3, batch_size=32, resume=True)
    assert third["val/loss"] == first["val/loss"]
    files = _metrics(tmp_path)
    assert sorted(files)[-1] == "eval_epoch_006.json" and files["best_eval.json"] == after_first["best_eval.json"]
    np.testing.assert_array_equal(resumed.predict(XV, batch_size=64, which="best"), best_outputs)


def test_a_better_second_call_becomes_the_runs_best(tmp_path):
    trainer = _trainer(tmp_path, [], lr=1e-3)
    first = trainer.train_model((X, Y), (XV, YV), num_epochs=1, batch_size=32)
    second = trainer.train_model((X, Y), (XV, YV), num_epochs=3, batch_size=32)
    assert second["val/loss"] < first["val/loss"]
    assert _metrics(tmp_path)["best_eval.json"]["val/loss"] == pytest.approx(second["val/loss"])
    loaded = RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=X[:1],
                                                 logger_params={"log_dir": str(tmp_path / "b")})
    assert loaded.global_step == max(_steps(tmp_path)) == 4 * 8


def test_rewinding_into_the_second_call_keeps_the_files_before_it_and_drops_the_later_ones(tmp_path):
    """A rewind dropped the validation files after its checkpoint by the call's own epoch number:
    back to the second call's first epoch, it dropped every file after eval_epoch_001."""
    every = [lambda: flaxlight.ModelCheckpoint(save_top_k=-1)]  # every epoch's checkpoint kept
    trainer = _trainer(tmp_path, every)
    trainer.train_model((X, Y), (XV, YV), num_epochs=3, batch_size=32)
    trainer.train_model((X, -Y), (XV, YV), num_epochs=2, batch_size=32)
    before = _metrics(tmp_path)
    rewound = _trainer(tmp_path, every)
    rewound.train_model((X, -Y), (XV, YV), num_epochs=2, batch_size=32,
                        resume_from=tmp_path / "run" / "checkpoints" / "32")  # the second call's first epoch
    files = _metrics(tmp_path)
    assert sorted(files) == ["best_eval.json"] + [f"eval_epoch_{epoch:03d}.json" for epoch in range(1, 6)]
    assert [files[f"eval_epoch_{epoch:03d}.json"] for epoch in range(1, 5)] == \
        [before[f"eval_epoch_{epoch:03d}.json"] for epoch in range(1, 5)]
    assert files["eval_epoch_005.json"]["val/loss"] == pytest.approx(rewound.history[-1]["val/loss"])
    assert (tmp_path / "run" / "abandoned" / "after_step_32" / "metrics" / "eval_epoch_005.json").exists()
