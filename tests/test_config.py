"""Typed configs: YAML load/save, dotted overrides, the registry, and every strictness case."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

import flaxlight
from flaxlight import registry, zoo
from flaxlight.config import (
    CallbackConfig,
    Config,
    ConfigError,
    apply_overrides,
    build_callbacks,
    config_to_dict,
    load_config,
    parse_override,
    save_config,
)
from flaxlight.registry import Registry, RegistryError, import_object

CONFIGS = Path(__file__).resolve().parents[1] / "examples" / "configs"


def minimal(**sections) -> dict:
    cfg = {
        "trainer": {"name": "regression", "max_epochs": 2},
        "model": {"name": "mlp_regressor", "hparams": {"hidden_dims": [8], "output_dim": 1}},
        "data": {"name": "sine"},
    }
    cfg.update(sections)
    return cfg


def error_of(source, overrides=(), **opt_in) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(source, overrides, **opt_in)
    return str(info.value)


TRUST = {"trust_config": True}  # the opt-in for configs that name import paths


# ------------------------------------------------------------------------------------ loading
@pytest.mark.parametrize("name", ["sine_regression", "digits_mlp"])
def test_example_configs_load(name):
    cfg = load_config(CONFIGS / f"{name}.yaml")
    assert isinstance(cfg, Config)
    assert isinstance(cfg.optimizer, flaxlight.OptimizerConfig)
    assert isinstance(cfg.optimizer.lr, float)


def test_example_configs_match_the_scripts_hyperparameters():
    digits = load_config(CONFIGS / "digits_mlp.yaml")
    assert digits.model.hparams == {"hidden_dims": [256, 256], "num_classes": 10, "dropout_prob": 0.2}
    assert dict(digits.optimizer) == dict(flaxlight.OptimizerConfig.from_dict(
        {"optimizer": "adamw", "lr": 2e-3, "weight_decay": 1e-2, "warmup": 20}))
    assert (digits.trainer.max_epochs, digits.trainer.monitor, digits.trainer.mode) == (40, "val/acc", "max")
    assert (digits.data.batch_size, digits.data.eval_batch_size) == (64, 128)
    sine = load_config(CONFIGS / "sine_regression.yaml")
    assert sine.model.hparams == {"hidden_dims": [128, 128], "output_dim": 1}
    assert dict(sine.optimizer) == dict(flaxlight.OptimizerConfig.from_dict(
        {"optimizer": "adamw", "lr": 4e-3, "b2": 0.99, "weight_decay": 1e-4}))
    assert (sine.trainer.max_epochs, sine.trainer.check_val_every_n_epoch) == (50, 5)


def test_defaults_are_declared_on_the_fields():
    cfg = load_config(minimal())
    assert cfg.trainer.seed == 42 and cfg.trainer.mode == "min" and cfg.trainer.log_every_n_steps == 50
    assert cfg.data.batch_size == 64 and cfg.data.seed == 0 and cfg.data.kwargs == {}
    assert cfg.optimizer.optimizer == "adamw" and cfg.callbacks == [] and cfg.tune is None
    assert cfg.trainer.logger_params.base_log_dir == "checkpoints"


def test_yaml_exponent_floats_and_safe_loader(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(minimal()).replace("optimizer", "x") + "optimizer: {lr: 1e-3, b2: 9.9e-1}\n")
    cfg = load_config(path)
    assert cfg.optimizer.lr == pytest.approx(1e-3) and isinstance(cfg.optimizer.lr, float)
    path.write_text("trainer: !!python/object/apply:os.system ['echo unsafe']\n")
    assert "not valid YAML" in error_of(path)


def test_a_yaml_syntax_error_is_one_line_naming_the_file_line_and_column(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text("trainer:\n  name: regression\n  max_epochs: [2\nmodel: x\n")
    assert error_of(path) == (f"{path} is not valid YAML: line 4, column 6: expected ',' or ']', but got ':' "
                              f"(while parsing a flow sequence started at line 3, column 15).")
    assert error_of(minimal(), ["optimizer.lr=[1"]).count("\n") == 0


def test_missing_file_and_non_mapping(tmp_path):
    assert "does not exist" in error_of(tmp_path / "nope.yaml")
    path = tmp_path / "list.yaml"
    path.write_text("- 1\n- 2\n")
    assert "expected a mapping" in error_of(path)


def test_save_and_load_round_trip(tmp_path):
    cfg = load_config(CONFIGS / "digits_mlp.yaml", ["callbacks=[early_stopping]", "tune={metric: val/acc}"])
    path = save_config(cfg, tmp_path / "config.yaml")
    again = load_config(path)
    assert config_to_dict(again) == config_to_dict(cfg)
    assert again.callbacks == [CallbackConfig(name="early_stopping", args={})]
    assert "hidden_dims: [256, 256]" in Path(path).read_text()


def test_num_epochs_is_an_alias_of_max_epochs():
    cfg = load_config(minimal(trainer={"name": "regression", "num_epochs": 7}))
    assert cfg.trainer.max_epochs == 7
    assert "same setting" in error_of(minimal(trainer={"name": "regression", "num_epochs": 7, "max_epochs": 3}))


# ------------------------------------------------------------------------------------ overrides
def test_dotted_overrides():
    cfg = load_config(CONFIGS / "digits_mlp.yaml", [
        "optimizer.lr=3e-4", "trainer.max_epochs=20", "model.hparams.hidden_dims=[256,256]",
        "trainer.monitor=val/loss", "trainer.mode=min", "data.kwargs.num_val=200",
        "callbacks=[{name: early_stopping, args: {patience: 2}}]", "callbacks.0.args.patience=5",
        "trainer.logger_params.log_dir=/tmp/x",
    ])
    assert cfg.optimizer.lr == pytest.approx(3e-4)
    assert cfg.trainer.max_epochs == 20 and cfg.trainer.monitor == "val/loss"
    assert cfg.model.hparams["hidden_dims"] == [256, 256]
    assert cfg.data.kwargs == {"num_val": 200}
    assert cfg.callbacks[0].args == {"patience": 5}
    assert cfg.trainer.logger_params.log_dir == "/tmp/x"


def test_override_syntax_errors():
    assert parse_override("a.b=[1, 2]") == ("a.b", [1, 2])
    assert parse_override("a=") == ("a", None)
    with pytest.raises(ConfigError, match="not key=value"):
        parse_override("optimizer.lr")
    with pytest.raises(ConfigError, match="empty key"):
        parse_override("optimizer..lr=1")
    with pytest.raises(ConfigError, match="not a section"):
        apply_overrides({"trainer": {"name": "x"}}, ["trainer.name.sub=1"])
    with pytest.raises(ConfigError, match="not an index"):
        apply_overrides({"callbacks": []}, ["callbacks.3.name=timer"])


# ------------------------------------------------------------------------------------ strictness
def test_unknown_top_level_key_names_closest():
    message = error_of(minimal(), ["traner.seed=1"])
    assert "'traner'" in message and "Did you mean 'trainer'?" in message


def test_unknown_nested_key_has_full_path_and_closest():
    message = error_of(minimal(), ["trainer.max_epoch=3"])
    assert "Unknown key 'trainer.max_epoch'" in message and "Did you mean 'trainer.max_epochs'?" in message
    message = error_of(minimal(), ["trainer.logger_params.logdir=x"])
    assert "'trainer.logger_params.logdir'" in message and "'trainer.logger_params.log_dir'" in message


def test_unknown_optimizer_key():
    message = error_of(minimal(), ["optimizer.lrr=0.1"])
    assert "Unknown key 'optimizer.lrr'" in message and "Did you mean 'optimizer.lr'?" in message
    assert "optax.adamw also takes" in message
    assert error_of(minimal(), ["optimizer.optimizer=adamm"]).startswith("optimizer: Unknown optimizer 'adamm'")


def test_unknown_model_hparam_lists_accepted_ones():
    message = error_of(minimal(), ["model.hparams.hiden_dims=[4]"])
    assert "Unknown key 'model.hparams.hiden_dims'" in message
    assert "Did you mean 'model.hparams.hidden_dims'?" in message
    assert "It takes: hidden_dims, output_dim" in message


def test_unknown_data_kwarg_and_callback_arg():
    message = error_of(minimal(), ["data.kwargs.num_trian=10"])
    assert "'data.kwargs.num_trian'" in message and "'data.kwargs.num_train'" in message
    message = error_of(minimal(callbacks=[{"name": "early_stopping", "args": {"patiense": 2}}]))
    assert "'callbacks[0].args.patiense'" in message and "'callbacks[0].args.patience'" in message
    assert "set data.batch_size instead" in error_of(minimal(), ["data.kwargs.batch_size=3"])


@pytest.mark.parametrize("override, expected", [
    ("trainer.max_epochs=ten", "trainer.max_epochs: expected int, got str 'ten'"),
    ("trainer.enable_progress_bar=3", "trainer.enable_progress_bar: expected bool, got int 3"),
    ("trainer.limit_train_batches=all", "trainer.limit_train_batches: expected int or float or null, got str"),
    ("optimizer.lr=fast", "optimizer.lr: expected float or null, got str 'fast'"),
    ("data.batch_size=[64]", "data.batch_size: expected int, got list [64]"),
    ("callbacks=early_stopping", "callbacks: expected a list of a mapping (CallbackConfig), got str"),
    ("model.hparams=[1]", "model.hparams: expected a mapping, got list"),
    ("model.hparams.hidden_dims=abc", "model.hparams.hidden_dims: expected a list of int, got str 'abc'"),
    ("model.hparams.hidden_dims=[8, x]", "model.hparams.hidden_dims[1]: expected int, got str 'x'"),
    ("data.kwargs.num_train=1.5", "data.kwargs.num_train: expected int, got float 1.5"),
    ("optimizer.b2=x", "optimizer.b2: expected a number (optax's default is 0.999), got str 'x'"),
])
def test_wrong_type_names_expected_type(override, expected):
    assert expected in error_of(minimal(), [override])


def test_a_lightning_fraction_for_val_check_interval_in_a_config_gets_lightnings_answer():
    """``trainer.val_check_interval: 0.5`` got only 'expected int or null, got float 0.5' where the
    Python API says what Lightning's fraction means and what to write."""
    message = error_of(minimal(trainer={"name": "regression", "val_check_interval": 0.5}))
    assert "expected int or null, got float 0.5" in message
    assert "trainer.val_check_interval=0.5 is Lightning's fraction of an epoch" in message
    assert "trainer.val_check_interval=round(0.5 * batches per epoch)" in message
    assert "Lightning's default, a whole epoch" in error_of(minimal(), ["trainer.val_check_interval=1.0"])


def test_one_name_for_freeze_or_weight_decay_exclude_is_taken_as_the_python_api_takes_it():
    """``optimizer.freeze=Dense_0`` was refused ('expected tuple, got str') where
    ``optimizer_hparams={"freeze": "Dense_0"}`` works."""
    cfg = load_config(minimal(), ["optimizer.freeze=Dense_0", "optimizer.weight_decay_exclude=bias"])
    assert cfg.optimizer.freeze == ("Dense_0",) and cfg.optimizer.weight_decay_exclude == ("bias",)
    assert "optimizer.freeze: expected a list or str, got int 3" in error_of(minimal(), ["optimizer.freeze=3"])


def test_an_optax_argument_that_defaults_to_none_is_checked_against_its_annotation():
    sgd = ["optimizer.optimizer=sgd", "optimizer.schedule=constant"]
    assert error_of(minimal(), sgd + ["optimizer.momentum=fast"]) == (
        "optimizer.momentum: expected a number or null (optax's default is None), got str 'fast'. It was set by the "
        "override 'optimizer.momentum=fast'.")
    assert load_config(minimal(), sgd + ["optimizer.momentum=0.9"]).optimizer.optimizer_kwargs == {"momentum": 0.9}
    assert load_config(minimal(), sgd + ["optimizer.momentum=null"]).optimizer.optimizer_kwargs == {"momentum": None}
    assert load_config(minimal(), ["optimizer.mu_dtype=bfloat16"]).optimizer.optimizer_kwargs == {"mu_dtype": "bfloat16"}


def test_values_checked_by_the_dataclasses_themselves():
    assert error_of(minimal(), ["trainer.mode=maximum"]).startswith("trainer: mode must be 'min' or 'max'")
    assert "max_epochs must be a positive int" in error_of(minimal(), ["trainer.max_epochs=0"])
    assert error_of(minimal(), ["data.batch_size=0"]) == "data: batch_size must be an int >= 1, got 0."
    assert "eval_batch_size must be an int >= 1 or null, got -1" in error_of(minimal(), ["data.eval_batch_size=-1"])
    assert "data: seed must be an int >= 0, got -1" in error_of(minimal(), ["data.seed=-1"])
    assert "trainer: max_time must be seconds, a timedelta or 'HH:MM:SS'" in error_of(minimal(), ["trainer.max_time=abc"])
    assert error_of(minimal(), ["trainer.logger_params.logger_type=[csv, neptune]"]).startswith(
        "trainer.logger_params: Unknown logger_type 'neptune'")


@pytest.mark.parametrize("config, key", [
    ({"model": {"name": "mlp_regressor"}, "data": {"name": "sine"}}, "'trainer'"),
    (minimal(trainer={"max_epochs": 2}), "'trainer.name'"),
    (minimal(model={"hparams": {}}), "'model.name'"),
    (minimal(data={"batch_size": 3}), "'data.name'"),
    (minimal(model={"name": "mlp_regressor", "hparams": {"hidden_dims": [4]}}), "'model.hparams.output_dim'"),
    (minimal(callbacks=[{"args": {}}]), "'callbacks[0].name'"),
])
def test_missing_required_key_is_named(config, key):
    assert f"Missing required key {key}" in error_of(config)


def test_unregistered_name_suggests_closest():
    message = error_of(minimal(), ["model.name=mlp_regresor"])
    assert message.startswith("model.name: Unknown model 'mlp_regresor'. Did you mean 'mlp_regressor'?")
    assert "mlp_classifier" in message and "import path" in message
    assert "Did you mean 'classification'" in error_of(minimal(), ["trainer.name=clasification"])
    assert "Did you mean 'early_stopping'" in error_of(minimal(callbacks=["early_stoping"]))


def test_import_path_errors_say_which_part_failed(tmp_path, monkeypatch):
    message = error_of(minimal(), ["model.name=nosuchpkg_xyz.models.ResNet"], **TRUST)
    assert "model.name:" in message and "no module 'nosuchpkg_xyz' can be imported" in message
    message = error_of(minimal(), ["model.name=flaxlight.zoo.models.ResNet"], **TRUST)
    assert "module 'flaxlight.zoo.models' has no attribute 'ResNet'" in message
    message = error_of(minimal(), ["model.name=flaxlight.zoo.models:MLPRegresor"], **TRUST)
    assert "has no attribute 'MLPRegresor'. Did you mean flaxlight.zoo.models.MLPRegressor?" in message
    (tmp_path / "broken_models_mod.py").write_text("import not_installed_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    message = error_of(minimal(), ["model.name=broken_models_mod.Net"], **TRUST)
    assert "Importing module 'broken_models_mod'" in message and "not_installed_dependency_xyz" in message
    missing = error_of(minimal(imports=["nosuchpkg_xyz"]), **TRUST)
    assert "imports[0]: importing 'nosuchpkg_xyz'" in missing
    assert "no nosuchpkg_xyz.py or nosuchpkg_xyz/ in the current directory" in missing and "PYTHONPATH" in missing


def test_names_must_point_at_the_right_kind():
    assert "not a subclass of flaxlight.TrainerModule" in error_of(
        minimal(), ["trainer.name=flaxlight.data.ArrayLoader"], **TRUST)
    assert "not a flaxlight.Callback subclass" in error_of(minimal(callbacks=["flaxlight.data.ArrayLoader"]), **TRUST)


# ------------------------------------------------------------------------------------ user code
class SeedPatternTrainer(zoo.RegressionTrainer):
    """The seed's pattern: the trainer picks its model and takes its hyperparameters by name."""

    def __init__(self, hidden_dims, output_dim, **kwargs):
        super().__init__(model_class=zoo.MLPRegressor,
                         model_hparams={"hidden_dims": hidden_dims, "output_dim": output_dim}, **kwargs)


def test_import_paths_and_seed_pattern_trainer():
    path = f"{__name__}.SeedPatternTrainer"
    cfg = load_config(minimal(trainer={"name": path}, model={"name": None, "hparams": {"hidden_dims": [4],
                                                                                     "output_dim": 1}}), **TRUST)
    assert cfg.model.name is None
    message = error_of(minimal(trainer={"name": path}, model={"name": None, "hparams": {"hidden": [4]}}), **TRUST)
    assert "'model.hparams.hidden'" in message and "hidden_dims" in message
    assert "picks its model itself" in error_of(minimal(trainer={"name": path}), **TRUST)


class DefaultsSeedTrainer(zoo.RegressionTrainer):
    """The seed's pattern with defaults only: from its signature alone it may as well pass model_class on."""

    def __init__(self, hidden: int = 8, **kwargs):
        super().__init__(model_class=zoo.MLPRegressor, model_hparams={"hidden_dims": [hidden], "output_dim": 1},
                         **kwargs)


def test_a_trainer_that_picks_its_model_takes_its_arguments_in_either_section(tmp_path):
    from flaxlight.config import build_run

    path = f"{__name__}.DefaultsSeedTrainer"
    seed = {"name": None, "hparams": {}}
    assert load_config(minimal(trainer={"name": path, "hidden": 4}, model=seed), **TRUST).trainer.own_args == \
        {"hidden": 4}
    assert "'trainer.hidden' and 'model.hparams.hidden' both set" in error_of(
        minimal(trainer={"name": path, "hidden": 4}, model={"name": None, "hparams": {"hidden": 4}}), **TRUST)
    with pytest.raises(ConfigError, match=r"^model.name: trainer .*DefaultsSeedTrainer picks its model itself .*"
                                          r"set model.name: null"):  # given a model, it would get model_class twice
        build_run(minimal(trainer={"name": path}), log_dir=tmp_path / "run", trust_config=True)


def test_registry_register_resolve_and_collisions():
    reg = Registry("widget")

    @reg.register("big_widget")
    class BigWidget:
        pass

    assert reg.get("BigWidget") is BigWidget and reg.get("big-widget") is BigWidget
    assert reg.register("big_widget", BigWidget) is BigWidget  # same object again: fine
    with pytest.raises(ValueError, match="already registered"):
        reg.register("big_widget", type("Other", (), {}))
    with pytest.raises(RegistryError, match="Did you mean 'big_widget'"):
        reg.get("big_widgit")
    reg.register("lazy", "flaxlight.data:ArrayLoader")
    assert reg.get("lazy") is flaxlight.ArrayLoader
    assert import_object("flaxlight.zoo.models.MLPClassifier") is zoo.MLPClassifier
    assert registry.resolve("callback", "EarlyStopping") is flaxlight.callbacks.EarlyStopping
    assert {"mlp_regressor", "mlp_classifier"} <= set(registry.MODELS.names())
    assert {"sine", "digits"} <= set(registry.DATASETS.names())


def test_user_registration_through_imports(tmp_path, monkeypatch):
    (tmp_path / "my_components_mod.py").write_text(
        "from flaxlight.registry import register_dataset\n"
        "from flaxlight.zoo.datasets import sine\n"
        "@register_dataset('tiny_sine')\n"
        "def tiny_sine(*, batch_size, seed=0, size=32):\n"
        "    return sine(batch_size=batch_size, seed=seed, num_train=size, num_val=size, num_test=size)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(minimal(imports=["my_components_mod"], data={"name": "tiny_sine", "kwargs": {"size": 16}}),
                      allow_imports=["my_components_mod"])
    assert cfg.data.name == "tiny_sine"
    # eval_batch_size is not an argument of this factory: setting it is an error, leaving it is fine
    assert "does not take 'eval_batch_size'" in error_of(
        minimal(imports=["my_components_mod"], data={"name": "tiny_sine", "eval_batch_size": 8}), **TRUST)
    sys.modules.pop("my_components_mod", None)


def test_build_callbacks_in_order():
    cfg = load_config(minimal(callbacks=[{"name": "timer", "args": {"duration": 60}},
                                         {"name": "early_stopping", "args": {"patience": 2}}]))
    callbacks = build_callbacks(cfg)
    assert [type(cb).__name__ for cb in callbacks] == ["Timer", "EarlyStopping"]
    assert callbacks[1].patience == 2


def test_the_full_config_in_docs_loads():
    text = (Path(__file__).resolve().parents[1] / "docs" / "cli.md").read_text()
    block = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    cfg = load_config(yaml.safe_load(block))
    assert cfg.trainer.monitor == "val/acc" and cfg.optimizer.warmup_steps == 20
    assert [c.name for c in cfg.callbacks] == ["early_stopping", "learning_rate_monitor"]
    assert [type(cb).__name__ for cb in build_callbacks(cfg)] == ["EarlyStopping", "LearningRateMonitor"]
    assert [name for name in config_to_dict(cfg)] == [name for name in yaml.safe_load(block)]


# ------------------------------------------------------------------------------------ configs are data (trust)
def marker_module(folder: Path, name: str, body: str = "") -> Path:
    """A module that leaves ``<name>.ran`` in ``folder`` when it is imported (code ran)."""
    marker = folder / f"{name}.ran"
    (folder / f"{name}.py").write_text(f"open({str(marker)!r}, 'w').close()\n{body}")
    return marker


@pytest.fixture
def clean_imports(monkeypatch):
    """sys.path and sys.modules as they were, whatever a test imports or puts on the path."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.endswith(("_mod", "_pkg")) or name.startswith(("marker_", "reexport_", "helper_")):
            sys.modules.pop(name, None)


def test_a_dataset_import_path_runs_nothing_without_opt_in(tmp_path):
    from flaxlight.config import fit

    marker = tmp_path / "pwned"
    config = minimal(data={"name": "os.system", "kwargs": {"command": f"touch {marker}"}})
    message = error_of(config)
    assert message.startswith("data.name: 'os.system' is an import path, which was not imported")
    assert "--trust-config" in message and "--allow-import os" in message and "register" in message
    assert "trust_config=True" in message and "allow_imports=['os']" in message
    with pytest.raises(ConfigError, match="data.name: 'os.system' is an import path"):
        fit(config)
    # Trusted or not, a builtin is never a dataset factory: refused before it is called.
    for opt_in in (TRUST, {"allow_imports": ["os"]}):
        assert "not a dataset factory" in error_of(config, **opt_in) and "not called" in error_of(config, **opt_in)
    message = error_of(minimal(data={"name": "subprocess.run", "kwargs": {"args": ["touch", str(marker)]}}), **TRUST)
    assert "standard library module 'subprocess'" in message and "it was not called" in message
    assert not marker.exists()


def test_imports_and_import_paths_need_an_opt_in(tmp_path, monkeypatch, clean_imports):
    marker = marker_module(tmp_path, "marker_registrations_mod")
    monkeypatch.chdir(tmp_path)  # what the flaxlight command would put on sys.path
    config = minimal(imports=["marker_registrations_mod"])
    message = error_of(config)
    assert message.startswith("imports[0]: 'marker_registrations_mod' was not imported: a config is data")
    assert "--allow-import marker_registrations_mod" in message
    assert not marker.exists() and str(tmp_path) not in sys.path  # not even the working directory
    message = error_of(config, allow_imports=["mypkg"])
    assert "not under the allowed import prefixes ('mypkg')" in message and not marker.exists()
    # A prefix allows the modules under it, at a dot (mypkg allows mypkg.models, not mypkg_models).
    assert "not under the allowed" in error_of(config, allow_imports=["marker_registrations"])
    load_config(config, allow_imports=["marker_registrations_mod"])
    assert marker.exists()  # the opt-in imports it, from the working directory


def test_allowed_prefixes_and_kinds_are_checked_before_anything_is_called():
    cfg = load_config(minimal(trainer={"name": "flaxlight.zoo.trainers:RegressionTrainer"},
                              model={"name": "flaxlight.zoo.models.MLPRegressor",
                                     "hparams": {"hidden_dims": [4], "output_dim": 1}},
                              data={"name": "flaxlight.zoo.datasets.sine"}), allow_imports=["flaxlight.zoo"])
    assert cfg.model.name == "flaxlight.zoo.models.MLPRegressor"
    message = error_of(minimal(), ["model.name=flaxlight.data.ArrayLoader"], allow_imports=["flaxlight"])
    assert "model.name: 'flaxlight.data.ArrayLoader' is flaxlight.data.ArrayLoader, not a model class" in message
    assert "flax.linen.Module or flax.nnx.Module" in message
    message = error_of(minimal(), ["data.name=flaxlight.data.ArrayLoader"], **TRUST)
    assert "a type, not a plain Python function" in message and "register_dataset" in message
    message = error_of(minimal(), ["data.name=flaxlight.zoo.datasets.sine"], allow_imports=["flaxlight.zoo.models"])
    assert "not under the allowed import prefixes ('flaxlight.zoo.models')" in message
    with pytest.raises(ValueError, match="not a module prefix"):
        load_config(minimal(), allow_imports=["my pkg"])


@pytest.mark.parametrize("key, path, name", [
    ("data.name", "flaxlight.zoo.datasets.sine", "sine"), ("data.name", "flaxlight.zoo.datasets:digits", "digits"),
    ("data.name", "flaxlight.zoo.sine", "sine"), ("data.name", "flaxlight.zoo.datasets.sines", None),
    ("data.name", "mypkg.data.sine", None)])
def test_an_import_path_to_a_registered_object_is_pointed_to_its_name(key, path, name):
    """LightningCLI's class_path habit: 'data.name: flaxlight.zoo.datasets.digits' was refused with 'register it in
    your own code ... or pass --allow-import flaxlight', not saying it is registered as 'digits'."""
    message = error_of(minimal(), [f"{key}={path}"])
    if name is None:  # no registered object there: the usual fixes
        assert "is registered as" not in message and "register it in your own code" in message
        return
    assert f"{key}: {path!r} is an import path, which was not imported" in message
    assert f"Fix: it is registered as {name!r}: use `{name}` ({key}: {name}), which needs no opt-in." in message
    assert load_config(minimal(), [f"{key}={name}"]).data.name == name  # as said


def test_a_reexported_function_is_judged_by_where_it_is_defined(tmp_path, monkeypatch, clean_imports):
    (tmp_path / "helper_data_mod.py").write_text("def make_data(*, batch_size, seed=0):\n    raise SystemExit(3)\n")
    (tmp_path / "reexport_data_mod.py").write_text(
        "from helper_data_mod import make_data\nfrom shutil import rmtree as wipe\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    message = error_of(minimal(data={"name": "reexport_data_mod.make_data"}), allow_imports=["reexport_data_mod"])
    assert "defined in module 'helper_data_mod', which is not under the allowed import prefixes" in message
    message = error_of(minimal(data={"name": "reexport_data_mod.wipe", "kwargs": {"path": str(tmp_path)}}), **TRUST)
    assert "standard library module 'shutil'" in message and tmp_path.exists()


def tiny_registered_sine(*, batch_size, seed=0, size=32):
    return zoo.sine(batch_size=batch_size, seed=seed, num_train=size, num_val=size, num_test=size)


def test_names_your_code_registered_need_no_opt_in():
    registry.register_dataset("tiny_registered_sine", tiny_registered_sine)
    cfg = load_config(minimal(data={"name": "tiny_registered_sine", "kwargs": {"size": 8}}))
    assert cfg.data.name == "tiny_registered_sine"
    assert "register it in your own code (flaxlight.registry.register_model" in error_of(
        minimal(), ["model.name=mypkg.models.ResNet"])
    message = error_of(minimal(), ["data.name=tiny_registred_sine"])
    assert "Did you mean 'tiny_registered_sine'?" in message and "--allow-import" in message


def test_loading_a_run_never_imports_the_model_class_its_hparams_name(tmp_path):
    """A trainer that picks its model takes no model_class; a hand-edited hparams.yaml whose model
    hparams it does not take would make loading import the class the file names: refused."""
    from flaxlight.config import load_trainer

    registry.register_trainer("seed_pattern_for_tests", SeedPatternTrainer)
    cfg = load_config(minimal(trainer={"name": "seed_pattern_for_tests"},
                              model={"name": None, "hparams": {"hidden_dims": [4], "output_dim": 1}}))
    marker = tmp_path / "marker_seed_mod.ran"
    hparams = {"model_class": "marker_seed_mod.Net", "model_hparams": {"hidden_dims": [4], "output_dim": 1,
                                                                       "extra": 1}}
    (tmp_path / "hparams.yaml").write_text(yaml.safe_dump(hparams))
    with pytest.raises(ConfigError) as info:
        load_trainer(cfg, tmp_path, exmp_input=None)
    assert str(info.value).startswith(f"{tmp_path / 'hparams.yaml'}: model_class: 'marker_seed_mod.Net' is an "
                                      f"import path, which was not imported")
    assert not marker.exists()
    hparams["model_hparams"].pop("extra")  # as the trainer wrote it: nothing to import, on to the checkpoint
    (tmp_path / "hparams.yaml").write_text(yaml.safe_dump(hparams))
    with pytest.raises(FileNotFoundError, match="No checkpoint"):
        load_trainer(cfg, tmp_path, exmp_input=None)


def test_mistakes_a_lightning_user_makes_get_pointed_to_the_right_place(tmp_path):
    """Lightning Trainer arguments that live in another section here, a key given twice in one
    YAML mapping (PyYAML keeps the last silently), an override indexing a list the config does not
    have, and a folder given as the config file."""
    assert "In flaxlight that is optimizer.accumulate_grad_batches." in error_of(
        minimal(), ["trainer.accumulate_grad_batches=4"])
    assert "In flaxlight that is optimizer.gradient_clip." in error_of(minimal(), ["trainer.gradient_clip_val=1.0"])
    assert "the top-level callbacks: list" in error_of(minimal(), ["trainer.callbacks=[]"])
    twice = tmp_path / "twice.yaml"
    twice.write_text("trainer: {name: regression}\nmodel: {name: mlp_regressor, hparams: {output_dim: 1}}\n"
                     "data: {name: sine}\ntrainer: {max_epochs: 3}\n")
    message = error_of(twice)
    assert "the key 'trainer' is given twice" in message and "line 4" in message
    assert error_of(minimal(), ["callbacks.0.args.patience=5"]).startswith(
        "Override 'callbacks.0.args.patience=5': callbacks has no items to index; give the whole list")
    assert "is a folder; give a YAML file" in error_of(tmp_path)


def test_a_duration_written_without_quotes_is_read_as_written(tmp_path):
    """YAML 1.1 read `1:00:00:00` as the base-60 number 216000 (2.5 days, not one day); the
    loader reads such scalars as text (as YAML 1.2 does), in files, overrides and a saved config."""
    from flaxlight.callbacks.timer import parse_duration

    path = tmp_path / "cfg.yaml"
    path.write_text(yaml.safe_dump(minimal()) + "callbacks:\n  - {name: timer, args: {duration: 1:12:00:00}}\n")
    path.write_text(path.read_text().replace("max_epochs: 2", "max_epochs: 2\n  max_time: 1:00:00:00"))
    cfg = load_config(path)
    assert cfg.trainer.max_time == "1:00:00:00" and parse_duration(cfg.trainer.max_time) == 86400
    assert build_callbacks(cfg)[0].duration == 36 * 3600
    assert load_config(minimal(), ["trainer.max_time=2:00:00:00"]).trainer.max_time == "2:00:00:00"
    assert load_config(minimal(), ["trainer.max_time=1:30"]).trainer.max_time == "1:30"  # 90 s, as MM:SS
    again = load_config(save_config(cfg, tmp_path / "saved.yaml"))
    assert config_to_dict(again) == config_to_dict(cfg)


def test_override_values_in_lightning_spelling_combine_with_later_overrides():
    """An override's value was stored as written, so a later override of the same key in either
    spelling was refused as "the same setting", and data.init_args={batch_size: ...} was not lifted."""
    cfg = load_config(minimal(), ["callbacks=[{class_path: early_stopping, init_args: {patience: 3}}]",
                                  "callbacks.0.init_args.patience=5",
                                  "trainer={class_path: regression, init_args: {max_epochs: 3}}",
                                  "trainer.max_epochs=5",
                                  "model={class_path: mlp_regressor, init_args: {hidden_dims: [4], output_dim: 1}}",
                                  "model.init_args.hidden_dims=[8]",
                                  "data.init_args={batch_size: 16, num_train: 128}"])
    assert cfg.callbacks == [CallbackConfig(name="early_stopping", args={"patience": 5})]
    assert cfg.trainer.name == "regression" and cfg.trainer.max_epochs == 5
    assert cfg.model.hparams == {"hidden_dims": [8], "output_dim": 1}
    assert cfg.data.batch_size == 16 and cfg.data.kwargs == {"num_train": 128}
    cfg = load_config(minimal(callbacks=["timer"]), ["callbacks.0={class_path: early_stopping}",
                                                     "callbacks.0.args.patience=2"])
    assert cfg.callbacks == [CallbackConfig(name="early_stopping", args={"patience": 2})]
    text = "trainer={name: regression, max_epochs: 3, init_args: {max_epochs: 2}}"
    assert error_of(minimal(), [text]) == (f"Override {text!r}: 'trainer.max_epochs' is set both in trainer and in "
                                           f"trainer.init_args; keep one.")


def test_boundaries_and_scales_keys_must_be_whole_steps():
    """A key 15.7 was cut to step 15 and 'ten' failed with int()'s bare message."""
    piecewise = ["optimizer.schedule=piecewise"]
    assert error_of(minimal(), [*piecewise, "optimizer.boundaries_and_scales={15.7: 0.1}"]) == \
        "optimizer.boundaries_and_scales: every key must be int, got float 15.7. It was set by the override " \
        "'optimizer.boundaries_and_scales={15.7: 0.1}'."
    assert error_of(minimal(), [*piecewise, "optimizer.boundaries_and_scales={ten: 0.1}"]) == \
        "optimizer.boundaries_and_scales: every key must be int, got str 'ten'. It was set by the override " \
        "'optimizer.boundaries_and_scales={ten: 0.1}'."
    cfg = load_config(minimal(), [*piecewise, "optimizer.boundaries_and_scales={15: 0.1, 30: 0.5}"])
    assert cfg.optimizer.boundaries_and_scales == {15: 0.1, 30: 0.5}
    cfg = load_config(minimal(), [*piecewise, "optimizer.boundaries_and_scales={15: 0.1}",
                                  "optimizer.boundaries_and_scales.30=0.5"])  # a dotted override: the key "30"
    assert cfg.optimizer.boundaries_and_scales == {15: 0.1, 30: 0.5}


def test_lightning_cli_top_level_keys_point_to_flaxlights_spelling():
    """seed_everything and optimizer: {class_path, init_args} got a bare "Unknown key"."""
    assert "Unknown key 'seed_everything'. In flaxlight that is trainer.seed (initialisation, dropout) and " \
           "data.seed" in error_of({**minimal(), "seed_everything": 42})
    lightning = {"class_path": "torch.optim.AdamW", "init_args": {"lr": 1e-3}}
    assert "Unknown key 'optimizer.class_path'. In flaxlight that is optimizer.optimizer, an optax optimizer's " \
           "name" in error_of(minimal(optimizer=lightning))
    assert "Unknown key 'optimizer.init_args'. In flaxlight that is the optimizer section's own keys " \
           "(optimizer.lr," in error_of(minimal(optimizer={"init_args": {"lr": 1e-3}}))


# ------------------------------------------------------------------------------------ misplaced keys
@pytest.mark.parametrize("override, place", [
    ("lr=1e-3", "'optimizer.lr'"),
    ("trainer.lr=1e-3", "'optimizer.lr'"),
    ("trainer.batch_size=32", "'data.batch_size'"),
    ("trainer.log_dir=runs/x", "'trainer.logger_params.log_dir' (--log-dir on the command line)"),
    ("model.hidden_dims=[32]", "'model.hparams.hidden_dims'"),
    ("data.num_val=200", "'data.kwargs.num_val'"),
    ("callbacks=[{name: early_stopping, patience: 3}]", "'callbacks[0].args.patience'"),
    ("trainer.model_hparams={hidden_dims: [32]}", "'model.hparams'"),
    ("optimizer_hparams={lr: 0.1}", "'optimizer'"),
    ("model.hparams.lr=0.1", "'optimizer.lr'"),
])
def test_a_key_valid_elsewhere_is_pointed_to_its_place(override, place):
    """They got only "Unknown key ... Valid keys of X" (trainer.model_hparams: "Did you mean
    'trainer.logger_params'?"), though the config knows every valid path."""
    message = error_of(minimal(), [override])
    assert f"It belongs at {place}." in message and "Did you mean" not in message, message
    assert "Did you mean 'trainer.max_epochs'?" in error_of(minimal(), ["trainer.max_epoch=3"])  # a typo: as before


# ------------------------------------------------------------------------------------ a Config changed in Python
def test_a_config_edited_in_python_is_checked_as_a_file_is(tmp_path):
    """`cfg.trainer.max_epoch = 1` was ignored; `cfg.optimizer.lr = "3e-4"` trained and saved a
    config.yaml that every verb then refused."""
    from flaxlight.config import build_run, check_config, fit

    cfg = load_config(minimal())
    with pytest.raises(AttributeError, match=r"'max_epoch' \(trainer.max_epoch in a config\)\. Did you mean "
                                             r"'trainer.max_epochs'\?"):
        cfg.trainer.max_epoch = 1
    with pytest.raises(AttributeError, match=r"It belongs at 'data.batch_size'"):
        cfg.trainer.batch_size = 8
    with pytest.raises(AttributeError, match=r"belongs in hparams: .hparams\['hidden_dims'\]"):
        cfg.model.hidden_dims = [8]
    cfg.trainer.max_epochs = 1  # a setting: taken
    cfg.optimizer.lrr = 0.1  # the optimizer's section is optax's class: caught when the run is built
    with pytest.raises(ConfigError, match=r"no setting 'lrr' \(optimizer.lrr in a config\)\. Did you mean "):
        build_run(cfg, log_dir=tmp_path / "run")
    del cfg.optimizer.lrr
    cfg.optimizer.lr = "3e-4"
    for call in (lambda: fit(cfg), lambda: save_config(cfg, tmp_path / "c.yaml"), lambda: check_config(cfg)):
        with pytest.raises(ConfigError, match=r"^optimizer\.lr: expected float or null, got str '3e-4'\."):
            call()
    assert not (tmp_path / "run").exists() and not (tmp_path / "c.yaml").exists()
    cfg.optimizer.lr = 3e-4
    cfg.optimizer.schedule = lambda step: 1e-3  # a Python object where the schema takes one: still taken
    cfg.optimizer.lr = None
    assert check_config(cfg) is cfg
