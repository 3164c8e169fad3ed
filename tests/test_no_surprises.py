"""What a user asks for is what runs, and what runs is shown: the monitored metric, extra
keywords, the learning rate of a ready optax transformation, the loaders a callback can read."""

import csv
import warnings

import flax.linen as nn
import jax
import optax
import pytest
from conftest import RegressTrainer, TinyMLP, linear_data, quiet

import flaxlight
import flaxlight.zoo
from flaxlight.callbacks import LearningRateMonitor


def _trainer(tmp_path, **kwargs):
    kwargs.setdefault("optimizer_hparams", {"optimizer": "adam", "lr": 1e-2})
    return RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=linear_data(1)[0],
                          **quiet(tmp_path, **kwargs))


def _rows(tmp_path):
    with open(tmp_path / "run" / "metrics.csv", newline="") as f:
        return list(csv.DictReader(f))


def test_the_metric_that_picks_the_best_model_is_announced_once_with_the_fallback(tmp_path, regression_loaders,
                                                                                 capsys):
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path)
    trainer.train_model(train, val, num_epochs=2)
    err = capsys.readouterr().err
    assert ("The best model is picked by val/loss (min), the default among the validation metrics ['val/loss']; "
            "pass monitor='val/<name>', mode='min'/'max' to choose another.") in err
    assert "val_metric" not in err  # the seed's own metric name is no news to a user who never wrote it
    assert err.count("The best model is picked by") == 1


def test_a_chosen_monitor_is_announced_as_chosen(tmp_path, regression_loaders, capsys):
    train, val, _ = regression_loaders
    _trainer(tmp_path, monitor="val/loss", mode="min").train_model(train, val, num_epochs=1)
    assert "The best model is picked by val/loss (min).\n" in capsys.readouterr().err


def test_a_monitor_that_never_appears_fails_at_the_first_validation(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path, monitor="val/los", enable_checkpointing=False)
    with pytest.raises(KeyError, match=r"picked by monitor 'val/los', which no validation of this run logs: it is not "
                                       r"among the eval step's metrics \['val/loss'\].*Did you mean 'val/loss'\?"):
        trainer.train_model(train, val, num_epochs=3)
    assert trainer.current_epoch == 1


def test_extra_keywords_are_kept_and_listed_but_a_near_miss_is_an_error(tmp_path, capsys):
    trainer = _trainer(tmp_path, extra_args={"teacher": "small"})
    assert trainer.extra_hparams == {"extra_args": {"teacher": "small"}}
    assert trainer.config["extra_args"] == {"teacher": "small"}
    assert "extra hparams kept in the run's config (no trainer option reads them): extra_args." in \
        capsys.readouterr().err
    for typo, right in (("max_step", "max_steps"), ("check_val_every_n_nepoch", "check_val_every_n_epoch"),
                        ("log_every_n_step", "log_every_n_steps")):
        with pytest.raises(TypeError, match=rf"unknown keyword argument '{typo}'\. Did you mean '{right}'\?"):
            _trainer(tmp_path / typo, **{typo: 3})


class WeightedRegressTrainer(RegressTrainer):
    """docs/models.md's pattern: a loss weight of the trainer's own, passed up to be recorded."""

    def __init__(self, *args, w_aux: float = 1.0, **kwargs):
        super().__init__(*args, w_aux=w_aux, **kwargs)


def test_the_trainers_own_declared_keywords_are_not_listed_as_extra_hparams(tmp_path, capsys):
    """They were listed as "kept ... (no trainer option reads them)", as if the loss ignored them."""
    trainer = WeightedRegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]},
                                     optimizer_hparams={"optimizer": "adam", "lr": 1e-2},
                                     exmp_input=linear_data(1)[0], **quiet(tmp_path, w_aux=0.5, note="x"))
    assert trainer.config["w_aux"] == 0.5 and trainer.config["note"] == "x"  # both recorded, as before
    err = capsys.readouterr().err
    assert "WeightedRegressTrainer: extra hparams kept in the run's config (no trainer option reads them): note.\n" \
        in err and "w_aux" not in err


def test_learning_rate_monitor_reads_an_inject_hyperparams_rate(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    tx = optax.inject_hyperparams(optax.sgd)(learning_rate=0.05)
    trainer = _trainer(tmp_path, optimizer_hparams=tx, callbacks=[LearningRateMonitor()], log_every_n_steps=4)
    trainer.train_model(train, val, num_epochs=1)
    assert [float(r["train/lr"]) for r in _rows(tmp_path) if r.get("train/lr")] == pytest.approx([0.05, 0.05])


def test_learning_rate_monitor_says_once_when_it_cannot_read_the_rate(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path, optimizer_hparams=optax.adam(1e-3), callbacks=[LearningRateMonitor()],
                       log_every_n_steps=2)
    with pytest.warns(RuntimeWarning, match="optax.inject_hyperparams") as caught:
        trainer.train_model(train, val, num_epochs=1)
    assert sum("LearningRateMonitor" in str(w.message) for w in caught) == 1
    assert not any(r.get("train/lr") for r in _rows(tmp_path))


def test_callbacks_read_the_loaders(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    seen = []

    class ConfusionLike(flaxlight.Callback):
        def on_validation_end(self, trainer, epoch, metrics):
            seen.append((trainer.train_loader, trainer.val_loader, sum(len(y) for _, y in trainer.val_loader)))

    trainer = _trainer(tmp_path, callbacks=[ConfusionLike()])
    assert trainer.train_loader is None and trainer.val_loader is None
    trainer.train_model(train, val, num_epochs=2)
    assert seen == [(train, val, 64)] * 2


def test_the_summary_names_the_optimizer_with_its_defaults_and_hparams_records_them(tmp_path, capsys):
    import yaml

    trainer = _trainer(tmp_path, optimizer_hparams={"optimizer": "sgd", "lr": 0.1, "momentum": 0.9},
                       enable_model_summary=True)
    out = capsys.readouterr().out
    assert "Optimizer: sgd(lr=0.1, momentum=0.9) + warmup_cosine(warmup_steps=0, end_lr=0.001) + " \
           "clip_by_global_norm(1)" in out
    trainer.train_model(flaxlight.ArrayLoader(*linear_data(64, 0), batch_size=32), None, num_epochs=1)
    recorded = yaml.safe_load((tmp_path / "run" / "hparams.yaml").read_text())["optimizer_hparams"]
    assert recorded["schedule"] == "warmup_cosine" and recorded["gradient_clip"] == 1.0
    assert recorded["end_lr_factor"] == 0.01 and recorded["momentum"] == 0.9 and recorded["weight_decay"] == 0.0


def test_a_ready_optax_object_is_recorded_by_name_never_by_repr(tmp_path):
    trainer = _trainer(tmp_path, optimizer_hparams=optax.chain(optax.clip(1.0), optax.adam(1e-3)))
    trainer.train_model(flaxlight.ArrayLoader(*linear_data(64, 0), batch_size=32), None, num_epochs=1)
    text = (tmp_path / "run" / "hparams.yaml").read_text()
    assert "0x" not in text and "ready_optax: chain" in text and "pass it again as optimizer_hparams" in text


def test_polyak_sgd_runs_with_a_plain_lr_and_says_its_schedule_is_constant(tmp_path, regression_loaders, capsys):
    """No schedule and no clipping unless asked for: both would change Polyak's step."""
    train, val, _ = regression_loaders
    trainer = _trainer(tmp_path, optimizer_hparams={"optimizer": "polyak_sgd", "lr": 1.0}, enable_model_summary=True)
    assert "Optimizer: polyak_sgd(lr=1)\n" in capsys.readouterr().out
    best = trainer.train_model(train, val, num_epochs=2)
    assert best["val/loss"] < 1.0
    with pytest.raises(ValueError, match="takes a fixed step size"):  # a schedule asked for explicitly
        _trainer(tmp_path / "explicit", optimizer_hparams={"optimizer": "polyak_sgd", "lr": 1.0,
                                                          "schedule": "warmup_cosine"})


class FlatOnly(nn.Module):
    """Dense layers on (batch, features) inputs only (no flattening of its own)."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(1)(nn.relu(nn.Dense(8)(x)))


class ReshapingRegressor(RegressTrainer):
    """A loss that flattens image-shaped batches itself (as Lightning's ``x.view(x.size(0), -1)``)."""

    def loss_fn(self, params, batch, *, train, rng, state):
        x, y = batch
        return super().loss_fn(params, (x.reshape(x.shape[0], -1), y), train=train, rng=rng, state=state)


def _image_batches():
    x, y = linear_data(64, 0)
    return flaxlight.ArrayLoader(x.reshape(64, 2, 2, 1), y, batch_size=32)


def test_a_loss_that_reshapes_the_batch_trains_without_a_word(tmp_path, regression_loaders):
    import warnings

    trainer = ReshapingRegressor(model_class=FlatOnly, model_hparams={}, exmp_input=linear_data(1)[0],
                                 optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, **quiet(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        trainer.train_model(_image_batches(), _image_batches(), num_epochs=1)
    assert trainer.global_step == 2


def test_a_batch_the_loss_cannot_take_fails_with_both_explanations(tmp_path):
    trainer = RegressTrainer(model_class=FlatOnly, model_hparams={}, exmp_input=linear_data(1)[0],
                             optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, **quiet(tmp_path))
    with pytest.raises(ValueError, match=r"(?s)has shape \(32, 2, 2, 1\) but the model was initialised with .*"
                                         r"Tracing loss_fn on this batch failed too: ScopeParamShapeError"):
        trainer.train_model(_image_batches(), None, num_epochs=1)
    unchecked = RegressTrainer(model_class=FlatOnly, model_hparams={}, exmp_input=linear_data(1)[0],
                               optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, check_batches=False,
                               **quiet(tmp_path / "unchecked"))
    with pytest.raises(Exception, match="ScopeParamShapeError|expected to generate shape"):  # the model's own error
        unchecked.train_model(_image_batches(), None, num_epochs=1)


def test_where_flaxlight_feeds_the_batch_to_the_model_a_mismatch_is_an_error(tmp_path):
    import numpy as np

    from flaxlight.zoo import ClassificationTrainer, MLPClassifier

    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    y = np.arange(64) % 3
    trainer = ClassificationTrainer(model_class=MLPClassifier, model_hparams={"hidden_dims": [8], "num_classes": 3},
                                    exmp_input=x[:1], optimizer_hparams={"optimizer": "adam", "lr": 1e-2},
                                    **quiet(tmp_path))
    with pytest.raises(ValueError, match=r"has shape \(32, 2, 2\) but the model was initialised with"):
        trainer.train_model(flaxlight.ArrayLoader(x.reshape(64, 2, 2), y, batch_size=32), None, num_epochs=1)


def test_a_run_trained_with_a_ready_optax_object_loads_for_inference_and_asks_for_it_to_resume(tmp_path):
    import numpy as np

    tx = optax.chain(optax.clip(1.0), optax.adam(1e-3))
    trainer = _trainer(tmp_path, optimizer_hparams=tx)
    trainer.train_model(flaxlight.ArrayLoader(*linear_data(64, 0), batch_size=32), None, num_epochs=1)
    loaded = RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=linear_data(1)[0])
    for got, want in zip(jax.tree.leaves(loaded.state.params), jax.tree.leaves(trainer.state.params)):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match=r"ready optax transformation \(chain\).*optimizer_hparams=tx"):
        RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=linear_data(1)[0], with_optimizer=True)
    again = RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=linear_data(1)[0], with_optimizer=True,
                                                optimizer_hparams=tx)
    assert again.state.opt_state is not None


def test_flax_mnist_settings_with_constant_schedule_and_no_clipping_train_as_the_hand_loop(tmp_path):
    """Flax's MNIST example settings (sgd 0.1, momentum 0.9) given with schedule="constant",
    gradient_clip=None run exactly optax.sgd(0.1, momentum=0.9): the same params as a hand loop."""
    import jax.numpy as jnp
    import numpy as np
    from conftest import ClassifyTrainer
    from sklearn.datasets import load_digits

    digits = load_digits()
    x, y = (digits.data[:512] / 16.0).astype(np.float32), digits.target[:512].astype(np.int32)
    hparams = {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "schedule": "constant", "gradient_clip": None}
    trainer = ClassifyTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [32], "output_dim": 10},
                              optimizer_hparams=hparams, exmp_input=x[:1], **quiet(tmp_path))
    params, tx = jax.tree.map(jnp.array, trainer.state.params), optax.sgd(0.1, momentum=0.9)
    trainer.train_model(flaxlight.ArrayLoader(x, y, batch_size=64), None, num_epochs=3)

    def loss(p, xb, yb):
        logits = trainer.model.apply({"params": p}, xb)
        return optax.softmax_cross_entropy_with_integer_labels(logits, yb).mean()

    @jax.jit
    def step(p, opt_state, xb, yb):
        grads = jax.grad(loss)(p, xb, yb)
        updates, opt_state = tx.update(grads, opt_state, p)
        return optax.apply_updates(p, updates), opt_state

    opt_state = tx.init(params)
    for _ in range(3):
        for i in range(0, 512, 64):
            params, opt_state = step(params, opt_state, x[i:i + 64], y[i:i + 64])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), trainer.state.params, params)


def _zoo_trainer(tmp_path, trainer_class, model_class, **hparams):
    import numpy as np

    return trainer_class(model_class=model_class, model_hparams=hparams, exmp_input=np.zeros((1, 4), np.float32),
                         optimizer_hparams={"optimizer": "sgd", "lr": 1e-3, "schedule": "constant"}, **quiet(tmp_path))


def test_the_regression_trainer_compares_outputs_b1_with_targets_b_element_by_element(tmp_path):
    """Outputs (B, 1) against targets (B,) broadcast to a (B, B) loss before: a wrong val/loss."""
    import numpy as np

    x, y = linear_data(40, 0)
    target = y[:, 0] + 0.5
    trainer = _zoo_trainer(tmp_path, flaxlight.zoo.RegressionTrainer, TinyMLP)
    val_loss = trainer.eval_model(flaxlight.ArrayLoader(x, target, batch_size=40))["loss"]
    pred = np.asarray(trainer.bind_model()(x))[:, 0]
    assert val_loss == pytest.approx(float(np.mean((pred - target) ** 2)), rel=1e-5)
    with pytest.raises(ValueError, match=r"outputs have shape \(40, 1\) but the batch's targets have shape \(40, 2\)"):
        trainer.eval_model(flaxlight.ArrayLoader(x, np.zeros((40, 2), np.float32), batch_size=40))


class TwoHeads(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(3)(x), nn.Dense(1)(x)


def test_the_classification_trainer_takes_b1_labels_and_names_other_shapes(tmp_path):
    import numpy as np

    x = np.random.default_rng(0).normal(size=(48, 4)).astype(np.float32)
    y = np.arange(48) % 3
    trainer = _zoo_trainer(tmp_path / "a", flaxlight.zoo.ClassificationTrainer, TinyMLP, output_dim=3)
    flat = trainer.eval_model(flaxlight.ArrayLoader(x, y, batch_size=16))
    column = trainer.eval_model(flaxlight.ArrayLoader(x, y[:, None], batch_size=16))
    assert column == pytest.approx(flat)
    with pytest.raises(ValueError, match=r"labels must have shape \(16,\).*One-hot labels: pass y.argmax\(-1\)"):
        trainer.eval_model(flaxlight.ArrayLoader(x, np.eye(3, dtype=np.int32)[y], batch_size=16))
    two_heads = _zoo_trainer(tmp_path / "b", flaxlight.zoo.ClassificationTrainer, TwoHeads)
    with pytest.raises(TypeError, match="needs the model to return one array; it returned a tuple"):
        two_heads.eval_model(flaxlight.ArrayLoader(x, y, batch_size=16))


def test_resume_from_a_step_that_was_not_kept_names_the_steps_that_were(tmp_path, regression_loaders):
    train, val, _ = regression_loaders
    _trainer(tmp_path).train_model(train, val, num_epochs=2)
    kept = sorted(int(path.name) for path in (tmp_path / "run" / "checkpoints").iterdir() if path.name.isdigit())
    with pytest.raises(FileNotFoundError, match=rf"No checkpoint of step 99999 in .*checkpoints: it holds steps "
                                                rf"{', '.join(map(str, kept))}\. By default only the best and the last"):
        _trainer(tmp_path, logger_params={"log_dir": str(tmp_path / "run2")}).train_model(
            train, val, num_epochs=3, resume_from=tmp_path / "run" / "checkpoints" / "99999")


def test_a_monitor_whose_name_reads_as_a_score_with_the_default_min_mode_is_warned_at_the_users_line(tmp_path):
    """``monitor="val/acc"`` without ``mode`` keeps the lowest accuracy (mode defaults to 'min', as in
    Lightning): said at construction, attributed to the line that wrote it, for the trainer and both
    callbacks; a mode that fits the name, or a name that tells nothing, is not warned about."""
    with pytest.warns(UserWarning, match=r"the trainer: monitor='val/acc' with mode='min' keeps the lowest val/acc, "
                                         r"but its name reads as a metric to maximize: pass mode='max'") as caught:
        _trainer(tmp_path / "a", monitor="val/acc")
    assert {w.filename for w in caught if "monitor='val/acc'" in str(w.message)} == {__file__}
    with pytest.warns(UserWarning, match=r"EarlyStopping: monitor='val/f1' with mode='min' keeps the lowest") as caught:
        flaxlight.callbacks.EarlyStopping(monitor="val/f1")
    assert caught[0].filename == __file__
    with pytest.warns(UserWarning, match=r"ModelCheckpoint: monitor='val/loss' with mode='max' keeps the highest "
                                         r"val/loss, but its name reads as a metric to minimize: pass mode='min'"):
        flaxlight.callbacks.ModelCheckpoint(monitor="val/loss", mode="max")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        flaxlight.callbacks.EarlyStopping(monitor="val/acc", mode="max")
        flaxlight.callbacks.ModelCheckpoint(monitor="val/logits_norm")
        _trainer(tmp_path / "b", monitor="val/loss")


# What a monitor's name reads as (None: it does not tell), by the words of its last path component.
NAME_DIRECTIONS = [
    ("val/acc", "max"), ("val/digit_acc", "max"), ("val/acc_digit", "max"), ("val/digit/f1_macro", "max"),
    ("f1_macro", "max"), ("auc_parity", "max"), ("val/acc-digit", "max"), ("acc@1", "max"), ("mean_iou", "max"),
    ("top1_acc", "max"), ("r2_score", "max"), ("train_acc_epoch", "max"), ("score", "max"), ("map", "max"),
    ("val/loss", "min"), ("val/loss_digit", "min"), ("mse_target", "min"), ("val_loss", "min"), ("valloss", "min"),
    ("error_rate", "min"), ("top5_error", "min"), ("f1_loss", "min"), ("weight_loss", "min"),
    ("train/loss_step", "min"), ("val/val_metric", "min"),
    ("loss_scale", None), ("lr", None), ("acc_steps", None), ("grad_acc_steps", None), ("num_correct", None),
    ("num_loss_spikes", None), ("error_count", None), ("acc_drop", None), ("neg_mean_squared_error", None),
    ("neg_log_loss", None), ("brier_score", None), ("heat_map", None), ("val/logits_norm", None),
    ("epoch_time", None),
    # Qualifiers (top-k, numbers, what follows at / @) do not decide: an error spelled error-first is an error.
    ("val/err_top5", "min"), ("val/error_top1", "min"), ("top5_err", "min"), ("top1_error", "min"),
    ("val/error_top_1", "min"), ("val/error_rate_top5", "min"), ("val/calibration_error_top1", "min"),
    ("val/fpr_at_recall_95", "min"), ("recall_at_fpr_1", "max"), ("val/loss_at_best_acc", "min"),
    ("accuracy_top5", "max"), ("top5_accuracy", "max"), ("val/top_5_accuracy", "max"), ("acc5", "max"),
    ("top1", "max"), ("recall@10", "max"), ("precision_at_thresh", "max"), ("map_50", "max"), ("ndcg@10", None),
    # A word after the score or loss that makes it another quantity: lm-eval-harness's acc_stderr.
    ("acc_stderr", None), ("acc_time", None), ("acc_n", None), ("f1_support", None), ("acc_ci95", None),
    ("loss_runtime", None), ("std_of_acc", None), ("val/drop_in_acc", None),
    # A score and a loss or an error whose positions leave it open: told nothing (a loss of a score is a loss).
    ("loss_acc", None), ("acc_err", None), ("val/ece_acc", None), ("nll_f1", None), ("dice_loss", "min"),
    ("1-acc", None), ("inaccuracy", "min"),
    ("acc_digit", "max"), ("loss_digit", "min"), ("f1_macro", "max"), ("loss_total", "min"), ("total_loss", "min"),
    ("mean_iou", "max"), ("psnr", None), ("bleu", "max"), ("wer", "min"), ("perplexity", "min"),
]


@pytest.mark.parametrize("name, reads_as", NAME_DIRECTIONS)
def test_a_monitor_whose_names_words_read_as_the_other_mode_is_warned_about_and_no_other(name, reads_as):
    """Only the whole name or its ending was read: per-task names (val/acc_digit, val/loss_digit,
    f1_macro) were never warned about, so the worst model was kept silently; neg_log_loss (sklearn's,
    maximized) was warned about with mode='max'. Then the last known word decided: val/err_top5 and
    val/fpr_at_recall_95 read as scores (the right mode='min' warned about, tune maximized the error),
    acc_stderr, acc_time and f1_support as accuracies (review)."""
    for mode in ("min", "max"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            flaxlight.callbacks.EarlyStopping(monitor=name, mode=mode)
        said = [str(w.message) for w in caught if "its name reads as a metric to" in str(w.message)]
        assert len(said) == (reads_as is not None and reads_as != mode), (mode, said)


def test_a_per_task_accuracy_monitor_with_the_default_mode_is_warned_about_for_the_trainer_and_callbacks(tmp_path):
    with pytest.warns(UserWarning) as caught:
        _trainer(tmp_path, monitor="val/acc_digit",
                 callbacks=[flaxlight.callbacks.EarlyStopping("val/acc_digit"),
                            flaxlight.callbacks.ModelCheckpoint(monitor="val/acc_digit")])
    said = sorted(str(w.message).split(":")[0] for w in caught if "reads as a metric to maximize: pass mode='max'"
                  in str(w.message))
    assert said == ["EarlyStopping", "ModelCheckpoint", "the trainer"]


def test_editing_the_optimizer_dict_after_building_a_trainer_changes_nothing_of_it(tmp_path):
    """A notebook's next cell set opt["lr"] = 0.5 for another trainer: the first trainer's next
    train_model trained at 0.5 while its hparams.yaml, summary and checkpoints said 0.002."""
    import numpy as np

    opt = {"optimizer": "sgd", "lr": 0.002, "schedule": "constant", "gradient_clip": None}
    x, y = linear_data(64, 0)

    def build(name, hparams):
        return RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=x[:1],
                              optimizer_hparams=hparams, **quiet(tmp_path / name))

    first = build("first", opt)
    opt["lr"] = 0.5  # the next cell's setting, for another trainer
    second = build("second", opt)
    opt["lr"] = 9.0
    first.train_model((x, y), None, num_epochs=1, batch_size=64)
    reference = build("reference", {**opt, "lr": 0.002})
    reference.train_model((x, y), None, num_epochs=1, batch_size=64)
    for a, b in zip(jax.tree.leaves(first.state.params), jax.tree.leaves(reference.state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert (first.optimizer_hparams["lr"], second.optimizer_hparams["lr"]) == (0.002, 0.5)
