"""What a user may hand the trainer on a mesh: a ``jax.make_mesh`` mesh, batches with a leaf that
is not per-example, a list loader whose batches do not split, ``mesh=`` in another form, and a
synced BatchNorm (``axis_name=``) from DDP/pmap habits.

Device counts are fixed when JAX starts, so the 4-device checks run as subprocesses (as in
tests/test_distributed.py); the rest run here on one device.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import flax.linen as nn
import numpy as np
import optax
import pytest

import flaxlight
from conftest import ClassifyTrainer, TinyMLP, quiet

PRELUDE = """
import os
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import json, jax, numpy as np, optax, flax.linen as nn, flaxlight
from pathlib import Path
from conftest import ClassifyTrainer, quiet
rng = np.random.default_rng(0)
x, y = rng.normal(size=(128, 64)).astype(np.float32), rng.integers(0, 10, 128).astype(np.int32)
"""


RUNNER = """
import contextlib, io, json, logging, os, sys, traceback
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
import jax
results = {}
for name, script in json.loads(open(sys.argv[1]).read()).items():
    namespace, out = {"__name__": "__main__"}, io.StringIO()
    process_count, handlers = jax.process_count, list(logging.getLogger("flaxlight").handlers)
    try:
        with contextlib.redirect_stdout(out):
            exec(script, namespace)
        results[name] = {"got": json.loads(out.getvalue().strip().splitlines()[-1])}
    except BaseException:
        results[name] = {"error": traceback.format_exc()}
    finally:  # what a script changes for its own checks is undone before the next
        jax.process_count = process_count
        logging.getLogger("flaxlight").handlers[:] = handlers
print(json.dumps(results))
"""


@pytest.fixture(scope="module")
def four_devices(tmp_path_factory):
    """The 4-device scripts of this file (each after PRELUDE, its last stdout line JSON), run on 4
    forced CPU devices in one subprocess (a JAX start-up each costs seconds), one after another,
    each in its own namespace and folder; by name, its JSON or its traceback."""
    root = tmp_path_factory.mktemp("four_devices")
    scripts = {name: PRELUDE + f"tmp = Path({str(tmp_path_factory.mktemp(name.lower()))!r})\n" + globals()[name]
               for name in ("MAKE_MESH", "SET_MESH", "NOT_PER_EXAMPLE", "LIST_LOADER", "FULL_BATCH")}
    (root / "scripts.json").write_text(json.dumps(scripts))
    env = dict(os.environ, CI="true", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    env.pop("XLA_FLAGS", None)
    done = subprocess.run([sys.executable, "-c", RUNNER, str(root / "scripts.json")], env=env, text=True,
                          capture_output=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def _on_4_devices(results: dict, name: str) -> dict:
    """What script ``name`` printed on 4 forced CPU devices (see four_devices)."""
    assert "got" in results[name], results[name]["error"][-3000:]
    return results[name]["got"]


MAKE_MESH = """
class Wide(nn.Module):  # its 64x256 kernel is split by FSDP
    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(10)(nn.relu(nn.Dense(256)(x)))

class Annotated(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        init = nn.initializers.lecun_normal()
        x = nn.relu(nn.Dense(32, kernel_init=nn.with_partitioning(init, (None, "model")))(x))
        return nn.Dense(10, kernel_init=nn.with_partitioning(init, ("model", None)))(x)

def run(tag, model, **kwargs):
    trainer = ClassifyTrainer(model_class=model, model_hparams={}, optimizer_hparams={"optimizer": "adam", "lr": 1e-2},
                              exmp_input=x[:1], **quiet(tmp / tag, **kwargs))
    metrics = trainer.train_model((x, y), (x, y), num_epochs=2, batch_size=32)
    leaves = jax.tree_util.tree_leaves_with_path(trainer.state.params)
    return {"loss": float(metrics["val/loss"]), "types": [t.name for t in trainer.mesh.axis_types],
            "params": {jax.tree_util.keystr(p): np.asarray(v).tolist() for p, v in leaves},
            "specs": {jax.tree_util.keystr(p): str(v.sharding.spec) for p, v in leaves}}

out = {"fsdp": run("fsdp", Wide, distributed="fsdp", mesh=jax.make_mesh((4,), ("data",))),
       "fsdp_dict": run("fsdp_dict", Wide, distributed="fsdp", mesh={"data": 4}),
       "tp": run("tp", Annotated, mesh=jax.make_mesh((2, 2), ("data", "model"))),
       "tp_dict": run("tp_dict", Annotated, mesh={"data": 2, "model": 2})}
print(json.dumps(out))
"""


def test_a_jax_make_mesh_mesh_trains_as_its_shape_dict_does(four_devices):
    """jax.make_mesh gives Explicit axes in this JAX; FSDP and an annotated model crashed inside the
    model with a ShardingTypeError. Now its axes are used as Auto ones: the same numbers as mesh={...}."""
    got = _on_4_devices(four_devices, "MAKE_MESH")
    assert got["fsdp"]["specs"]["['Dense_1']['kernel']"] == "P(None, 'data')"  # Dense(256): built second
    assert got["tp"]["specs"]["['Dense_0']['kernel']"] == "P(None, 'model')"
    for given, shaped in (("fsdp", "fsdp_dict"), ("tp", "tp_dict")):
        assert set(got[given]["types"]) == {"Auto"}
        assert got[given]["loss"] == pytest.approx(got[shaped]["loss"], rel=1e-6)
        for name, value in got[given]["params"].items():
            np.testing.assert_allclose(value, got[shaped]["params"][name], rtol=1e-6, atol=1e-7, err_msg=name)


SET_MESH = """
class Wide(nn.Module):
    @nn.compact
    def __call__(self, x, train: bool = False):
        return nn.Dense(10)(nn.relu(nn.Dense(256)(x)))

def run(tag, **kwargs):
    trainer = ClassifyTrainer(model_class=Wide, model_hparams={}, exmp_input=x[:1],
                              optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, **quiet(tmp / tag, **kwargs))
    metrics = trainer.train_model((x, y), (x, y), num_epochs=2, batch_size=32)
    test = trainer.eval_model((x, y), batch_size=32)["loss"]
    return {"loss": float(metrics["val/loss"]), "test": float(test),
            "types": [t.name for t in trainer.mesh.axis_types]}

m = jax.make_mesh((4,), ("data",))
out = {"outside": run("outside", mesh={"data": 4})}
with jax.set_mesh(m):
    out["context"] = run("context", mesh=m)
    for tag, kwargs in (("dict", {"mesh": {"data": 4}}), ("fsdp", {"mesh": m, "distributed": "fsdp"})):
        try:
            run(tag, **kwargs)
            out[tag] = "trained"
        except ValueError as exc:
            out[tag] = str(exc)
print(json.dumps(out))
"""


def test_under_jax_set_mesh_the_same_mesh_trains_as_given(four_devices):
    """`with jax.set_mesh(m):` around a trainer given mesh=m (m from jax.make_mesh: Explicit axes)
    trained before m was converted to Auto axes, which JAX then refused under the Explicit context.
    Now m is used as given there, with the numbers of mesh={"data": 4}; what cannot run under it
    (another mesh, FSDP-split parameters) is refused at construction, saying what to do."""
    got = _on_4_devices(four_devices, "SET_MESH")
    assert got["context"]["types"] == ["Explicit"]  # used as given
    assert got["context"]["loss"] == pytest.approx(got["outside"]["loss"], rel=1e-5)
    assert got["context"]["test"] == pytest.approx(got["outside"]["test"], rel=1e-5)
    assert "JAX's context mesh here has Explicit axes ({'data': 4}" in got["dict"], got["dict"]
    assert "from mesh={'data': 4} (made with Auto axes), is another mesh" in got["dict"]
    assert "mesh=m for `with jax.set_mesh(m):`" in got["dict"] and "outside the `with` block" in got["dict"]
    assert "distributed='fsdp' splits parameters over 'data'" in got["fsdp"], got["fsdp"]
    assert "outside the `with` block" in got["fsdp"] and "distributed='data_parallel'" in got["fsdp"]


NOT_PER_EXAMPLE = """
import jax.numpy as jnp

class Weighted(ClassifyTrainer):
    def loss_fn(self, params, batch, *, train, rng, state):
        x, y, w = (batch["x"], batch["y"], batch["a_weights"]) if isinstance(batch, dict) else batch
        logits, updates = state.apply_model(params, x, train=train, rng=rng)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, y) * (w[y] if w.ndim else w)
        return loss.mean(), ({"weighted": jnp.sum(w)}, updates)

weights = np.linspace(0.5, 2.0, 10).astype(np.float32)
def batch(tag, i, j):
    if tag == "dict":  # the weights sort first: they were taken for the batch size
        return {"a_weights": weights, "x": x[i:j], "y": y[i:j]}
    return x[i:j], y[i:j], np.float32(0.5) if tag == "scalar" else weights

out = {}
for tag, kwargs in (("tuple", {}), ("dict", {}), ("scalar", {}), ("generator", {}),
                    ("fused", {"steps_per_execution": 2})):
    for where, mesh in (("one", {}), ("mesh", {"distributed": "data_parallel"})):
        trainer = Weighted(model_class=nn.Dense, model_hparams={"features": 10}, optimizer_hparams={"lr": 0.1},
                           exmp_input=x[:1], **quiet(tmp / tag / where, **kwargs, **mesh))
        train = [batch(tag, i, i + 32) for i in range(0, 128, 32)]
        train = (b for b in train) if tag == "generator" else train
        val = [batch(tag, 0, 32), batch(tag, 32, 62)]  # the second: 30 examples, not split over 4
        metrics = trainer.train_model(train, val, num_epochs=1, steps_per_epoch=4)
        out[f"{tag}/{where}"] = {k: float(v) for k, v in metrics.items() if k.startswith(("train/", "val/"))}
        out[f"{tag}/{where}"]["kernel"] = np.asarray(trainer.state.params["kernel"]).tolist()
placed = flaxlight.distributed.to_global_batch(batch("tuple", 0, 32), flaxlight.distributed.make_mesh())
out["specs"] = [str(leaf.sharding.spec) for leaf in placed]
print(json.dumps(out))
"""


def test_batch_leaves_that_are_not_per_example_train_on_a_mesh_as_on_one_device(four_devices):
    """A (10,) class-weight leaf (or a scalar) next to 32 examples gave JAX's IndivisibleError on 4
    devices (10 does not split over 4), then was refused on any mesh, even one device's. On one
    process it is the same global array on every device: it is put whole on each, the examples
    are split, and the run matches one device's."""
    got = _on_4_devices(four_devices, "NOT_PER_EXAMPLE")
    for tag in ("tuple", "dict", "scalar", "generator", "fused"):
        one, mesh = got[f"{tag}/one"], got[f"{tag}/mesh"]
        assert set(mesh) == set(one) and "val/loss" in one, (tag, one, mesh)
        for name, value in one.items():
            np.testing.assert_allclose(mesh[name], value, rtol=1e-5, atol=1e-6, err_msg=f"{tag} {name}")
    assert got["tuple/one"]["val/weighted"] == pytest.approx(12.5)  # the weights reached the loss whole
    assert got["specs"] == ["P('data',)", "P('data',)", "P()"]  # the examples are split, the weights are not


def test_batch_leaves_that_are_not_per_example_train_on_one_device(tmp_path):
    """docs/data.md: on one device such a batch is accepted when a loss_fn of yours traces on it."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(64, 4)).astype(np.float32), rng.integers(0, 3, 64).astype(np.int32)

    class Weighted(ClassifyTrainer):
        def loss_fn(self, params, batch, *, train, rng, state):
            x, y, w = batch
            logits, updates = state.apply_model(params, x, train=train, rng=rng)
            return (optax.softmax_cross_entropy_with_integer_labels(logits, y) * w[y]).mean(), ({}, updates)

    trainer = Weighted(model_class=nn.Dense, model_hparams={"features": 3}, optimizer_hparams={"lr": 0.1},
                       exmp_input=x[:1], **quiet(tmp_path))
    batches = [(x[i:i + 16], y[i:i + 16], np.ones(3, np.float32)) for i in range(0, 64, 16)]
    assert np.isfinite(trainer.train_model(batches, None, num_epochs=1)["train/loss"])


TWO_PROCESSES = """
import os, sys
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
import numpy as np, flax.linen as nn, flaxlight
from pathlib import Path
from conftest import ClassifyTrainer, quiet
flaxlight.distributed.initialize(f"127.0.0.1:{sys.argv[1]}", 2, int(sys.argv[2]))
rng = np.random.default_rng(0)
x, y = rng.normal(size=(64, 8)).astype(np.float32), rng.integers(0, 10, 64).astype(np.int32)
class_weights = np.ones(10, np.float32)
batches = [{"image": x[i:i + 8], "class_weights": class_weights, "label": y[i:i + 8]} for i in range(0, 64, 8)]
trainer = ClassifyTrainer(model_class=nn.Dense, model_hparams={"features": 10}, optimizer_hparams={"lr": 0.1},
                          exmp_input=x[:1], **quiet(Path(sys.argv[3]), distributed="data_parallel"))
try:
    trainer.train_model(batches, None, num_epochs=1)
except ValueError as exc:
    print(type(exc).__name__, exc)
"""


def test_with_several_processes_a_leaf_that_is_not_per_example_is_named(tmp_path):
    """Each process passes its own rows of every leaf: a (10,) leaf has none, so with two processes
    it stays an error naming the leaf (on one process it is put whole on every device)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, CI="true", JAX_PLATFORMS="cpu",
               PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    env.pop("XLA_FLAGS", None)
    workers = [subprocess.Popen([sys.executable, "-c", TWO_PROCESSES, str(port), str(i), str(tmp_path / str(i))],
                                env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
    for worker in workers:
        out, err = worker.communicate(timeout=300)
        assert worker.returncode == 0, err[-3000:]
        assert "UnsplittableBatchError The batch's leaf ['class_weights'] has shape (10,)" in out, out + err[-2000:]
        assert "the batch holds 8 examples (leaf ['image'] has shape (8, 8))" in out and "ambiguous" not in out
        assert "With several processes (2) each passes its own rows of every leaf" in out
        assert "per-example arrays only" in out and "put whole on every device" in out


@pytest.mark.parametrize("batch, leaf, rows, ambiguous", [
    ({"image": np.zeros((8, 4), np.float32), "class_weights": np.ones(10, np.float32)},
     "['class_weights'] has shape (10,)", 8, True),
    ({"class_weights": np.ones(10, np.float32), "image": np.zeros((8, 4), np.float32)},
     "['image'] has shape (8, 4)", 10, True),
    ({"class_weights": np.ones(10, np.float32), "image": np.zeros((8, 4), np.float32), "label": np.zeros(8, np.int32)},
     "['class_weights'] has shape (10,)", 8, False),
    ((np.zeros((8, 4), np.float32), np.float32(1.0)), "[1] has shape () (a scalar)", 8, False)])
def test_the_leaf_named_is_the_one_that_is_not_per_example(monkeypatch, batch, leaf, rows, ambiguous):
    """The examples were the most common leading dimension, ties going to the larger one, so
    {"image": (8, 4), "class_weights": (10,)} blamed image. Now a tie goes to the first leaf as
    the batch is written (a dict's first key), and the message says the count was ambiguous."""
    import jax

    monkeypatch.setattr(jax, "process_count", lambda: 2)  # the check made with several processes
    mesh = flaxlight.distributed.make_mesh(jax.devices()[:1])
    for check in (lambda: flaxlight.distributed.to_global_batch(batch, mesh),
                  lambda: flaxlight.distributed.check_loader_divisible([batch], mesh)):  # before the run
        with pytest.raises(flaxlight.distributed.UnsplittableBatchError) as raised:
            check()
        message = str(raised.value)
        assert f"The batch's leaf {leaf}" in message and f"the batch holds {rows} examples" in message, message
        assert ("that count is ambiguous" in message) == ambiguous, message


LIST_LOADER = """
class Batches:  # a loader of the user's: each iter() a new pass
    def __init__(self, size):
        self.size = size
    def __iter__(self):
        return ((x[i:i + self.size], y[i:i + self.size]) for i in range(0, 120, self.size))

out = {}
for tag, make in (("list", lambda size: [(x[i:i + size], y[i:i + size]) for i in range(0, 120, size)]),
                  ("class", Batches)):
    def trainer():
        return ClassifyTrainer(model_class=nn.Dense, model_hparams={"features": 10}, optimizer_hparams={"lr": 0.1},
                               exmp_input=x[:1], **quiet(tmp / tag, distributed="data_parallel"))
    try:
        trainer().train_model(make(30), None, num_epochs=1, steps_per_epoch=4)
    except ValueError as exc:
        out[tag] = str(exc)
    out[tag + "_claimed"] = (tmp / tag / "run" / "hparams.yaml").exists()
    out[tag + "_rerun"] = float(trainer().train_model(make(40), None, num_epochs=1, steps_per_epoch=3)["train/loss"])
print(json.dumps(out))
"""


def test_a_list_loader_whose_batches_do_not_split_is_refused_before_the_run_folder(four_devices):
    """Only an ArrayLoader (or torch loader) was checked before the run's folder was claimed; a list
    of 30-example batches failed after hparams.yaml was written, so the rerun was refused."""
    got = _on_4_devices(four_devices, "LIST_LOADER")
    for tag in ("list", "class"):
        assert "A batch of 30 examples cannot be split over 4 devices" in got[tag]
        assert not got[tag + "_claimed"]
        assert np.isfinite(got[tag + "_rerun"])  # the corrected run in the same log_dir


FULL_BATCH = """
from conftest import TinyMLP
import logging

said = []
handler = logging.Handler()
handler.emit = lambda record: said.append(record.getMessage())
logging.getLogger("flaxlight").addHandler(handler)
train, val = (x[:118], y[:118]), flaxlight.ArrayLoader(x[118:], y[118:], batch_size=10)

class SaysMore:  # its batch_size attribute says 64; it yields 4 batches of 30
    batch_size = 64
    def __len__(self):
        return 4
    def __iter__(self):
        return iter([(x[i:i + 30], y[i:i + 30]) for i in range(0, 120, 30)])

out = {}
for tag, data, kwargs in (("loader", flaxlight.ArrayLoader(*train, batch_size=128), {}),
                          ("splits", flaxlight.ArrayLoader(x[:40], y[:40], batch_size=50), {}),
                          ("says_more", SaysMore(), {}),
                          ("shuffled", flaxlight.ArrayLoader(*train, batch_size=256, shuffle=True), {}),
                          ("arrays", train, {"batch_size": 120}),
                          ("drop_last", flaxlight.ArrayLoader(*train, batch_size=128, drop_last=True), {})):
    for where, mesh in (("one", {}), ("mesh", {"distributed": "data_parallel"})):
        trainer = ClassifyTrainer(model_class=TinyMLP, model_hparams={"output_dim": 10, "batch_norm": True},
                                  optimizer_hparams={"optimizer": "sgd", "lr": 0.1}, exmp_input=x[:1],
                                  **quiet(tmp / tag / where, **mesh))
        try:
            metrics = trainer.train_model(data, val, num_epochs=2, **kwargs)
        except ValueError as exc:
            out[f"{tag}/{where}"] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        out[f"{tag}/{where}"] = {k: float(v) for k, v in metrics.items() if k.startswith(("train/", "val/"))}
        out[f"{tag}/{where}"]["params"] = [np.asarray(p).tolist() for p in jax.tree.leaves(trainer.state.params)]
out["said"] = said
jax.process_count = lambda: 2  # with several processes the last batch must split: say how
try:
    flaxlight.distributed.to_global_batch((x[:59], y[:59]), flaxlight.distributed.make_mesh())
except ValueError as exc:
    out["processes"] = str(exc)
print(json.dumps(out))
"""


def test_full_batch_training_on_a_mesh_matches_one_device(four_devices):
    """batch_size >= the dataset (118 examples, not a multiple of 4) was refused on 4 devices with
    "use a batch size that is a multiple of 4", though 128 is one. The epoch's one batch is also its
    smaller last batch, which runs whole on every device as documented: the same numbers as one
    device, said once. drop_last=True leaves no batch, on a mesh as on one device. A batch_size that
    does not split (50) over a dataset that does (40 examples) trains data-parallel; a loader whose
    batch_size attribute says more than its batches hold is not taken for one batch per epoch."""
    got = _on_4_devices(four_devices, "FULL_BATCH")
    assert "A batch of 30 examples cannot be split over 4 devices" in got["says_more/mesh"]["error"]
    for tag in ("loader", "shuffled", "arrays", "splits"):  # splits: batch_size 50 > 40 examples, which split
        one, mesh = got[f"{tag}/one"], got[f"{tag}/mesh"]
        assert "error" not in mesh and set(mesh) == set(one), (tag, mesh)
        for a, b in zip(mesh.pop("params"), one.pop("params"), strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=tag)
        for name, value in one.items():
            np.testing.assert_allclose(mesh[name], value, rtol=1e-5, atol=1e-6, err_msg=f"{tag} {name}")
    assert got["drop_last/mesh"] == got["drop_last/one"] and "yielded no batches" in got["drop_last/one"]["error"]
    full = [m for m in got["said"] if "fewer than batch_size" in m]
    assert len(full) == 3 and "118 examples, fewer than batch_size=128" in full[0], got["said"]
    assert "runs whole on every device (the same numbers as one device, without data parallelism)" in full[0]
    assert "A batch of 118 examples cannot be split over 4 devices" in got["processes"]
    assert "an epoch's smaller last batch" in got["processes"] and "drop_last=True" in got["processes"]


@pytest.mark.parametrize("mesh, hint", [([2, 2], "mesh={'data': 2, 'model': 2}"), ((("data", 4),), "mesh={'data': 4}"),
                                        ({"data": "2"}, ""), ("data", "")])
def test_a_mesh_in_another_form_lists_the_accepted_forms(tmp_path, mesh, hint):
    with pytest.raises(TypeError) as raised:
        ClassifyTrainer(model_class=TinyMLP, model_hparams={}, optimizer_hparams={},
                        exmp_input=np.zeros((1, 4), np.float32), **quiet(tmp_path, mesh=mesh))
    message = str(raised.value)
    assert "mesh= takes a jax.sharding.Mesh with a 'data' axis, or a dict of axis names to sizes" in message
    assert f"Got {mesh!r}" in message and hint in message
    assert not (tmp_path / "run").exists()


class SyncedBatchNorm(nn.Module):
    """What a DDP/pmap user writes for synchronised BatchNorm statistics."""

    @nn.compact
    def __call__(self, x, train: bool = False):
        x = nn.BatchNorm(use_running_average=not train, axis_name="data")(nn.Dense(8)(x))
        return nn.Dense(3)(nn.relu(x))


def test_batchnorm_with_an_axis_name_says_the_statistics_are_global_already(tmp_path):
    """JAX's own error said to use shard_map, the wrong direction for a global-view step."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(32, 4)).astype(np.float32), rng.integers(0, 3, 32).astype(np.int32)
    trainer = ClassifyTrainer(model_class=SyncedBatchNorm, model_hparams={}, optimizer_hparams={"lr": 0.1},
                              exmp_input=x[:1], **quiet(tmp_path, distributed="data_parallel"))
    with pytest.raises(NameError) as raised:
        trainer.train_model(flaxlight.ArrayLoader(x, y, batch_size=16), None, num_epochs=1)
    message = str(raised.value)
    assert "nn.BatchNorm(axis_name='data')" in message and "Remove axis_name" in message
    assert "already computed over the whole global batch" in message and "call psum under" not in message
