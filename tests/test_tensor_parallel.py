"""Parameters placed as the model annotates them on a 2x2 mesh (tensor parallel), equal to one
device, restored onto other device counts. Each run is a subprocess with forced CPU devices."""

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).with_name("tensor_parallel_script.py")


def _run(*args, fails=False):
    env = dict(os.environ, CI="true")
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], env=env, text=True, capture_output=True,
                          timeout=300)
    if fails:
        assert done.returncode != 0 and "crash after the save" in done.stderr, done.stderr[-3000:]
    else:
        assert done.returncode == 0, done.stderr[-3000:]


def _load(path):
    with np.load(path) as data:
        return str(data["shardings"]), str(data["mu_sharding"]), [data[k] for k in sorted(data.files, key=_order)
                                                                    if k.startswith("p")]


def _order(name):
    return int(name[1:]) if name[1:].isdigit() else -1


def test_a_2x2_mesh_shards_as_annotated_equals_one_device_and_restores_on_1_and_2(tmp_path):
    # One process per device count: runs separated by "--" follow each other in it.
    # With load_from_checkpoint's defaults (d4, d1): the run's mesh where it fits (4 devices), one device where not.
    _run(tmp_path / "mesh.npz", tmp_path / "mesh", "--devices", 4, "--mesh", "data=2,model=2",
         "--", tmp_path / "d4.npz", tmp_path / "d4", "--devices", 4, "--restore-from", tmp_path / "mesh", "--load-defaults")
    _run(tmp_path / "one.npz", tmp_path / "one",
         "--", tmp_path / "r1.npz", tmp_path / "r1", "--restore-from", tmp_path / "mesh",
         "--", tmp_path / "d1.npz", tmp_path / "d1", "--restore-from", tmp_path / "mesh", "--load-defaults")
    _run(tmp_path / "r2.npz", tmp_path / "r2", "--devices", 2, "--mesh", "data=1,model=2",
         "--restore-from", tmp_path / "mesh")
    _, _, single = _load(tmp_path / "one.npz")
    shardings, mu_sharding, sharded = _load(tmp_path / "mesh.npz")
    assert "'Dense_0': \"NamedSharding(mesh=Mesh('data': 2, 'model': 2" in shardings
    assert "spec=P(None, 'model')" in shardings.split("'Dense_1'")[0]  # columns over "model"
    assert "spec=P('model', None)" in shardings.split("'Dense_1'")[1].split("'Dense_2'")[0]  # rows
    assert "spec=P('model', None)" in shardings.split("'Dense_2'")[1]  # logical "hidden" -> "model"
    assert "P(None, 'model')" in mu_sharding  # Adam's moment follows its parameter
    for a, b in zip(sharded, single, strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)

    assert "'data': 2, 'model': 2" in _load(tmp_path / "d4.npz")[0]
    for restored in (_load(tmp_path / name)[2] for name in ("r1.npz", "r2.npz", "d1.npz", "d4.npz")):
        for a, b in zip(restored, sharded, strict=True):
            np.testing.assert_array_equal(a, b)


def test_a_run_saved_on_a_2x2_mesh_resumes_on_two_devices_and_on_one_as_if_uninterrupted(tmp_path):
    _run(tmp_path / "first.npz", tmp_path / "run", "--devices", 4, "--mesh", "data=2,model=2", "--epochs", 3,
         "--crash-after", 2, fails=True)
    shutil.copytree(tmp_path / "run", tmp_path / "run_on_one")
    _run(tmp_path / "rest.npz", tmp_path / "run", "--devices", 2, "--mesh", "data=1,model=2", "--epochs", 3,
         "--resume")
    _run(tmp_path / "straight.npz", tmp_path / "straight", "--epochs", 3,  # both on one device, in one process
         "--", tmp_path / "rest1.npz", tmp_path / "run_on_one", "--epochs", 3, "--resume")
    shardings, _, resumed = _load(tmp_path / "rest.npz")
    assert "'data': 1, 'model': 2" in shardings and "spec=P(None, 'model')" in shardings
    for run in (resumed, _load(tmp_path / "rest1.npz")[2]):
        for a, b in zip(run, _load(tmp_path / "straight.npz")[2], strict=True):
            np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


def test_an_nnx_model_with_sharding_metadata_is_placed_as_annotated(tmp_path):
    _run(tmp_path / "one.npz", tmp_path / "one", "--nnx")
    _run(tmp_path / "mesh.npz", tmp_path / "mesh", "--nnx", "--devices", 4, "--mesh", "data=2,model=2",
         "--distributed", "fsdp")
    shardings, mu_sharding, sharded = _load(tmp_path / "mesh.npz")
    by_layer = ast.literal_eval(shardings)
    assert "spec=P(None, 'model')" in by_layer["up"] and "spec=P('model', None)" in by_layer["down"]
    assert "spec=P()" in by_layer["out"]  # unannotated and small: FSDP keeps it replicated
    assert "P(None, 'model')" in mu_sharding
    for a, b in zip(sharded, _load(tmp_path / "one.npz")[2], strict=True):
        np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-6)


def test_mesh_shapes_and_annotations_that_do_not_fit_say_why():
    from flaxlight.distributed import make_mesh

    with pytest.raises(ValueError, match="needs 4 devices, and there are 1"):
        make_mesh(shape={"data": 2, "model": 2})
    with pytest.raises(ValueError, match="has no 'data' axis"):
        make_mesh(shape={"model": 1})


@pytest.mark.parametrize("spec, where, fix", [
    (("model", "model"), "dimensions 0 and 1", "P('model', None)"),
    ((("data", "model"), "model"), "dimensions 0 and 1", "P(('data', 'model'), None)"),
    ((None, ("model", "model")), "dimension 1 twice", "P(None, 'model')")])
@pytest.mark.parametrize("api", ["linen", "nnx"])
def test_an_annotation_that_repeats_a_mesh_axis_names_the_parameter(tmp_path, api, spec, where, fix):
    """P('model', 'model') failed with JAX's DuplicateSpecError, which names no parameter."""
    import flax.linen as nn
    from flax import nnx
    from conftest import ClassifyTrainer, quiet

    class Linen(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            kernel_init = nn.with_partitioning(nn.initializers.lecun_normal(), spec)
            return nn.Dense(2)(nn.relu(nn.Dense(8, kernel_init=kernel_init, name="hidden")(x)))

    class Nnx(nnx.Module):
        def __init__(self, *, rngs):
            kernel_init = nnx.with_partitioning(nnx.initializers.lecun_normal(), spec)
            self.hidden, self.out = nnx.Linear(4, 8, kernel_init=kernel_init, rngs=rngs), nnx.Linear(8, 2, rngs=rngs)

        def __call__(self, x, train: bool = False):
            return self.out(nnx.relu(self.hidden(x)))

    with pytest.raises(ValueError) as raised:  # a one-device mesh is enough: JAX refuses the spec on any
        ClassifyTrainer(model_class=Linen if api == "linen" else Nnx, model_hparams={}, optimizer_hparams={},
                        exmp_input=np.zeros((1, 4), np.float32), mesh={"data": 1, "model": 1}, **quiet(tmp_path))
    message = str(raised.value)
    assert "Parameter ['hidden']['kernel'] is annotated P(" in message, message
    assert f"which splits {where} over the mesh axis 'model'" in message, message
    assert f"Name 'model' once (e.g. {fix})" in message, message


def test_annotations_that_do_not_split_or_name_no_rule_are_said(tmp_path):
    """A model axis that does not divide a parameter gave JAX's bare IndivisibleError; a logical
    name without a sharding rule left its dimension whole on every device without a word."""
    script = f"""
import os, warnings
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import numpy as np, flax.linen as nn
from conftest import ClassifyTrainer, quiet
from pathlib import Path

class M(nn.Module):
    hidden: int = 8
    logical: bool = False

    @nn.compact
    def __call__(self, x, train: bool = False):
        init = nn.initializers.lecun_normal()
        kernel_init = (nn.with_logical_partitioning(init, (None, "hidden")) if self.logical
                       else nn.with_partitioning(init, (None, "model")))
        return nn.Dense(2)(nn.relu(nn.Dense(self.hidden, kernel_init=kernel_init)(x)))

def build(tag, **kwargs):
    return ClassifyTrainer(model_class=M, optimizer_hparams={{}}, exmp_input=np.zeros((1, 4), np.float32),
                           mesh={{"data": 1, "model": 4}}, **quiet(Path({str(tmp_path)!r}) / tag, **kwargs))

try:
    build("six", model_hparams={{"hidden": 6}})
except ValueError as exc:
    print("SPLIT:", exc)
with warnings.catch_warnings(record=True) as said:
    warnings.simplefilter("always")
    build("typo", model_hparams={{"logical": True}}, sharding_rules=[("hiden", "model")])
    build("mapped", model_hparams={{"logical": True}}, sharding_rules=[("hidden", "model")])
print("WARNED:", [str(w.message) for w in said if "sharding rule" in str(w.message)])
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"  # the forced devices are CPU devices
    done = subprocess.run([sys.executable, "-c", script], env=env, text=True, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert ("SPLIT: Parameter ['Dense_1']['kernel'] of shape (4, 6) is annotated P(None, 'model')" in done.stdout
            and "its dimension 1 (6) does not split over ('model',) (4 devices)" in done.stdout), done.stdout
    warned = ast.literal_eval(done.stdout.split("WARNED: ")[1])
    assert len(warned) == 1 and "['hidden'] of the parameters' annotations have no sharding rule" in warned[0]


def test_a_weight_decay_mask_on_a_sharded_model_trains(tmp_path):
    """The mask's check at the optimizer's init ran on optax.tree_map_params' placeholder (how the
    optimizer state's sharding is found) and refused a mask that fits the parameters."""
    script = f"""
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import numpy as np, flax.linen as nn
from conftest import RegressTrainer, quiet
from pathlib import Path

class M(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        init = nn.initializers.lecun_normal()
        return nn.Dense(1)(nn.relu(nn.Dense(8, kernel_init=nn.with_partitioning(init, (None, "model")))(x)))

x = np.random.default_rng(0).normal(size=(32, 4)).astype(np.float32)
mask = {{"Dense_0": {{"kernel": True, "bias": False}}, "Dense_1": {{"kernel": True, "bias": False}}}}
for mode in ("decoupled", "l2"):
    trainer = RegressTrainer(model_class=M, model_hparams={{}}, exmp_input=x[:1], mesh={{"data": 1, "model": 2}},
                             optimizer_hparams={{"optimizer": "adam", "lr": 1e-2, "weight_decay": 0.01,
                                                 "weight_decay_mode": mode, "weight_decay_mask": mask}},
                             **quiet(Path({str(tmp_path)!r}) / mode))
    print(mode, np.isfinite(trainer.train_model((x, x[:, :1]), None, num_epochs=1, batch_size=16)["train/loss"]))
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    env.pop("XLA_FLAGS", None)
    env["JAX_PLATFORMS"] = "cpu"  # the forced devices are CPU devices
    done = subprocess.run([sys.executable, "-c", script], env=env, text=True, capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "decoupled True" in done.stdout and "l2 True" in done.stdout, done.stdout


def test_the_tensor_parallel_transformer_example_matches_one_device(tmp_path):
    examples = Path(__file__).resolve().parents[1] / "examples"

    def run(devices, name):
        script = (f"import sys, pickle; sys.path.insert(0, {str(examples)!r}); import transformer_tensor_parallel as t; "
                  f"out = t.main(['--devices', '{devices}', '--epochs', '1', '--steps-per-epoch', '6', '--layers', '1',"
                  f" '--log-dir', {str(tmp_path / name)!r}, '--no-progress-bar']); "
                  f"import jax; out['shardings'] = jax.tree.map(str, out['shardings']); "
                  f"pickle.dump(out, open({str(tmp_path / (name + '.pkl'))!r}, 'wb'))")
        env = dict(os.environ, CI="true")
        env.pop("XLA_FLAGS", None)
        done = subprocess.run([sys.executable, "-c", script], env=env, text=True, capture_output=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        import pickle

        with open(tmp_path / (name + ".pkl"), "rb") as f:
            return pickle.load(f)

    sharded, single = run(4, "mesh"), run(1, "one")
    attention = sharded["shardings"]["blocks"][0]["attention"]
    assert "spec=P(None, 'model')" in attention["qkv"]["kernel"] and "spec=P('model', None)" in attention["out"]["kernel"]
    assert "'data': 2, 'model': 2" in attention["qkv"]["kernel"]
    import jax

    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5), sharded["params"],
                 single["params"])
    assert sharded["metrics"]["val/bpc"] == pytest.approx(single["metrics"]["val/bpc"], rel=1e-4)
