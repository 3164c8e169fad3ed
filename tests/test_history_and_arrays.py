"""``train_model`` with arrays and a batch size, ``trainer.history`` and ``eval_model`` on arrays."""

import csv
import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from conftest import CrashAfterEpoch, RegressTrainer, TinyMLP, quiet
from flaxlight import ArrayLoader, Callback
from flaxlight.callbacks import History, ModelCheckpoint


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


class _LogsAtEachMoment(Callback):
    """Logs one value at each moment of an epoch's end, as the docs' F1 callback does at validations."""

    def on_train_epoch_end(self, trainer, epoch, metrics):
        trainer.log_metrics({"train/extra": 100.0 + epoch})

    def on_validation_end(self, trainer, epoch, metrics):
        trainer.log_metrics({"val/score": 200.0 + trainer.global_step})

    def on_epoch_end(self, trainer, epoch):
        trainer.log_metrics({"done/epoch": 300.0 + epoch})


class _HookLogs(RegressTrainer):
    def on_validation_epoch_end(self, epoch_idx, eval_metrics, val_loader):
        self.log_metrics({"val/hook": 400.0 + epoch_idx})


def _hook_trainer(tmp_path, **kwargs):
    return _HookLogs(model_class=TinyMLP, model_hparams={"hidden_dims": [16], "output_dim": 1},
                     optimizer_hparams={"optimizer": "adam", "lr": 3e-2}, exmp_input=np.zeros((1, 4), np.float32),
                     **quiet(tmp_path, **kwargs))


def test_what_hooks_and_callbacks_log_joins_the_history_rows_and_validation_files(tmp_path):
    """A value logged during a validation (the trainer's on_validation_epoch_end, a callback's
    on_validation_end) is in that validation's history row and its metrics/eval_*.json; values
    logged at an epoch's end (on_train_epoch_end, on_epoch_end) are in the epoch's row: the values
    metrics.csv got at that step."""
    x, y = _data()
    trainer = _hook_trainer(tmp_path, callbacks=[_LogsAtEachMoment()], val_check_interval=3)
    trainer.train_model((x, y), (x[:8], y[:8]), num_epochs=2, batch_size=8)

    history = trainer.history
    assert [(row["epoch"], row["step"], row["val/hook"], row["val/score"]) for row in history] == [
        (1, 3, 401.0, 203.0), (1, 5, 401.0, 205.0), (2, 6, 402.0, 206.0), (2, 9, 402.0, 209.0), (2, 10, 402.0, 210.0)]
    assert [(row["step"], row["train/extra"], row["done/epoch"]) for row in history if "train/loss" in row] == [
        (5, 101.0, 301.0), (10, 102.0, 302.0)]
    assert "train/extra" not in history[0] and "done/epoch" not in history[0]  # a step validation's row
    files = tmp_path / "run" / "metrics"
    epoch_1, step_3 = (json.loads((files / name).read_text()) for name in ("eval_epoch_001.json", "eval_step_3.json"))
    assert epoch_1 == {"val/loss": history[1]["val/loss"], "val/hook": 401.0, "val/score": 205.0}
    assert step_3 == {"val/loss": history[0]["val/loss"], "val/hook": 401.0, "val/score": 203.0}
    with open(tmp_path / "run" / "metrics.csv") as f:
        logged = {}
        for record in csv.DictReader(f):
            logged.setdefault(int(record["step"]), {}).update({k: float(v) for k, v in record.items() if v})
    for row in history:
        assert {key: row[key] for key in row if key != "epoch_time"} == pytest.approx(
            {key: logged[row["step"]][key] for key in row if key != "epoch_time"}), row


class _ReadsHistory(Callback):
    def __init__(self):
        self.seen = []

    def on_validation_end(self, trainer, epoch, metrics):
        row = trainer.history[-1]
        self.seen.append((row["step"], row["val/loss"] == metrics["val/loss"], row.get("val/score")))


def test_a_callback_after_the_history_reads_the_validation_row_with_what_was_logged_before_it(tmp_path):
    x, y = _data()
    reader = _ReadsHistory()
    trainer = _hook_trainer(tmp_path, callbacks=[_LogsAtEachMoment(), History(), reader])
    trainer.train_model((x, y), (x[:8], y[:8]), num_epochs=2, batch_size=8)
    assert reader.seen == [(5, True, 205.0), (10, True, 210.0)]


class _CrashAtEpochStart(Callback):
    """Raises as an epoch starts, once the checkpoints before are on disk."""

    def __init__(self, epoch):
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, epoch):
        if epoch == self.epoch:
            trainer.checkpointer.wait()
            raise RuntimeError("crash after the save")


@pytest.mark.parametrize("save_top_k, crash", [(-1, CrashAfterEpoch(2)), (0, _CrashAtEpochStart(3))],
                         ids=["after-validation-save", "after-epoch-end-save"])
def test_a_resumed_history_keeps_what_callbacks_logged_after_the_history_heard_of_a_moment(tmp_path, save_top_k,
                                                                                           crash):
    """The History comes first here: the values logged after its hooks (and before the checkpoint
    saved at that moment: at the validation with save_top_k=-1, at the epoch's end with 0) are in
    the checkpoint's rows."""
    x, y = _data()

    def trainer(name, *more):
        return _hook_trainer(tmp_path / name, callbacks=[History(), _LogsAtEachMoment(), *more,
                                                         ModelCheckpoint(every_n_epochs=1, save_top_k=save_top_k)])

    straight = trainer("straight")
    straight.train_model((x, y), (x[:8], y[:8]), num_epochs=3, batch_size=8)
    with pytest.raises(RuntimeError, match="crash"):
        trainer("cut", crash).train_model((x, y), (x[:8], y[:8]), num_epochs=3, batch_size=8)
    resumed = trainer("cut")
    resumed.train_model((x, y), (x[:8], y[:8]), num_epochs=3, batch_size=8, resume=True)
    drop_time = lambda rows: [{k: v for k, v in r.items() if "time" not in k} for r in rows]  # noqa: E731
    assert drop_time(resumed.history) == drop_time(straight.history)
    assert [(row["train/extra"], row["val/hook"], row["val/score"], row["done/epoch"]) for row in resumed.history] == [
        (101.0, 401.0, 205.0, 301.0), (102.0, 402.0, 210.0, 302.0), (103.0, 403.0, 215.0, 303.0)]


def test_array_errors_say_what_to_pass(tmp_path):
    x, y = _data()
    trainer = _trainer(tmp_path)
    with pytest.raises(ValueError, match="pass batch_size=..."):
        trainer.train_model((x, y), None, num_epochs=1)
    with pytest.raises(ValueError, match="share a leading dimension"):
        trainer.train_model((x, y[:10]), None, num_epochs=1, batch_size=8)
    with pytest.raises(ValueError, match=r"batch_size=\.\.\.\) is for arrays.*Drop batch_size"):
        trainer.train_model([(x[:8], y[:8])], None, num_epochs=1, batch_size=8)


class _EpochOrders(Callback):
    """The first example indices of each epoch's order (an ArrayLoader's ``order()``)."""

    def __init__(self):
        self.seen = []

    def on_train_epoch_start(self, trainer, epoch):
        self.seen.append(tuple(trainer.train_loader.order()[:8].tolist()))


def test_each_train_model_call_goes_on_to_new_data_orders(tmp_path):
    """Keras' `for ...: fit(x, y, epochs=1)`: every call shuffles anew (the loader's epoch is the
    model's epoch count, which goes on), while each call's own epochs count from 1."""
    x, y = _data()
    orders = _EpochOrders()
    trainer = _trainer(tmp_path, callbacks=[orders])
    for _ in range(3):
        result = trainer.train_model((x, y), None, num_epochs=1, batch_size=8)
        assert [row["epoch"] for row in result.history] == [1]
    assert len(set(orders.seen)) == 3 and trainer.global_step == 15 and int(trainer.state.epoch) == 3
    told = []

    class Told:  # a loader of one's own is told the model's epoch too
        def set_epoch(self, epoch):
            told.append(epoch)

        def __iter__(self):
            return iter([(x[:8], y[:8])])

    trainer.callbacks.remove(orders)
    trainer.train_model(Told(), None, num_epochs=2, steps_per_epoch=1)
    assert told == [4, 5]


def test_a_second_call_resumed_after_a_crash_ends_bitwise_as_if_uninterrupted(tmp_path):
    x, y = _data()
    straight = _trainer(tmp_path / "straight")
    straight.train_model((x, y), (x[:8], y[:8]), num_epochs=1, batch_size=8)
    straight.train_model((x, y), (x[:8], y[:8]), num_epochs=3, batch_size=8)
    cut = _trainer(tmp_path / "cut")
    cut.train_model((x, y), (x[:8], y[:8]), num_epochs=1, batch_size=8)
    cut.callbacks.append(CrashAfterEpoch(1))
    with pytest.raises(RuntimeError, match="crash"):
        cut.train_model((x, y), (x[:8], y[:8]), num_epochs=3, batch_size=8)  # the second call's epoch 1 is saved
    resumed = _trainer(tmp_path / "cut")
    resumed.train_model((x, y), (x[:8], y[:8]), num_epochs=3, batch_size=8, resume=True)
    assert resumed.global_step == straight.global_step == 20 and int(resumed.state.epoch) == 4
    jax.tree.map(np.testing.assert_array_equal, resumed.state.params, straight.state.params)


def _adam_counts(trainer):
    return {int(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(trainer.state.opt_state)
            if "count" in jax.tree_util.keystr(path)}


def test_a_loop_of_calls_starts_a_new_optimizer_each_time_and_resume_carries_it(tmp_path):
    """docs/from-keras.md: unlike Keras' fit loop, each train_model call builds a new optimizer;
    the loop written with resume=True keeps its state and, with a constant schedule, ends bit for
    bit as one call of num_epochs=3."""
    x, y = _data()

    def trainer(name):
        return RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [16], "output_dim": 1},
                              optimizer_hparams={"optimizer": "adam", "lr": 3e-2, "schedule": "constant"},
                              exmp_input=x[:1], **quiet(tmp_path, logger_params={"log_dir": str(tmp_path / name)}))

    plain, resumed, once = trainer("plain"), trainer("resumed"), trainer("once")
    for n in (1, 2, 3):
        plain.train_model((x, y), None, num_epochs=1, batch_size=8)
        assert plain.global_step == 5 * n and _adam_counts(plain) == {5}  # the optimizer's count starts again
        resumed.train_model((x, y), None, num_epochs=n, batch_size=8, resume=n > 1)
        assert resumed.global_step == 5 * n and _adam_counts(resumed) == {5 * n}
    once.train_model((x, y), None, num_epochs=3, batch_size=8)
    jax.tree.map(np.testing.assert_array_equal, resumed.state.params, once.state.params)
    assert [row["epoch"] for row in resumed.history] == [1, 2, 3]


@pytest.mark.parametrize("through", ["arrays", "ArrayLoader"])
@pytest.mark.parametrize("labels", ["text", "objects"])
def test_text_labels_are_named_by_the_first_batch_check_before_any_copy_to_the_device(tmp_path, through, labels):
    x, y = _data()
    names = np.where(y[:, 0] > 0, "high", "low")
    bad = names if labels == "text" else names.astype(object)
    data = (x, bad) if through == "arrays" else ArrayLoader(x, bad, batch_size=8)
    dtype = "<U4" if labels == "text" else "object"
    with pytest.raises(TypeError, match=rf"The leaf at \[1\] of the first batch of train_loader holds {dtype} values, "
                                        rf"not numbers; convert it first \(class names to ints: np.unique"):
        _trainer(tmp_path).train_model(data, None, num_epochs=1, batch_size=8 if through == "arrays" else None)


class DictInputs(nn.Module):
    @nn.compact
    def __call__(self, inputs, train: bool = False):
        return nn.Dense(1)(jnp.concatenate([inputs["a"], inputs["b"]], axis=-1))


@pytest.mark.parametrize("form", ["labels as a list", "validation labels as a list", "dict inputs, Keras style"])
def test_keras_style_containers_of_arrays_are_cut_by_batch_size(tmp_path, form):
    """What Keras' fit takes: lists of numbers in a tuple become arrays, and a nested pytree of
    arrays is cut into batches (never taken as "a loader of 2 batches"). A list [x, y] is not: see
    the next tests."""
    x, y = _data()
    xv, yv = _data(16, seed=1)
    if form == "dict inputs, Keras style":
        def make(name):
            return RegressTrainer(model_class=DictInputs, model_hparams={}, optimizer_hparams={"lr": 1e-2},
                                  exmp_input=({"a": x[:1, :2], "b": x[:1, 2:]},),
                                  **quiet(tmp_path, logger_params={"log_dir": str(tmp_path / name)}))
        given, same = make("given"), make("same")
        given.train_model(({"a": x[:, :2], "b": x[:, 2:]}, y), ({"a": xv[:, :2], "b": xv[:, 2:]}, yv), num_epochs=2,
                          batch_size=8)
        same.train_model(ArrayLoader({"a": x[:, :2], "b": x[:, 2:]}, y, batch_size=8, shuffle=True, seed=42),
                         ArrayLoader({"a": xv[:, :2], "b": xv[:, 2:]}, yv, batch_size=8), num_epochs=2)
    else:
        train, val = {"labels as a list": ((x, y.tolist()), (xv, yv)),
                      "validation labels as a list": ((x, y), (xv, yv.tolist()))}[form]
        given, same = _trainer(tmp_path / "given"), _trainer(tmp_path / "same")
        given.train_model(train, val, num_epochs=2, batch_size=8)
        same.train_model((x, y), (xv, yv), num_epochs=2, batch_size=8)
    assert given.global_step == 10 and [row["epoch"] for row in given.history] == [1, 2]
    assert [row["val/loss"] for row in given.history] == [row["val/loss"] for row in same.history]
    jax.tree.map(np.testing.assert_array_equal, given.state.params, same.state.params)


class _AutoEncode(RegressTrainer):
    """Each batch is one array, the input and the target."""

    def loss_fn(self, params, batch, *, train, rng, state):
        pred, updates = state.apply_model(params, batch, train=train, rng=rng)
        return jnp.mean((pred - batch) ** 2), ({}, updates)


@pytest.mark.parametrize("sizes", [(16, 16, 16), (16, 16, 8)])
def test_a_list_of_single_array_batches_next_to_arrays_stays_a_list_of_batches(tmp_path, sizes):
    """An autoencoder's validation batches given as a list, next to training arrays and a
    batch_size: each item is one batch (not arrays cut into batches of batch_size)."""
    x, _ = _data(64)
    xv, _ = _data(sum(sizes), seed=1)
    batches = np.split(xv, np.cumsum(sizes)[:-1])
    trainer = _AutoEncode(model_class=TinyMLP, model_hparams={"hidden_dims": [8], "output_dim": 4},
                          optimizer_hparams={"lr": 1e-2}, exmp_input=x[:1], **quiet(tmp_path))
    result = trainer.train_model(x, batches, num_epochs=1, batch_size=32)
    true_mean = float(np.mean((np.asarray(trainer.bind_model()(xv)) - xv) ** 2))
    assert result.history[-1]["val/loss"] == pytest.approx(true_mean, rel=1e-5)


@pytest.mark.parametrize("where", ["training", "validation", "test", "eval_model"])
def test_a_list_x_y_with_a_batch_size_asks_for_a_tuple(tmp_path, where):
    """Keras' [x, y] (arrays sharing their first dimension, with other shapes) is ambiguous with a
    list of batches, which a list is here: with a batch_size it is an error asking for (x, y)."""
    x, y = _data()
    trainer = _trainer(tmp_path)
    named = "eval_model's data" if where == "eval_model" else f"train_model's {where} data"
    with pytest.raises(ValueError, match=rf"{named} is a list of 2 arrays that share their first dimension \(\[0\] "
                                         rf"\(40, 4\), \[1\] \(40, 1\)\), like Keras' \[x, y\]; a list is a loader of "
                                         rf"batches here .* Pass the arrays as a tuple, \(x, y\), to cut them into batches"):
        if where == "eval_model":
            trainer.eval_model([x, y.tolist()], batch_size=8)
        else:
            given = {"training": (x, y), "validation": (x, y), "test": (x, y)}
            given[where] = [x, y]
            trainer.train_model(given["training"], given["validation"], test_loader=given["test"], num_epochs=1,
                                batch_size=8)
    assert not (tmp_path / "run" / "hparams.yaml").exists()  # refused before the run began
    with pytest.raises(ValueError, match=r"is for arrays; the data given are loaders, whose batches are used as they "
                                         r"are \(a list is a loader of batches; arrays go in a tuple\)"):
        trainer.train_model([x, x], None, num_epochs=1, batch_size=8)  # one shape: 2 batches


def test_a_ragged_list_or_a_stray_value_in_the_arrays_is_named(tmp_path):
    x, y = _data()
    trainer = _trainer(tmp_path)
    with pytest.raises(ValueError, match=r"training data\[1\] is a Python list that is not rectangular.*np.asarray"):
        trainer.train_model((x, [[1.0]] * 39 + [[1.0, 2.0]]), None, num_epochs=1, batch_size=8)
    with pytest.raises(ValueError, match=r"training data \(cut into batches of 8.*\[0\] \(40, 4\), \[1\] a str, not an "
                                         r"array"):
        trainer.train_model((x, "labels"), None, num_epochs=1, batch_size=8)


@pytest.mark.parametrize("keyword, hint", [
    ("validation_split", r"split the arrays yourself .* train_model\(\(x\[:n\], y\[:n\]\), \(x\[n:\], y\[n:\]\)"),
    ("validation_data", r"pass the validation data as the second argument: train_model\(\(x, y\), \(x_val, y_val\)"),
    ("epochs", "it is num_epochs=N"),
    ("shuffle", r"training arrays are always shuffled, anew each epoch.*ArrayLoader\(x, y, batch_size=64, shuffle=False\)"),
    ("num_epoch", "did you mean 'num_epochs'"),
    ("initial_epoch", r"num_epochs counts the whole run.*train_model\(\(x, y\), \(x_val, y_val\), num_epochs=10, "
                      r"batch_size=64, resume=True\)"),
    ("sample_weight", r"pass the weights as a third array, train_model\(\(x, y, w\), .*loss_fn that reads "
                      r"\(x, y, w\) batches \(docs/data.md, \"Sample and class weights\"\)"),
    ("class_weight", r"make per-example weights w = class_weights\[y\].*train_model\(\(x, y, w\), .*loss_fn that "
                     r"reads \(x, y, w\) batches \(docs/data.md, \"Sample and class weights\"\)"),
    ("validation_steps", r"it is the trainer's limit_val_batches=N"),
    ("validation_batch_size", r"validation arrays are cut by batch_size too.*"
                              r"flaxlight.ArrayLoader\(x_val, y_val, batch_size=256\)"),
])
def test_keras_keywords_say_what_to_pass_instead(tmp_path, keyword, hint):
    x, y = _data()
    with pytest.raises(TypeError, match=rf"train_model\(\) got an unexpected keyword argument '{keyword}': {hint}"):
        _trainer(tmp_path).train_model((x, y), batch_size=8, **{keyword: 0.2})
    assert not (tmp_path / "run" / "hparams.yaml").exists()  # refused before the run began


class _DataModule:
    """A LightningDataModule's shape (no Lightning imported): setup(stage), then its loaders."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def setup(self, stage):
        self.stage = stage

    def train_dataloader(self):
        return ArrayLoader(self.x, self.y, batch_size=8)


class _Loaders:  # a datamodule without setup
    train_dataloader = _DataModule.train_dataloader


@pytest.mark.parametrize("call, message", [
    (lambda t, x, y: t.train_model(x=x, y=y, epochs=3),
     r"^train_model\(\) got an unexpected keyword argument 'x': pass the arrays as one argument: "
     r"train_model\(\(x, y\), \(x_val, y_val\), batch_size=64\)\.$"),
    (lambda t, x, y: t.train_model(y=y, num_epochs=3), r"^train_model\(\) got an unexpected keyword argument 'y': pass"),
    (lambda t, x, y: t.train_model(datamodule=_DataModule(x, y)),
     r"^train_model\(\) got an unexpected keyword argument 'datamodule': flaxlight takes the loaders themselves: "
     r"Lightning's trainer\.fit\(model, datamodule=dm\) is dm\.setup\('fit'\) \(Lightning calls it for you; flaxlight "
     r"does not\) and then trainer\.train_model\(dm\.train_dataloader\(\), dm\.val_dataloader\(\)\)\.$"),
    (lambda t, x, y: t.train_model(datamodule=_Loaders(), num_epochs=2),
     r"^train_model\(\) got an unexpected keyword argument 'datamodule': flaxlight takes the loaders themselves: "
     r"Lightning's trainer\.fit\(model, datamodule=dm\) is trainer\.train_model\(dm\.train_dataloader\(\), "
     r"dm\.val_dataloader\(\)\)\.$"),
    (lambda t, x, y: t.train_model(),
     r"^train_model\(\) missing its first argument 'train_loader': it takes the training data: a "
     r"loader of batches, train_model\(train_loader, val_loader, num_epochs=10\), or arrays, "
     r"train_model\(\(x, y\), \(x_val, y_val\), batch_size=64\)\.$"),
    (lambda t, x, y: t.train_model(val_loader=(x, y), num_epochs=2, batch_size=8),
     r"^train_model\(\) missing its first argument 'train_loader'"),
    (lambda t, x, y: t.train_model((x, y), batch_size=8, ckpt_path="last"),
     r"^train_model\(\) got an unexpected keyword argument 'ckpt_path': Lightning's fit\(ckpt_path='last'\) is "
     r"train_model\(\.\.\., resume=True\)"),
    (lambda t, x, y: t.train_model(train_dataloaders=_DataModule(x, y).train_dataloader()),
     r"^train_model\(\) got an unexpected keyword argument 'train_dataloaders': pass the loaders themselves"),
    (lambda t, x, y: t.train_model(_DataModule(x, y), num_epochs=2),  # it said "train_loader has no len()"
     r"^train_model\(\) got a data module \(_DataModule, which makes loaders and is none\) as 'train_loader': "
     r"flaxlight takes the loaders themselves: Lightning's trainer\.fit\(model, datamodule=dm\) is "
     r"dm\.setup\('fit'\) .* trainer\.train_model\(dm\.train_dataloader\(\), dm\.val_dataloader\(\)\)\.$"),
])
def test_a_keras_or_lightning_call_without_a_train_loader_says_what_to_write(tmp_path, call, message):
    """Python's own "missing 1 required positional argument" came before flaxlight's hints."""
    x, y = _data()
    with pytest.raises(TypeError, match=message):
        call(_trainer(tmp_path), x, y)
    assert not (tmp_path / "run" / "hparams.yaml").exists()  # refused before the run began


def test_train_model_s_first_argument_may_still_be_given_by_name(tmp_path):
    x, y = _data()
    trainer = _trainer(tmp_path)
    trainer.train_model(train_loader=(x, y), num_epochs=1, batch_size=8)
    assert trainer.global_step == 5


class _WithOwnKeyword(RegressTrainer):
    def train_model(self, train_loader, val_loader=None, *, log_images=False, **kwargs):
        self.log_images = log_images
        return super().train_model(train_loader, val_loader, **kwargs)


def test_an_unknown_keyword_is_matched_against_a_subclass_s_own_keywords_too(tmp_path):
    x, y = _data()
    trainer = _WithOwnKeyword(model_class=TinyMLP, model_hparams={"hidden_dims": [16], "output_dim": 1},
                              optimizer_hparams={"lr": 1e-2}, exmp_input=x[:1], **quiet(tmp_path))
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'log_image': did you mean 'log_images'\?"):
        trainer.train_model((x, y), batch_size=8, log_image=True)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'zzz': it takes .*\blog_images\b.*num_epochs"):
        trainer.train_model((x, y), batch_size=8, zzz=1)
    trainer.train_model((x, y), num_epochs=1, batch_size=8, log_images=True)
    assert trainer.log_images and trainer.global_step == 5


class _FailsAtValidationEnd(Callback):
    def on_validation_end(self, trainer, epoch, metrics):
        raise RuntimeError("a callback's own failure")


def test_a_callback_failing_at_a_validation_still_leaves_that_validations_file(tmp_path):
    """The file was written after the callbacks: one raising in on_validation_end left no
    metrics/eval_epoch_<N>.json (the code before the day wrote it before them)."""
    x, y = _data()
    trainer = _trainer(tmp_path, callbacks=[_FailsAtValidationEnd()])
    with pytest.raises(RuntimeError, match="a callback's own failure"):
        trainer.train_model((x, y), (x[:8], y[:8]), num_epochs=2, batch_size=8)
    saved = json.loads((tmp_path / "run" / "metrics" / "eval_epoch_001.json").read_text())
    assert saved["val/loss"] == pytest.approx(trainer.eval_model((x[:8], y[:8]), batch_size=8)["loss"], rel=1e-5)
