"""``train_model`` with arrays and a batch size, ``trainer.history`` and ``eval_model`` on arrays."""

import numpy as np
import pytest

from conftest import CrashAfterEpoch, RegressTrainer, TinyMLP, quiet


def _data(n=40, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 4)).astype(np.float32)
    return x, (x @ np.arange(1, 5, dtype=np.float32))[:, None]


def _trainer(tmp_path, **kwargs):
    return RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [16], "output_dim": 1},
                          optimizer_hparams={"optimizer": "adam", "lr": 3e-2}, exmp_input=np.zeros((1, 4), np.float32),
                          **quiet(tmp_path, **kwargs))


def test_train_model_takes_arrays_and_a_batch_size_and_returns_the_history(tmp_path):
    x, y = _data()
    xv, yv = _data(16, seed=1)
    trainer = _trainer(tmp_path)
    result = trainer.train_model((x, y), (xv, yv), num_epochs=3, batch_size=8)

    assert trainer.steps_per_epoch == 5 and trainer.global_step == 15
    assert [(row["epoch"], row["step"]) for row in result.history] == [(1, 5), (2, 10), (3, 15)]
    assert result.history is trainer.history and result["val/loss"] == min(r["val/loss"] for r in result.history)
    assert all({"train/loss", "val/loss"} <= set(row) for row in result.history)
    assert result.history[-1]["val/loss"] < result.history[0]["val/loss"]  # it learned
    evaluated = trainer.eval_model((xv, yv), log_prefix="val/", batch_size=5)
    assert evaluated["val/loss"] == pytest.approx(result.history[-1]["val/loss"], rel=1e-5)


def test_array_training_is_shuffled_by_the_seed_and_reproducible(tmp_path):
    x, y = _data()
    params = []
    for name, seed in (("a", 3), ("b", 3), ("c", 4)):
        trainer = _trainer(tmp_path / name, seed=seed, enable_checkpointing=False)
        trainer.train_model((x, y), None, num_epochs=2, batch_size=8)
        params.append(np.concatenate([np.ravel(p) for p in __import__("jax").tree.leaves(trainer.state.params)]))
    np.testing.assert_array_equal(params[0], params[1])
    assert not np.allclose(params[0], params[2])


def test_history_keeps_step_validations_as_their_own_rows_and_a_new_fit_starts_empty(tmp_path):
    x, y = _data()
    trainer = _trainer(tmp_path, val_check_interval=3)
    trainer.train_model((x, y), (x[:8], y[:8]), num_epochs=2, batch_size=8)
    steps = [row["step"] for row in trainer.history]
    assert steps == sorted(set(steps))  # never two rows at one step
    assert {3, 5, 6, 9, 10} <= set(steps)
    assert "train/loss" not in trainer.history[0] and "val/loss" in trainer.history[0]
    first = trainer.history
    trainer.train_model((x, y), None, num_epochs=1, batch_size=8, overwrite=True)
    assert [row["epoch"] for row in trainer.history] == [1] and len(first) == len(steps)  # the old list is kept


def test_resumed_history_equals_the_uninterrupted_one(tmp_path):
    x, y = _data()
    straight = _trainer(tmp_path / "straight")
    straight.train_model((x, y), (x[:8], y[:8]), num_epochs=3, batch_size=8)
    with pytest.raises(RuntimeError):
        _trainer(tmp_path / "cut", callbacks=[CrashAfterEpoch(2)]).train_model((x, y), (x[:8], y[:8]), num_epochs=3,
                                                                               batch_size=8)
    resumed = _trainer(tmp_path / "cut")
    resumed.train_model((x, y), (x[:8], y[:8]), num_epochs=3, batch_size=8, resume=True)
    drop_time = lambda rows: [{k: v for k, v in r.items() if "time" not in k} for r in rows]  # noqa: E731
    assert drop_time(resumed.history) == drop_time(straight.history)


def test_array_errors_say_what_to_pass(tmp_path):
    x, y = _data()
    trainer = _trainer(tmp_path)
    with pytest.raises(ValueError, match="pass batch_size=..."):
        trainer.train_model((x, y), None, num_epochs=1)
    with pytest.raises(ValueError, match="share a leading dimension"):
        trainer.train_model((x, y[:10]), None, num_epochs=1, batch_size=8)
    with pytest.raises(ValueError, match=r"batch_size=\.\.\.\) is for arrays.*Drop batch_size"):
        trainer.train_model([(x[:8], y[:8])], None, num_epochs=1, batch_size=8)
