"""Fine-tuning (docs/models.md, "Fine-tuning"): the optimizer's ``freeze`` setting, a moving
average (``ema_decay``) kept for a part of the parameters (``freeze``, or groups of
``optax.multi_transform`` built with ``make_optimizer``), and the docs that point at them."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import yaml
from conftest import RegressTrainer, TinyMLP, TinyNNX, linear_data, quiet

import flaxlight
from flaxlight import optim
from flaxlight.optim import OptimizerConfig, describe_optimizer, ema_params, make_optimizer, recorded_optimizer

DOCS = Path(__file__).resolve().parents[1] / "docs"
FROZEN = ("body", "norm")


@pytest.fixture(autouse=True)
def _fresh_log_once():
    """The 'said once' notes are once per process; each test starts from a clean slate."""
    optim._logged.clear()
    yield
    optim._logged.clear()


def _params():
    """A backbone (``body``, ``norm``) and a ``head``, as a Flax parameter tree."""
    k = jax.random.split(jax.random.PRNGKey(0), 3)
    return {"body": {"kernel": jax.random.normal(k[0], (3, 4)), "bias": jnp.full((4,), 0.5)},
            "norm": {"scale": jnp.full((4,), 1.5), "bias": jnp.full((4,), -0.25)},
            "head": {"kernel": jax.random.normal(k[1], (4, 2)), "bias": jnp.full((2,), 0.1)}}


def _grads(params, seed):
    keys = jax.random.split(jax.random.PRNGKey(seed), len(jax.tree.leaves(params)))
    leaves = [10.0 * jax.random.normal(key, leaf.shape) for key, leaf in zip(keys, jax.tree.leaves(params))]
    return jax.tree.unflatten(jax.tree.structure(params), leaves)


def _train(tx, params, steps=6):
    state = tx.init(params)
    update = jax.jit(lambda g, s, p: tx.update(g, s, p, value=jnp.float32(1.0)))
    for i in range(steps):
        updates, state = update(_grads(params, i + 1), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def _bitwise(a, b) -> bool:
    return all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)))


# --------------------------------------------------------------------------- freeze: the values
@pytest.mark.parametrize("hparams", [
    {"optimizer": "adamw", "lr": 1e-2},                                        # adamw's default decay, 1e-4
    {"optimizer": "adamw", "lr": 1e-2, "weight_decay": 0.1, "weight_decay_exclude": ()},
    {"optimizer": "sgd", "lr": 0.1, "momentum": 0.9, "weight_decay": 0.1},     # decay chained after sgd
    {"optimizer": "lion", "lr": 1e-3, "weight_decay": 0.1, "schedule": "one_cycle"},
    {"optimizer": "adam", "lr": 1e-2, "weight_decay": 0.1, "gradient_clip": 0.01, "gradient_clip_value": 1e-3},
    {"optimizer": "adamw", "lr": 1e-2, "weight_decay": 0.1, "accumulate_grad_batches": 2, "ema_decay": 0.5,
     "warmup_steps": 1, "reduce_on_plateau": {"patience": 0}},
    {"optimizer": "sgd", "lr": 0.1, "weight_decay": 0.1, "weight_decay_mode": "l2"},
], ids=["adamw-default-decay", "adamw-decay", "sgd-momentum-decay", "lion-one-cycle", "adam-clipping",
        "accumulation-ema-plateau", "l2"])
def test_frozen_parameters_stay_bitwise_unchanged_under_every_setting(hparams):
    """A gradient zeroed before the optimizer (the documented compute_gradients recipe) left
    decoupled decay and momentum acting: 'frozen' kernels shrank. ``freeze`` did not exist."""
    params = _params()
    after, state = _train(make_optimizer({**hparams, "freeze": list(FROZEN)}, total_steps=12), params)
    for layer in FROZEN:
        assert _bitwise(after[layer], params[layer]), layer
    assert not np.array_equal(after["head"]["kernel"], params["head"]["kernel"])
    if "ema_decay" in hparams:  # the average of the trained part, the frozen part as it is
        averaged = ema_params(state, after)
        assert _bitwise(averaged["body"], params["body"]) and averaged["head"]["kernel"].shape == (4, 2)


def test_frozen_gradients_are_not_in_the_global_norm_of_the_clip():
    """As in Keras, where frozen weights are not trainable: only the trained gradients are clipped."""
    params = _params()
    tx = make_optimizer({"optimizer": "sgd", "lr": 1.0, "schedule": "constant", "gradient_clip": 1.0,
                         "freeze": ["body"]}, total_steps=10)
    grads = jax.tree.map(lambda p: jnp.full(p.shape, 0.1), params)
    grads["body"]["kernel"] = jnp.full((3, 4), 100.0)  # would scale every update down by ~350
    updates, _ = tx.update(grads, tx.init(params), params)
    norm = np.sqrt(sum(float(jnp.sum(g ** 2)) for g in jax.tree.leaves({k: grads[k] for k in ("norm", "head")})))
    assert norm < 1.0
    np.testing.assert_allclose(updates["head"]["kernel"], -grads["head"]["kernel"], rtol=1e-6)  # not clipped
    assert not np.any(np.asarray(updates["body"]["kernel"]))


def test_the_l2_penalty_leaves_frozen_parameters_out():
    params = _params()
    config = OptimizerConfig.from_dict({"optimizer": "sgd", "weight_decay": 0.5, "weight_decay_mode": "l2",
                                        "freeze": ["body"]})
    kernel = params["head"]["kernel"]
    np.testing.assert_allclose(config.l2_regularizer()(params), 0.25 * jnp.sum(kernel ** 2), rtol=1e-6)


def test_a_group_whose_rate_is_zero_until_an_update_stays_bitwise_unchanged_until_then():
    """docs/models.md's one-run unfreezing (Lightning's BaseFinetuning): adamw scales its decay by the rate."""
    params = _params()
    labels = lambda p: {k: jax.tree.map(lambda _: "head" if k == "head" else "backbone", v) for k, v in p.items()}

    def tx(total_steps):
        backbone = flaxlight.make_optimizer({"optimizer": "adamw", "weight_decay": 0.1,
                                             "schedule": lambda update: jnp.where(update < 3, 0.0, 1e-2)}, total_steps)
        return optax.multi_transform({"backbone": backbone, "head": make_optimizer({"lr": 1e-2}, total_steps)}, labels)

    early, _ = _train(tx(10), params, steps=3)
    late, _ = _train(tx(10), params, steps=5)
    assert _bitwise({k: early[k] for k in FROZEN}, {k: params[k] for k in FROZEN})
    assert not np.array_equal(late["body"]["kernel"], params["body"]["kernel"])


# --------------------------------------------------------------------------- freeze: names and errors
def test_names_are_paths_matched_in_a_row_with_wildcards():
    params = {"encoder": {"layers_0": {"kernel": 1.0, "bias": 0.0}, "layers_1": {"kernel": 1.0}},
              "head": {"kernel": 1.0, "bias": 0.0}}
    frozen = lambda *names: sorted("/".join(map(str, (k.key for k in path)))
                                   for path, flag in jax.tree_util.tree_flatten_with_path(
                                       optim.make_freeze_mask(names)(params))[0] if flag)
    assert frozen("encoder") == ["encoder/layers_0/bias", "encoder/layers_0/kernel", "encoder/layers_1/kernel"]
    assert frozen("encoder/layers_0") == frozen("encoder.layers_0") == frozen("layers_0")
    assert frozen("layers_*/kernel") == ["encoder/layers_0/kernel", "encoder/layers_1/kernel"]
    assert frozen("head/bias") == ["head/bias"]
    assert frozen("bias") == ["encoder/layers_0/bias", "head/bias"]


def test_names_that_match_no_parameter_are_refused_with_the_parameter_paths(tmp_path):
    x, y = linear_data(16)
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8], "batch_norm": True},
                             exmp_input=x[:1], **quiet(tmp_path),
                             optimizer_hparams={"optimizer": "adam", "freeze": ["Dens_0", "BatchNorm_0", "dense_1"]})
    with pytest.raises(ValueError) as info:
        trainer.train_model((x, y), None, num_epochs=1, batch_size=8)
    message = str(info.value)
    assert "optimizer_hparams['freeze'] names 'Dens_0', 'dense_1', which match no parameter of this model, so " \
           "they would freeze nothing" in message
    assert "this model's parameters are BatchNorm_0/bias, BatchNorm_0/scale, Dense_0/bias, Dense_0/kernel, " \
           "Dense_1/bias, Dense_1/kernel." in message
    assert "Did you mean 'Dense_0' for 'Dens_0'?" in message and "Did you mean 'Dense_1' for 'dense_1'?" in message
    assert not (tmp_path / "run" / "hparams.yaml").exists()  # refused before the run was written


@pytest.mark.parametrize("hparams, fragment", [
    ({"freeze": 3}, "optimizer_hparams['freeze'] must be a list of layer or parameter paths, e.g. ['body']"),
    ({"freeze": ["body", ""]}, "must be a list of layer or parameter paths"),
    ({"optimizer": "lbfgs", "lr": None, "schedule": "constant", "freeze": ["body"]},
     "'lbfgs' cannot freeze parameters (freeze=['body'])"),
    ({"frozen": ["body"]}, "Unknown key 'frozen' in optimizer_hparams for optimizer 'adamw'. Did you mean 'freeze'?"),
])
def test_bad_freeze_settings_are_refused_when_the_settings_are_read(hparams, fragment):
    with pytest.raises(ValueError) as info:
        OptimizerConfig.from_dict(hparams)
    assert fragment in str(info.value)


def test_weight_decay_names_are_checked_against_every_parameter_frozen_ones_included():
    """The decayed chain sees only the trained parameters: a name of a frozen one is not a typo."""
    params = {**_params(), "embed": {"embedding": jnp.ones((5, 3))}}
    hparams = {"optimizer": "adamw", "weight_decay": 0.1, "freeze": ["embed"]}
    make_optimizer({**hparams, "weight_decay_exclude": ["bias", "scale", "embedding"]}, 10).init(params)
    with pytest.raises(ValueError, match=r"weight_decay_exclude names 'biases', which match no parameter.*"
                                         r"Did you mean 'bias' for 'biases'\?"):
        make_optimizer({**hparams, "weight_decay_exclude": ["biases"]}, 10).init(params)


def test_the_summary_the_log_and_the_run_record_say_what_is_frozen(caplog):
    hparams = {"optimizer": "adamw", "lr": 1e-3, "weight_decay": 0.01, "freeze": "body"}
    assert describe_optimizer(hparams).endswith("+ weight_decay(0.01, decoupled, not on ['bias', 'scale']) + "
                                                "freeze(['body'])")
    assert recorded_optimizer(hparams)["freeze"] == ["body"]
    assert "freeze" not in recorded_optimizer({"optimizer": "adamw"})  # the record of runs written before it
    assert OptimizerConfig.from_dict(recorded_optimizer(hparams)).freeze == ("body",)  # it loads back
    with caplog.at_level(logging.INFO, logger="flaxlight"):
        make_optimizer(hparams, 10).init(_params())
    assert "freeze ['body']: 2 of 6 parameter arrays stay fixed (16 of 34 values): body/bias, body/kernel." \
           in caplog.text


# --------------------------------------------------------------------------- freeze: in a trainer
@pytest.mark.parametrize("model_class, model_hparams, freeze, frozen_layers", [
    (TinyMLP, {"hidden_dims": [8], "batch_norm": True}, ["Dense_0", "BatchNorm_0"], ["Dense_0", "BatchNorm_0"]),
    (TinyNNX, {"hidden_dims": [8], "batch_norm": True}, ["layers"], ["layers"]),
], ids=["linen", "nnx"])
def test_a_trainer_keeps_a_frozen_backbone_bitwise_and_records_the_list(tmp_path, model_class, model_hparams,
                                                                        freeze, frozen_layers):
    """The report's case: adamw with its default decay (no weight_decay given), ema_decay, clipping."""
    x, y = linear_data(64)
    trainer = RegressTrainer(model_class=model_class, model_hparams=model_hparams, exmp_input=x[:1],
                             optimizer_hparams={"optimizer": "adamw", "lr": 1e-2, "freeze": freeze, "ema_decay": 0.9},
                             **quiet(tmp_path))
    before = jax.device_get(trainer.state.params)
    trainer.train_model((x, y), (x, y), num_epochs=2, batch_size=16)
    after = jax.device_get(trainer.state.params)
    for layer in frozen_layers:
        assert _bitwise(after[layer], before[layer]), layer
    head = [k for k in after if k not in frozen_layers][-1]
    assert not _bitwise(after[head], before[head])
    assert _bitwise(ema_params(trainer.state)[frozen_layers[0]], before[frozen_layers[0]])
    record = yaml.safe_load((tmp_path / "run" / "hparams.yaml").read_text())["optimizer_hparams"]
    assert record["freeze"] == freeze and record["weight_decay"] == pytest.approx(1e-4)
    loaded = RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=x[:1], which="last")
    assert _bitwise(jax.device_get(loaded.state.params)[frozen_layers[0]], before[frozen_layers[0]])


def test_freeze_from_a_config_file_and_an_override(tmp_path):
    from flaxlight.config import ConfigError, build_run, fit, load_config

    config = yaml.safe_load((Path(__file__).resolve().parents[1] / "examples" / "configs" /
                             "sine_regression.yaml").read_text())
    config["model"]["hparams"]["hidden_dims"] = [8, 8]
    config["optimizer"]["freeze"] = ["Dense_0"]
    quick = ["trainer.max_epochs=1", "trainer.check_val_every_n_epoch=1", "data.batch_size=100",
             "trainer.enable_progress_bar=false"]
    cfg = load_config(config, [*quick, "optimizer.freeze=[Dense_0, Dense_1/kernel]"])
    assert cfg.optimizer.freeze == ("Dense_0", "Dense_1/kernel")
    run = build_run(cfg, log_dir=tmp_path / "run")
    trainer = run["trainer"]
    before = jax.device_get(trainer.state.params)
    trainer.train_model(run["train_loader"], run["val_loader"], num_epochs=1)
    after = jax.device_get(trainer.state.params)
    assert _bitwise(after["Dense_0"], before["Dense_0"])
    assert np.array_equal(after["Dense_1"]["kernel"], before["Dense_1"]["kernel"])
    assert not np.array_equal(after["Dense_1"]["bias"], before["Dense_1"]["bias"])
    saved = load_config(tmp_path / "run" / "config.yaml")
    assert saved.optimizer.freeze == ("Dense_0", "Dense_1/kernel")
    with pytest.raises(ConfigError, match=r"the run cannot start: optimizer_hparams\['freeze'\] names 'Dense_7'"):
        fit(config, [*quick, "optimizer.freeze=[Dense_7]", f"trainer.logger_params.log_dir={tmp_path / 'bad'}"])


# --------------------------------------------------------------------------- ema_decay in groups (finding 3)
def _groups(params):
    return {k: jax.tree.map(lambda _: "frozen" if k in ("Dense_0", "BatchNorm_0") else "train", v)
            for k, v in params.items()}


def _two_rates(params):
    return {k: jax.tree.map(lambda _: "low" if k in ("Dense_0", "BatchNorm_0") else "high", v)
            for k, v in params.items()}


@pytest.mark.parametrize("factory", [
    lambda n: optax.multi_transform({"train": make_optimizer({"optimizer": "adamw", "lr": 1e-2, "ema_decay": 0.9}, n),
                                     "frozen": optax.set_to_zero()}, _groups),
    lambda n: optax.multi_transform({"low": make_optimizer({"optimizer": "adamw", "lr": 1e-3, "ema_decay": 0.9}, n),
                                     "high": make_optimizer({"optimizer": "adamw", "lr": 1e-2, "ema_decay": 0.9}, n)},
                                    _two_rates),
], ids=["frozen-group", "two-rates"])
def test_ema_decay_in_groups_of_multi_transform_evaluates_with_the_whole_average(tmp_path, factory):
    """train_model failed at its start with a dot_general shape error: evaluation took one
    group's average, with empty placeholders for the others, as the parameters."""
    x, y = linear_data(64)
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8], "batch_norm": True},
                             exmp_input=x[:1], optimizer_hparams=factory, **quiet(tmp_path))
    before = jax.device_get(trainer.state.params)
    trainer.train_model((x, y), (x, y), num_epochs=2, batch_size=16)
    averaged = ema_params(trainer.state)
    assert jax.tree.map(np.shape, averaged) == jax.tree.map(np.shape, trainer.state.params)
    if "frozen" in str(trainer.state.opt_state):  # the frozen group keeps no average: the parameters as they are
        assert _bitwise(averaged["Dense_0"], before["Dense_0"])
    assert not _bitwise(averaged["Dense_1"], trainer.state.params["Dense_1"])  # an average, not the parameters
    pred, _ = trainer.state.apply_model(averaged, x, train=False)
    expected = float(jnp.mean((pred - y) ** 2))
    assert trainer.eval_model((x, y), batch_size=64)["loss"] == pytest.approx(expected, rel=1e-5)
    np.testing.assert_allclose(trainer.predict(x, batch_size=64), pred, rtol=1e-5, atol=1e-6)


def test_ema_params_of_a_partial_average_without_the_parameters_says_what_to_pass():
    params = _params()
    tx = make_optimizer({"optimizer": "adam", "ema_decay": 0.9, "freeze": ["body"]}, 10)
    opt_state = tx.init(params)
    with pytest.raises(ValueError, match=r"keeps a moving average \(ema_decay\) of a part of the parameters only "
                                         r"\(ema_decay with freeze, or in a group of optax.multi_transform\): pass "
                                         r"the TrainState, ema_params\(state\), or the parameters"):
        ema_params(opt_state)
    assert _bitwise(ema_params(opt_state, params), params)
    covering = optax.multi_transform({"a": make_optimizer({"ema_decay": 0.9}, 10), "b": make_optimizer(
        {"ema_decay": 0.5}, 10)}, lambda p: {k: jax.tree.map(lambda _: "a" if k == "body" else "b", v)
                                             for k, v in p.items()})
    assert _bitwise(ema_params(covering.init(params)), params)  # every part averaged: no parameters needed


def test_tensor_parallel_shardings_follow_parameters_through_a_frozen_group():
    """A frozen group keeps placeholders (optax.MaskedNode) in the optimizer state, which the
    shardings of annotated (tensor-parallel) parameters did not expect."""
    from jax.sharding import Mesh

    from flaxlight import distributed
    from flaxlight.state import TrainState

    params = _params()
    labels = {k: jax.tree.map(lambda _: "frozen" if k == "body" else "train", v) for k, v in params.items()}
    mesh = Mesh(np.array(jax.devices()[:1]).reshape(1, 1), ("data", "model"))
    annotations = {"body": {"kernel": ("embed", "mlp"), "bias": ("mlp",)},
                   "norm": {"scale": ("mlp",), "bias": ("mlp",)}, "head": {"kernel": ("mlp", None), "bias": (None,)}}
    for make_tx in (lambda: optax.multi_transform({"train": optax.adam(1e-3), "frozen": optax.set_to_zero()}, labels),
                    lambda: make_optimizer({"optimizer": "adam", "freeze": ["body"]}, 10)):
        tx = make_tx()
        state = TrainState.create(apply_fn=None, params=params, tx=tx, rng=jax.random.PRNGKey(0))
        shardings = distributed.state_shardings(state, mesh, "data_parallel", annotations=annotations,
                                                rules=[("embed", None), ("mlp", "model")])
        assert jax.tree.structure(shardings.opt_state) == jax.tree.structure(state.opt_state)
        assert int(jax.device_put(state, shardings).step) == 0


# --------------------------------------------------------------------------- docs (finding 6)
def _anchor(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_the_fine_tuning_section_and_the_links_to_it():
    models = (DOCS / "models.md").read_text()
    assert "\n## Fine-tuning\n" in models
    anchors = {_anchor(line.lstrip("#")) for line in models.splitlines() if line.startswith("#")}
    section = models.split("\n## Fine-tuning\n", 1)[1].split("\n## ", 1)[0]
    for recipe in ("Warm start", "Freezing layers", "Per-layer learning rates", "Gradual unfreezing",
                   "A new head: restore only the backbone"):
        assert f"### {recipe}" in section, recipe
    assert section.count("<!-- runnable -->") >= 7  # every recipe is run by tests/test_docs.py
    assert "To change the gradients (freeze a part" not in models  # the recipe that did not freeze
    pages = {name: (DOCS / name).read_text() for name in ("from-lightning.md", "from-keras.md", "optimizers.md")}
    for name, text in pages.items():
        for anchor in re.findall(r"\(models\.md#([\w-]+)\)", text):
            assert anchor in anchors, (name, anchor)
    lightning, keras = pages["from-lightning.md"], pages["from-keras.md"]
    for said in ("`self.backbone.freeze()`", "`BaseFinetuning`", "parameter groups in `configure_optimizers`",
                 "`load_from_checkpoint(path, strict=False)`"):
        assert said in lightning and "models.md#" in next(row for row in lightning.splitlines() if said in row), said
    for said in ("`layer.trainable = False`", "`model.load_weights(path, skip_mismatch=True)`"):
        assert said in keras and "models.md#" in next(row for row in keras.splitlines() if said in row), said


def test_a_resume_with_another_layer_frozen_says_the_optimizer_changed_not_that_the_checkpoint_is_damaged(tmp_path):
    """Dense_1 frozen, then resumed (or loaded with its optimizer) with Dense_2 frozen: the same shapes at
    other places. It was "No readable checkpoint" / "damaged ... train again" (review)."""
    x, y = linear_data(64)
    settings = dict(model_class=TinyMLP, model_hparams={"hidden_dims": [8, 8, 8]}, exmp_input=x[:1], **quiet(tmp_path))
    RegressTrainer(optimizer_hparams={"optimizer": "adam", "lr": 1e-2, "freeze": ["Dense_1"]}, **settings
                   ).train_model((x, y), None, num_epochs=1, batch_size=16)
    other = {"optimizer": "adam", "lr": 1e-2, "freeze": ["Dense_2"]}
    with pytest.raises(ValueError, match=r"differently grouped optimizer .* \(freeze, or the groups of a "
                                         r"multi_transform\)\. The checkpoint is not damaged"):
        RegressTrainer(optimizer_hparams=other, **settings).train_model((x, y), None, num_epochs=2, batch_size=16,
                                                                        resume=True)
    with pytest.raises(ValueError, match="differently grouped optimizer"):
        RegressTrainer.load_from_checkpoint(tmp_path / "run", exmp_input=x[:1], which="last", with_optimizer=True,
                                            optimizer_hparams=other)
    assert (tmp_path / "run" / "checkpoints" / "4").is_dir()
