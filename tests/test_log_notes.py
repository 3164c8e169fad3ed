"""The training loop's stops: log points noted without one, and the step bar's spaced moves.

A log point that nothing must hear on time (the loggers, the progress bar, the throughput and
learning-rate monitors) is noted by the hot loop and delivered at its next stop; a callback whose
``on_log`` may act on the values (one of yours, ``NaNGuard``) keeps a stop at each log point. The
progress bar's step bar, which stops the loop at each move, moves about ten times a second.
"""

import csv
import re
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import RegressTrainer, TinyMLP, linear_data, quiet

import flaxlight.loop
from flaxlight import ArrayLoader
from flaxlight.callbacks import Callback, NaNGuard, ProgressBar, ThroughputMonitor
from flaxlight.callbacks.progress_bar import REFRESH_SECONDS

X0 = np.zeros((1, 4), np.float32)


class Heard(Callback):
    """Records, for each train log point, (its step, the trainer's global_step when it was heard)."""

    def __init__(self, may_lag: bool):
        self.on_log_may_lag = may_lag
        self.heard: list[tuple[int, int]] = []
        self.values: list[float] = []

    def on_log(self, trainer, step, metrics):
        if "train/loss_step" in metrics:
            self.heard.append((step, trainer.global_step))
            self.values.append(metrics["train/loss_step"])


class Batches:
    """A loader as users write one: ``count`` batches of 4 (regression data), each taking ``seconds``
    to make; ``fail_at``: the batch whose making raises."""

    def __init__(self, count, seconds=0.0, fail_at=None, batch=4):
        self.count, self.seconds, self.fail_at, self.batch = count, seconds, fail_at, batch

    def __len__(self):
        return self.count

    def __iter__(self):
        x, y = linear_data(self.count * self.batch, 0)
        for i in range(self.count):
            if i == self.fail_at:
                raise OSError("disk went away")
            time.sleep(self.seconds)
            yield x[i * self.batch:(i + 1) * self.batch], y[i * self.batch:(i + 1) * self.batch]


def _train(tmp_path, callbacks, loader=None, epochs=2, **options):
    options.setdefault("log_every_n_steps", 4)
    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=X0,
                             optimizer_hparams={"optimizer": "adam", "lr": 1e-2}, seed=3,
                             **quiet(tmp_path, callbacks=callbacks, enable_checkpointing=False, **options))
    loader = loader if loader is not None else ArrayLoader(*linear_data(16 * 8, 0), batch_size=8, shuffle=True, seed=0)
    trainer.train_model(loader, None, num_epochs=epochs)
    return trainer


def _logged_steps(tmp_path):
    with open(tmp_path / "run" / "metrics.csv") as f:
        return [int(row["step"]) for row in csv.DictReader(f) if row.get("train/loss_step")]


def test_a_display_callback_hears_every_log_point_at_the_loops_next_stop(tmp_path):
    """No one acts on the values: the loop does not stop at the log points (16 steps per epoch,
    one every 4); the points reach on_log later, at its next stop (its end), in order, and the CSV
    has them all. A stop at each point has each heard at the next one, none later. (On a loaded
    machine the device may fall a log interval behind, which makes a stop: not every point waits.)"""
    display = Heard(may_lag=True)
    _train(tmp_path, [display])
    assert [step for step, _ in display.heard] == [4, 8, 12, 16, 20, 24, 28, 32]
    assert any(at > step + 4 for step, at in display.heard), display.heard
    assert _logged_steps(tmp_path) == [4, 8, 12, 16, 20, 24, 28, 32]


def test_a_callback_that_may_act_on_log_points_hears_each_one_log_point_late(tmp_path):
    """An on_log of yours (it may stop the run) keeps the loop's stop at every log point: it hears
    each point at the next one, in every run alike, and the values are those a display gets."""
    acting, display = Heard(may_lag=False), Heard(may_lag=True)
    _train(tmp_path / "acting", [acting])
    _train(tmp_path / "display", [display])
    assert acting.heard == [(4, 8), (8, 12), (12, 16), (16, 16), (20, 24), (24, 28), (28, 32), (32, 32)]
    assert acting.values == display.values  # the same interval means, whichever way they came


def test_nan_guard_keeps_a_stop_at_every_log_point_when_it_may_stop_the_run(tmp_path):
    """NaNGuard("stop") stops the run from on_log: its log points are not put off to the epoch's
    end. NaNGuard("skip") only reports at epoch ends: the loop need not stop for it."""
    display = Heard(may_lag=True)
    _train(tmp_path / "stop", [display, NaNGuard()], epochs=1)
    assert [at for _, at in display.heard] == [8, 12, 16, 16]
    display = Heard(may_lag=True)
    _train(tmp_path / "skip", [display, NaNGuard(action="skip")], epochs=1)
    assert any(at > step + 4 for step, at in display.heard), display.heard


def test_a_subclass_of_a_display_callback_that_acts_keeps_the_stops(tmp_path):
    """ThroughputMonitor may hear log points late; a subclass whose own on_log stops the run does not
    inherit that: it stops where a stop at each log point stops (heard at step 12, stopped there)."""

    class StopAfterPoint8(ThroughputMonitor):
        def on_log(self, trainer, step, metrics):
            super().on_log(trainer, step, metrics)
            if step == 8 and "train/loss_step" in metrics:
                trainer.stop("point 8 heard")

    trainer = _train(tmp_path, [StopAfterPoint8()], loader=ArrayLoader(*linear_data(64 * 8, 0), batch_size=8), epochs=1)
    assert trainer.global_step == 12


def test_an_error_logging_a_noted_point_is_raised_also_inside_an_except_block(tmp_path):
    """A display callback failing at a point: train_model raises, also when called while another
    exception is being handled (a retry loop); it was taken for the loop's own failure and dropped."""

    class Broken(Heard):
        def on_log(self, trainer, step, metrics):
            if step == 8 and "train/loss_step" in metrics:
                raise RuntimeError("display broke at step 8")

    with pytest.raises(RuntimeError, match="display broke at step 8"):
        _train(tmp_path / "plain", [Broken(may_lag=True)], epochs=1)
    try:
        raise KeyError("an earlier failure being handled")
    except KeyError:
        with pytest.raises(RuntimeError, match="display broke at step 8"):
            _train(tmp_path / "except", [Broken(may_lag=True)], epochs=1)


def test_noted_log_points_reach_the_loggers_during_a_long_epoch(tmp_path, monkeypatch):
    """An epoch longer than the delivery delay: its points are delivered while it runs (the loop
    stops for them once the delay has passed), not all at its end."""
    monkeypatch.setattr(flaxlight.loop.EventSchedule, "max_delay", 0.05)

    display = Heard(may_lag=True)
    _train(tmp_path, [display], loader=Batches(40, seconds=0.01), epochs=1)
    assert [step for step, _ in display.heard] == list(range(4, 41, 4))
    heard_at = [at for _, at in display.heard]
    assert heard_at == sorted(heard_at) and heard_at[0] < 40, heard_at  # some during the epoch


def test_log_points_noted_before_a_failure_are_logged(tmp_path):
    """A loader failing mid-epoch: the log points noted before it still reach metrics.csv."""

    with pytest.raises(OSError, match="disk went away"):
        _train(tmp_path, [], loader=Batches(16, fail_at=13, batch=8), epochs=1)
    assert _logged_steps(tmp_path)[:2] == [4, 8]


class BusyDevice(RegressTrainer):
    """Each train step keeps the device busy for a while: the host runs ahead of it."""

    def loss_fn(self, params, batch, *, train, rng, state):
        loss, aux = super().loss_fn(params, batch, train=train, rng=rng, state=state)
        if not train:
            return loss, aux
        start = jnp.full((256, 256), 1e-3, jnp.float32) + 1e-9 * jnp.sum(batch[0])
        busy = jnp.mean(jax.lax.fori_loop(0, 20, lambda _, a: jnp.tanh(a @ a), start))
        return loss + 1e-12 * jax.lax.stop_gradient(busy), aux


def test_throughput_of_noted_log_points_times_the_steps_they_are_logged_for(tmp_path):
    """Points noted without a stop keep the time the loop reached them: ThroughputMonitor's rates,
    delivered at the epoch's end, match the epochs' wall-clock rate."""

    class Rates(Callback):
        on_log_may_lag = True

        def __init__(self):
            self.rates = {}

        def on_log(self, trainer, step, metrics):
            if "perf/samples_per_sec" in metrics:
                self.rates[step] = metrics["perf/samples_per_sec"]

    seen = Rates()
    loader = ArrayLoader(*linear_data(256, 0), batch_size=8)  # 32 steps per epoch
    trainer = BusyDevice(model_class=TinyMLP, model_hparams={"hidden_dims": [8]}, exmp_input=X0,
                         optimizer_hparams={"optimizer": "adam", "lr": 1e-2},
                         **quiet(tmp_path, callbacks=[ThroughputMonitor(), seen], log_every_n_steps=4,
                                 enable_checkpointing=False))
    trainer.train_model(loader, None, num_epochs=4)
    wall_rate = 3 * 256 / sum(row["epoch_time"] for row in trainer.history[1:])  # epochs 2-4 (no compile)
    rates = {step: rate for step, rate in seen.rates.items() if step > 32}
    assert sorted(rates) == list(range(36, 129, 4)), sorted(rates)
    off = {step: round(rate / wall_rate, 2) for step, rate in rates.items() if not wall_rate / 3 < rate < 3 * wall_rate}
    assert len(off) <= 1, (wall_rate, off)  # one stall of a busy machine allowed


class CountingBar(ProgressBar):
    """The step bar, counting its moves (each is a stop of the training loop)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.moves = []

    def on_step(self, trainer, step):
        self.moves.append(step)
        super().on_step(trainer, step)


def test_the_step_bar_moves_about_ten_times_a_second_when_steps_come_fast(tmp_path, capsys):
    """refresh_every_n_steps=1 on a model whose steps take well under a millisecond: the bar does not
    stop the loop at every step (1024 stops), and still shows each epoch's full count."""
    bar = CountingBar(refresh_every_n_steps=1, style="bars")
    _train(tmp_path, [bar], loader=ArrayLoader(*linear_data(512 * 4, 0), batch_size=4), enable_progress_bar=True)
    assert len(bar.moves) < 100, len(bar.moves)
    assert "512/512" in capsys.readouterr().err


def test_the_step_bar_moves_at_every_step_when_steps_are_slow(tmp_path):
    bar = CountingBar(refresh_every_n_steps=1, style="bars")
    _train(tmp_path, [bar], loader=Batches(8, seconds=0.25), epochs=1, enable_progress_bar=True)
    assert bar.moves == list(range(1, 9))


def test_short_epochs_draw_the_step_bar_at_their_ends_not_also_at_their_starts(tmp_path, capsys):
    """Epochs of a few milliseconds: the step bar is drawn at each epoch's end (a validation may
    follow), not also at its start (a draw costs such an epoch ~1%); each epoch's full count shows."""
    start = time.perf_counter()
    _train(tmp_path, [ProgressBar(style="bars")], epochs=60, enable_progress_bar=True)
    seconds = time.perf_counter() - start
    err = capsys.readouterr().err
    draws = len(re.findall(r"Epoch \d+:", err))
    assert draws <= 60 + 2 * seconds / REFRESH_SECONDS + 5, (draws, seconds)  # drawing each start too: >= 120
    assert all(f"Epoch {epoch}: 100%" in err for epoch in range(1, 61))
    assert "16/16" in err
