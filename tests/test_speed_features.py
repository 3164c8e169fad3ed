"""Fused steps, prefetching and compile-once behaviour: same results, no extra work."""

import collections
import contextlib
import csv
import itertools
import threading

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from conftest import RegressTrainer, TinyMLP, linear_data, quiet

import flaxlight
from flaxlight import ArrayLoader
from flaxlight.lean import idle_fields
from flaxlight.state import step_key
from flaxlight.data import DeviceEpoch, Prefetcher, group_batches, take_batches

X0 = np.zeros((1, 4), np.float32)


def _run(tmp_path, name, num_epochs=3, model_hparams=None, **kwargs):
    train = ArrayLoader(*linear_data(300, 0), batch_size=32, shuffle=True, seed=0)  # 10 batches, the last of 12
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [16], **(model_hparams or {})},
                             optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, exmp_input=X0,
                             **quiet(tmp_path, logger_params={"log_dir": str(tmp_path / name)}, **kwargs))
    trainer.train_model(train, None, num_epochs=num_epochs)
    with open(tmp_path / name / "metrics.csv") as f:
        rows = [{k: v for k, v in row.items() if k != "epoch_time"} for row in csv.DictReader(f)]
    return jax.device_get(trainer.state.params), rows, trainer


@pytest.mark.parametrize("model_hparams", [{}, {"batch_norm": True, "dropout_prob": 0.1}], ids=["mlp", "bn-dropout"])
def test_fused_steps_give_the_same_params_and_logs_as_single_steps(tmp_path, model_hparams):
    """Bitwise for these MLPs (README's claim); a convolution may round differently in the fused loop."""
    single, single_rows, _ = _run(tmp_path, "single", model_hparams=model_hparams, log_every_n_steps=4, prefetch=0)
    fused, fused_rows, trainer = _run(tmp_path, "fused", model_hparams=model_hparams, log_every_n_steps=4,
                                      steps_per_execution=4, prefetch=2)
    jax.tree.map(np.testing.assert_array_equal, fused, single)  # bitwise, the epoch tails included
    assert fused_rows == single_rows
    assert int(trainer.state.step) == 30


def test_max_steps_ends_a_fused_run_exactly_there(tmp_path):
    """max_steps=27 falls inside a block of 4 (epoch 3's blocks end at 24 and 28): the steps before
    it run single, so the run ends at 27 exactly (its schedule was sized for 27; it ran to 28 before),
    with the single-step run's params and checkpoint."""
    single, _, _ = _run(tmp_path, "single", max_steps=27, prefetch=0)
    fused, _, trainer = _run(tmp_path, "fused", max_steps=27, steps_per_execution=4)
    assert int(trainer.state.step) == 27 and trainer.checkpointer.latest_step() == 27
    jax.tree.map(np.testing.assert_array_equal, fused, single)


@contextlib.contextmanager
def count_host_reads():
    """Count device-to-host reads and waits: every path to a jax.Array's values (np.asarray,
    float, device_get) goes through ``ArrayImpl._value``. JAX's transfer guard cannot see them on
    the CPU, where arrays already live in host memory; this counter can. ``"implicit"`` counts the
    reads and async copies that ``jax.transfer_guard("disallow")`` stops on an accelerator: those
    outside ``jax.device_get`` and the loop's ``deliberate_reads``."""
    from jax._src.array import ArrayImpl
    from jax._src.lib import guard_lib

    reads = collections.Counter()
    value, wait, start = ArrayImpl._value, ArrayImpl.block_until_ready, ArrayImpl.copy_to_host_async

    def count(kind):
        reads[kind] += 1
        reads["implicit"] += not guard_lib.thread_local_state().explicit_device_get

    def counted_value(self):
        count("read")
        return value.fget(self)

    def counted_wait(self):
        reads["wait"] += 1
        return wait(self)

    def counted_start(self):
        count("copy")
        return start(self)

    ArrayImpl._value, ArrayImpl.block_until_ready, ArrayImpl.copy_to_host_async = \
        property(counted_value), counted_wait, counted_start
    try:
        yield reads
    finally:
        ArrayImpl._value, ArrayImpl.block_until_ready, ArrayImpl.copy_to_host_async = value, wait, start


@pytest.mark.parametrize("options", [
    {"steps_per_execution": 1},
    {"steps_per_execution": 8, "prefetch": 2},
    {"steps_per_execution": 1, "prefetch": 2},
])
@pytest.mark.parametrize("on_device", [True, False])
def test_values_leave_the_device_only_at_log_points(tmp_path, monkeypatch, options, on_device):
    # Reads take the accelerator's path (an async copy at the log point, jax.device_get later):
    # numpy reads CPU arrays in place, unseen by the counter and by the guard.
    monkeypatch.setattr(flaxlight.metrics, "_arrays_in_host_memory", lambda: False)
    train = ArrayLoader(*linear_data(4000, 0), batch_size=8, on_device=on_device)  # 500 steps
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={}, optimizer_hparams={}, exmp_input=X0,
                             **quiet(tmp_path, log_every_n_steps=64, **options))
    trainer.init_optimizer(2, len(train))
    trainer.train_epoch(train)  # compile first
    with jax.transfer_guard_device_to_host("disallow"), count_host_reads() as reads:
        assert trainer.train_epoch(train)["train/loss"] >= 0
    # The 7 log points and the epoch's end each copy the vector of sums (loss, examples, non-finite
    # steps) once; one copy or read per step would be 500.
    assert reads["copy"] + reads["read"] <= 3 * (500 // 64 + 2) and reads["wait"] == 0, reads
    # Every one is deliberate, which jax.transfer_guard("disallow") lets pass on an accelerator.
    assert reads["implicit"] == 0, reads


def test_a_smaller_last_batch_compiles_once(tmp_path):
    _, _, trainer = _run(tmp_path, "run", num_epochs=1, prefetch=0)  # compiles the batch of 32 and the last of 12
    train = ArrayLoader(*linear_data(300, 0), batch_size=32, shuffle=True, seed=0)
    compiles = []

    def record(event, duration, **kwargs):
        if "compile" in event or "trac" in event:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(record)
    try:
        for epoch in range(2, 5):
            train.set_epoch(epoch)
            trainer.train_epoch(train)
    finally:
        jax.monitoring.unregister_event_duration_listener(record)
    assert compiles == []


def test_group_batches_and_prefetcher():
    batches = [np.full((2, 3), i) for i in range(5)] + [np.zeros((1, 3))]
    groups = list(group_batches(batches, 2))
    assert [n for n, _ in groups] == [2, 2, 1, 1]
    assert [n for n, _ in group_batches(batches, 2, start=3)] == [1, 2, 2, 1]
    assert groups[0][1].shape == (2, 2, 3) and groups[1][1][1, 0, 0] == 3

    def broken():
        yield np.zeros(2)
        raise OSError("disk went away")

    prefetched = Prefetcher(broken(), size=1)
    with pytest.raises(OSError, match="disk went away"):
        list(prefetched)
    prefetched.close()


def test_bad_steps_per_execution(tmp_path):
    with pytest.raises(ValueError, match="steps_per_execution must be a positive int"):
        RegressTrainer(model_class=TinyMLP, model_hparams={}, optimizer_hparams={}, exmp_input=X0,
                       **quiet(tmp_path, steps_per_execution=0))


def _tiny_state(rng=True):
    params = {"w": jnp.ones((4, 1))}
    return flaxlight.TrainState.create(apply_fn=None, params=params, tx=optax.sgd(0.1),
                                       rng=jax.random.PRNGKey(0) if rng else None)


def _sgd_step(use_rng=False, advance_rng=False):
    def step(state, acc, batch):
        x, y = batch
        noise = jax.random.normal(step_key(state), y.shape) if use_rng else 0.0
        grads = jax.grad(lambda p: jnp.mean((x @ p["w"] + noise - y) ** 2))(state.params)
        new = state.apply_gradients(grads=grads)
        if advance_rng:
            new = new.replace(rng=jax.random.split(state.rng)[0])
        return new, acc + 1

    return step


@pytest.mark.parametrize("use_rng, advance_rng, expected", [
    (False, False, ("rng", "epoch")),  # neither read nor changed: kept out of the loop's calls
    (True, False, ("epoch",)),         # the step key is read
    (False, True, ("epoch",)),         # the step replaces the key
])
def test_idle_fields_are_those_the_step_neither_reads_nor_changes(use_rng, advance_rng, expected):
    batch = (jnp.ones((8, 4)), jnp.ones((8, 1)))
    assert idle_fields(_sgd_step(use_rng, advance_rng), _tiny_state(), jnp.zeros(()), batch) == expected


class EpochAwareTrainer(RegressTrainer):
    """Reports the state's epoch as a metric: the epoch must reach the step."""

    def loss_fn(self, params, batch, *, train, rng, state):
        loss, (metrics, updates) = super().loss_fn(params, batch, train=train, rng=rng, state=state)
        return loss, ({"seen_epoch": state.epoch.astype(jnp.float32)}, updates)


def test_a_step_that_reads_the_epoch_sees_it(tmp_path):
    train = ArrayLoader(*linear_data(64, 0), batch_size=16)
    trainer = EpochAwareTrainer(model_class=TinyMLP, model_hparams={}, optimizer_hparams={}, exmp_input=X0,
                                **quiet(tmp_path))
    trainer.train_model(train, None, num_epochs=3)
    with open(trainer.log_dir + "/metrics.csv") as f:
        seen = [float(row["train/seen_epoch"]) for row in csv.DictReader(f) if row.get("train/seen_epoch")]
    assert seen == [0.0, 1.0, 2.0]  # completed epochs when each epoch's steps ran


class CompileWatcher(RegressTrainer):
    """Records the JAX compile events raised by the training thread while validating."""

    def eval_model(self, data_loader, log_prefix=""):
        events = []

        def record(event, duration, **kwargs):
            if "compile" in event and threading.current_thread() is threading.main_thread():
                events.append(event)

        jax.monitoring.register_event_duration_secs_listener(record)
        try:
            return super().eval_model(data_loader, log_prefix)
        finally:
            jax.monitoring.unregister_event_duration_listener(record)
            self.validation_compiles.append(len(events))


def test_eval_is_compiled_ahead_in_the_background(tmp_path):
    train = ArrayLoader(*linear_data(256, 0), batch_size=32)
    val = ArrayLoader(*linear_data(50, 1), batch_size=16)  # batches of 16 and a last one of 2
    trainer = CompileWatcher(model_class=TinyMLP, model_hparams={"hidden_dims": [24]}, optimizer_hparams={},
                             exmp_input=X0, **quiet(tmp_path))
    trainer.validation_compiles = []
    trainer.train_model(train, val, num_epochs=2)
    assert trainer.validation_compiles == [0, 0]  # neither shape compiled in the training thread


def test_a_resumed_runs_validation_is_compiled_ahead_too(tmp_path):
    """A resume restores arrays committed to the device, where a fresh model's are not: the eval
    step compiled ahead for the fresh placement was compiled again in the training thread at the
    first validation, twice (its zeroed sums placed otherwise than the sums it returns), as was the
    train step once more; both are now compiled for the restored state's placement."""
    train = ArrayLoader(*linear_data(256, 0), batch_size=32)
    val = ArrayLoader(*linear_data(50, 1), batch_size=16)

    def trainer():
        made = CompileWatcher(model_class=TinyMLP, model_hparams={"hidden_dims": [24]}, optimizer_hparams={},
                              exmp_input=X0, **quiet(tmp_path))
        made.validation_compiles = []
        return made

    trainer().train_model(train, val, num_epochs=2)
    resumed = trainer()
    resumed.train_model(train, val, num_epochs=4, resume=True)
    assert resumed.global_step == 32 and resumed.validation_compiles == [0, 0]


@pytest.mark.parametrize("drop_last, stop, start, steps, global_step", [
    (False, 10, 0, 1, 0),   # every batch, the smaller last one included
    (True, 9, 0, 4, 3),     # blocks of 4 aligned to global-step multiples, singles around them
    (False, 10, 6, 4, 6),   # resumed at batch 6: blocks from there, then the last batch
    (False, 5, 0, 1, 0),    # limit_train_batches: the first 5
])
@pytest.mark.parametrize("host_gather, device_rows", [(False, False), (False, True), (True, None)])
def test_device_epoch_serves_exactly_the_loaders_batches(host_gather, device_rows, drop_last, stop, start, steps,
                                                         global_step):
    x, y = linear_data(300, 0)
    loader = ArrayLoader(x, y, batch_size=32, shuffle=True, seed=3, drop_last=drop_last)
    loader.set_epoch(7)
    expected = list(itertools.islice(iter(loader), start, stop))
    epoch = DeviceEpoch(loader, stop=stop, host_gather=host_gather, device_rows=device_rows)
    served, sizes = [], []
    for n, (source, i) in epoch.items(start=start, steps=steps, global_step=global_step):
        sizes.append(n)
        block = take_batches(source, i, count=n)  # what a fused step gets
        served += [jax.tree.map(lambda a: np.asarray(a[k]), block) for k in range(n)]
        if n == 1:
            jax.tree.map(np.testing.assert_array_equal, take_batches(source, i), served[-1])  # a single step
    assert len(served) == len(expected)
    for got, want in zip(served, expected):
        jax.tree.map(np.testing.assert_array_equal, got, want)
    # blocks never straddle a multiple of `steps` (counted in global steps)
    position = global_step
    for n in sizes:
        assert n == 1 or position % n == 0
        position += n


@pytest.fixture
def device_gathers(monkeypatch):
    """The device gathers of whole epochs, in the order dispatched (``"gather"`` entries in a list
    the test may add its own entries to)."""
    events, gather = [], flaxlight.data._gather_epoch

    def noting(data, rows):
        events.append("gather")
        return gather(data, rows)

    monkeypatch.setattr(flaxlight.data, "_gather_epoch", noting)
    return events


def test_an_epoch_made_ahead_gathers_on_the_device_only_once_started(device_gathers):
    loader = ArrayLoader(*linear_data(100, 0), batch_size=32, shuffle=True, seed=3)  # 3 batches and a last of 4
    expected = list(iter(loader))
    ahead = DeviceEpoch(loader, stop=len(loader))
    assert device_gathers == []  # made: the permutation sent, nothing gathered yet
    ahead.start_gather()
    ahead.start_gather()  # once
    assert device_gathers == ["gather", "gather"]  # the full batches and the smaller last one
    for epoch in (ahead, DeviceEpoch(loader, stop=len(loader))):  # started, or by serving
        served = [jax.tree.map(np.asarray, take_batches(source, i)) for _, (source, i) in
                  epoch.items(start=0, steps=1, global_step=0)]
        for got, want in zip(served, expected, strict=True):
            jax.tree.map(np.testing.assert_array_equal, got, want)
    assert len(device_gathers) == 4


def test_an_epoch_whose_gather_was_interrupted_gathers_again_when_served(monkeypatch):
    loader = ArrayLoader(*linear_data(64, 0), batch_size=32, shuffle=True, seed=3)
    expected, gather = list(iter(loader)), flaxlight.data._gather_epoch
    ahead = DeviceEpoch(loader, stop=len(loader))

    def interrupted(data, rows):
        raise KeyboardInterrupt

    monkeypatch.setattr(flaxlight.data, "_gather_epoch", interrupted)
    with pytest.raises(KeyboardInterrupt):
        ahead.start_gather()
    monkeypatch.setattr(flaxlight.data, "_gather_epoch", gather)
    served = [jax.tree.map(np.asarray, take_batches(source, i)) for _, (source, i) in
              ahead.items(start=0, steps=1, global_step=0)]
    for got, want in zip(served, expected, strict=True):  # the batches, not the row numbers
        jax.tree.map(np.testing.assert_array_equal, got, want)


class EpochEnds(flaxlight.Callback):
    def __init__(self, events):
        self.events = events

    def on_train_epoch_end(self, trainer, epoch, metrics):
        self.events.append(f"train {epoch}")

    def on_validation_end(self, trainer, epoch, metrics):
        self.events.append(f"val {epoch}")


@pytest.mark.parametrize("validates", [True, False])
def test_the_next_epochs_data_are_gathered_while_the_epoch_ends(tmp_path, device_gathers, validates):
    """Queued behind the epoch's last steps, the next epoch's gather made the validation wait; it
    is dispatched once the validation's steps are (before its read: on_validation_end comes
    after), or after the epoch's read when no validation follows."""
    train = ArrayLoader(*linear_data(128, 0), batch_size=16, shuffle=True, seed=0)
    val = ArrayLoader(*linear_data(32, 1), batch_size=16) if validates else None
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, optimizer_hparams={},
                             exmp_input=X0, **quiet(tmp_path, callbacks=[EpochEnds(device_gathers)]))
    trainer.train_model(train, val, num_epochs=3)
    if validates:
        expected = ["gather", "train 1", "gather", "val 1", "train 2", "gather", "val 2", "train 3", "val 3"]
    else:
        expected = ["gather", "gather", "train 1", "gather", "train 2", "train 3"]
    assert device_gathers == expected


@pytest.mark.parametrize("steps_per_execution, dim", [(1, 4), (4, 4), (1, 300)])  # 300 floats: each step gathers
def test_device_epochs_train_exactly_like_host_batches(tmp_path, steps_per_execution, dim):
    x, y = linear_data(300, 0, dim=dim)
    assert (x.nbytes + y.nbytes) / len(x) >= flaxlight.data.ROWS_MIN_EXAMPLE_BYTES or dim == 4

    def run(name, on_device):
        train = ArrayLoader(x, y, batch_size=32, shuffle=True, seed=0, on_device=on_device)
        trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [16]},
                                 optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, exmp_input=x[:1],
                                 **quiet(tmp_path, logger_params={"log_dir": str(tmp_path / name)},
                                         log_every_n_steps=3, steps_per_execution=steps_per_execution))
        trainer.train_model(train, None, num_epochs=3)
        with open(tmp_path / name / "metrics.csv") as f:
            rows = [{k: v for k, v in row.items() if k != "epoch_time"} for row in csv.DictReader(f)]
        return jax.device_get(trainer.state.params), rows

    device_params, device_rows = run("device", True)
    host_params, host_rows = run("host", False)
    jax.tree.map(np.testing.assert_array_equal, device_params, host_params)
    assert device_rows == host_rows


@pytest.mark.parametrize("dim", [4, 300])  # an epoch gathered at once; each step gathering its batch
def test_device_epochs_transfer_nothing_per_step(tmp_path, dim):
    train = ArrayLoader(*linear_data(300, 0, dim=dim), batch_size=32, shuffle=True)  # on_device: automatic
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={}, optimizer_hparams={},
                             exmp_input=linear_data(1, dim=dim)[0],
                             **quiet(tmp_path, log_every_n_steps=4))
    trainer.init_optimizer(3, len(train))
    trainer.train_epoch(train)  # compiles; the data go to the device once
    train.set_epoch(2)
    with jax.transfer_guard_host_to_device("disallow"):
        trainer.train_epoch(train)  # only explicit transfers: the epoch's permutation and indices
    streamed = ArrayLoader(*linear_data(300, 0, dim=dim), batch_size=32, on_device=False)
    with pytest.raises(Exception, match="Disallowed host-to-device transfer"):
        with jax.transfer_guard_host_to_device("disallow"):
            trainer.train_epoch(streamed)  # batch by batch: each step sends its batch


def test_steps_per_execution_auto_measures_picks_a_block_length_and_trains_the_same(tmp_path, caplog):
    train = ArrayLoader(*linear_data(2048, 0), batch_size=16, shuffle=True, seed=0)  # 128 steps per epoch
    single, single_rows, _ = _run_on(tmp_path, "single", train, log_every_n_steps=32)
    auto, auto_rows, trainer = _run_on(tmp_path, "auto", train, log_every_n_steps=32, steps_per_execution="auto")
    chosen = trainer.engine.block_length
    assert chosen in (1, 2, 4, 8, 16, 32)
    said = [r.getMessage() for r in caplog.records if "steps_per_execution='auto'" in r.getMessage()]
    assert len(said) == 1 and (f"{chosen} step(s) per dispatch" in said[0] or  # a loaded machine: slow steps
                               chosen == 1 and "1 step per dispatch (a single step takes" in said[0]), said
    # The measurement trains a copy: every step of the run is trained once, in order.
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), auto, single)
    assert [row["step"] for row in auto_rows] == [row["step"] for row in single_rows]
    assert int(trainer.state.step) == 3 * 128


def _run_on(tmp_path, name, train, **kwargs):
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [16]},
                             optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, exmp_input=X0,
                             **quiet(tmp_path, logger_params={"log_dir": str(tmp_path / name)}, **kwargs))
    trainer.train_model(train, None, num_epochs=3)
    with open(tmp_path / name / "metrics.csv") as f:
        rows = [{k: v for k, v in row.items() if k != "epoch_time"} for row in csv.DictReader(f)]
    return jax.device_get(trainer.state.params), rows, trainer


@pytest.mark.parametrize("single, fused, expected", [
    (100e-6, 40e-6, 32),   # dispatch 64 us next to 36 us of work: as many steps per dispatch as allowed
    (300e-6, 250e-6, 8),   # dispatch 53 us, work 247 us: 53/8 = 6.7 us <= 3% of 247 us
    (2e-3, 1.99e-3, 1),    # dispatch ~0.5% of a step: single steps
    (1e-3, 1.05e-3, 1),    # blocks slower (noise): single steps
])
def test_block_length_for_splits_the_dispatch_cost_until_it_is_small(single, fused, expected):
    from flaxlight.engine import block_length_for

    assert block_length_for(single, fused, fused_length=16) == expected


@pytest.mark.parametrize("longer, accelerator, expected", [
    (48e-6, False, True),    # 4% faster: taken on the CPU
    (49.5e-6, False, False),  # 1% faster: noise on the CPU, blocks of 16 kept
    (50.5e-6, True, True),   # 1% slower on an accelerator: a tie, taken (it hides the loop's host work)
    (52e-6, True, False),    # 4% slower: blocks of 16 kept everywhere
])
def test_a_block_of_32_is_taken_when_it_pays_on_this_backend(longer, accelerator, expected):
    from flaxlight.engine import longer_block_pays

    assert longer_block_pays(fused=50e-6, longer=longer, accelerator=accelerator) is expected


class _CrashAt(flaxlight.Callback):
    every_n_steps = 1

    def __init__(self, at):
        self.at = at

    def on_step(self, trainer, step):
        if step >= self.at:
            raise RuntimeError("crash")


def test_a_resumed_auto_run_keeps_the_block_length_it_chose(tmp_path, caplog):
    train = ArrayLoader(*linear_data(2048, 0), batch_size=16, shuffle=True, seed=0)  # 128 steps per epoch
    crashed = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [16]},
                             optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, exmp_input=X0,
                             callbacks=[_CrashAt(160), flaxlight.callbacks.ModelCheckpoint(every_n_steps=32)],
                             **quiet(tmp_path, log_every_n_steps=32, steps_per_execution="auto"))
    with pytest.raises(RuntimeError, match="crash"):
        crashed.train_model(train, None, num_epochs=2)
    chosen = crashed.engine.block_length
    caplog.clear()
    resumed = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [16]},
                             optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, exmp_input=X0,
                             **quiet(tmp_path, log_every_n_steps=32, steps_per_execution="auto"))
    resumed.train_model(train, None, num_epochs=2, resume=True)
    assert resumed.engine.block_length == chosen and int(resumed.state.step) == 256
    assert not [r for r in caplog.records if "steps_per_execution='auto'" in r.getMessage()]  # not measured again
