"""Loaders that are not flaxlight's: plain iterables, torch's DataLoader, grain's datasets and loader.

Each test trains a small MLP through ``train_model`` and checks what a user sees: the loss or the
accuracy, validation, the number of epochs and steps, progress output, resuming. torch and grain
are dev dependencies (never imported by flaxlight itself: see the last tests).
"""

from __future__ import annotations

import csv
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import warnings

import grain
import jax
import numpy as np
import pytest
import torch.utils.data
from conftest import ClassifyTrainer, CrashAfterEpoch, RegressTrainer, SigtermAt, TinyMLP, linear_data, quiet
from sklearn.datasets import load_digits

import flaxlight

BATCH, VAL_BATCH = 100, 99  # digits: 15 train and 3 validation batches of one shape each (few compiles)


def _digits():
    """sklearn's 8x8 digits: 1500 examples to train on, 297 to validate (int64 labels, as loaded)."""
    x, y = load_digits(return_X_y=True)
    x = (x / 16.0).astype(np.float32)
    return x[:1500], y[:1500], x[1500:], y[1500:]


def _classifier(tmp_path, name="run", **kwargs):
    kwargs.setdefault("enable_progress_bar", False)
    kwargs.setdefault("enable_checkpointing", False)
    return ClassifyTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [64], "output_dim": 10},
                           optimizer_hparams={"optimizer": "adam", "lr": 3e-2},
                           exmp_input=np.zeros((1, 64), np.float32),
                           logger_params={"log_dir": str(tmp_path / name), "logger_type": "csv"},
                           enable_model_summary=False, **kwargs)


def _regressor(tmp_path, name="run", **kwargs):
    kwargs.setdefault("enable_progress_bar", False)
    kwargs.setdefault("enable_checkpointing", False)
    kwargs.setdefault("optimizer_hparams", {"optimizer": "adam", "lr": 1e-2})
    return RegressTrainer(model_class=TinyMLP, model_hparams={"hidden_dims": [16]}, exmp_input=np.zeros((1, 4), np.float32),
                          logger_params={"log_dir": str(tmp_path / name), "logger_type": "csv"},
                          enable_model_summary=False, **kwargs)


def _rows(log_dir):
    """metrics.csv as dicts of the non-empty cells (epoch_time dropped: it differs between runs)."""
    with open(log_dir / "metrics.csv") as f:
        return [{k: v for k, v in row.items() if v != "" and k != "epoch_time"} for row in csv.DictReader(f)]


def _epoch_rows(log_dir, metric):
    """(step, epoch, value) of the rows that hold ``metric`` (e.g. the epoch's train/loss)."""
    return [(int(r["step"]), int(r["epoch"]), float(r[metric])) for r in _rows(log_dir) if metric in r]


# ---------------------------------------------------------------------------------- plain iterables
def test_a_list_of_batches_trains_and_validates(tmp_path):
    train = list(flaxlight.ArrayLoader(*linear_data(300, 0), batch_size=32, shuffle=True))  # 10 batches, last of 12
    val = [linear_data(64, 1)]  # one batch
    trainer = _regressor(tmp_path)
    metrics = trainer.train_model(train, val, num_epochs=3)
    assert trainer.global_step == int(trainer.state.step) == 30
    losses = _epoch_rows(tmp_path / "run", "train/loss")
    assert [(step, epoch) for step, epoch, _ in losses] == [(10, 1), (20, 2), (30, 3)]
    assert losses[-1][2] < 0.5 * losses[0][2]
    assert [epoch for _, epoch, _ in _epoch_rows(tmp_path / "run", "val/loss")] == [1, 2, 3]
    assert metrics["val/loss"] < 0.5 * losses[0][2]


class Batches:
    """Re-iterable, no ``len()``: every ``iter()`` starts a new generator over the same data."""

    def __init__(self, x, y, batch_size):
        self.x, self.y, self.batch_size = x, y, batch_size

    def __iter__(self):
        for start in range(0, len(self.x), self.batch_size):
            yield self.x[start:start + self.batch_size], self.y[start:start + self.batch_size]


def test_a_loader_without_len_trains_with_steps_per_epoch_and_progress_bars(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("CI", "")  # real tqdm bars (the suite sets CI=true for plain lines)
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # as on a terminal
    train, val = Batches(*linear_data(256, 0), batch_size=32), Batches(*linear_data(64, 1), batch_size=64)
    trainer = _regressor(tmp_path, enable_progress_bar=True, log_every_n_steps=4)
    with pytest.raises(TypeError, match="steps_per_epoch"):  # the schedule needs the run's length
        trainer.train_model(train, val, num_epochs=2)
    trainer.train_model(train, val, num_epochs=2, steps_per_epoch=8)
    assert trainer.global_step == 16
    assert [(s, e) for s, e, _ in _epoch_rows(tmp_path / "run", "train/loss")] == [(8, 1), (16, 2)]
    assert [int(r["step"]) for r in _rows(tmp_path / "run") if "train/loss_step" in r] == [4, 8, 12, 16]
    assert [e for _, e, _ in _epoch_rows(tmp_path / "run", "val/loss")] == [1, 2]
    err = capsys.readouterr().err
    assert "Epoch 1:" in err and "Epoch 2:" in err and "| 0/8 [" in err  # step bars sized by steps_per_epoch
    assert "Epochs: 100%" in err and "2/2" in err


def test_a_generator_is_consumed_across_epochs_with_prefetch_and_fused_steps(tmp_path):
    """A single-use iterator (a stream) is not restarted: each epoch takes the next steps_per_epoch
    batches, also when a thread prefetches them and steps_per_execution fuses them."""
    x, y = linear_data(32 * 100, 0)
    drawn = []

    def stream():
        for i in range(100):
            drawn.append(i)
            yield x[32 * i:32 * (i + 1)], y[32 * i:32 * (i + 1)]

    trainer = _regressor(tmp_path, prefetch=2, steps_per_execution=4, log_every_n_steps=4)
    trainer.train_model(stream(), [linear_data(64, 1)], num_epochs=3, steps_per_epoch=10)
    assert drawn == list(range(30))  # 3 epochs of 10 batches, none read ahead or skipped
    assert trainer.global_step == 30
    losses = _epoch_rows(tmp_path / "run", "train/loss")
    assert [(s, e) for s, e, _ in losses] == [(10, 1), (20, 2), (30, 3)]
    assert losses[-1][2] < 0.5 * losses[0][2]



class _OneSharedStream:
    """A loader whose ``iter()`` hands out one generator, made once: a stream, as the generator."""

    def __init__(self, stream):
        self.stream = stream

    def __iter__(self):
        return self.stream


def _stream_run(tmp_path, name, drawn, resume=False, callbacks=(), shared=False, **options):
    """3 epochs of 6 batches from one deterministic stream of 18 (``drawn``: the batches it yields)."""
    x, y = linear_data(32 * 18, 0)

    def stream():
        for i in range(18):
            drawn.append(i)
            yield x[32 * i:32 * (i + 1)], y[32 * i:32 * (i + 1)]

    trainer = _regressor(tmp_path, name, enable_checkpointing=True, callbacks=list(callbacks), **options)
    train = _OneSharedStream(stream()) if shared else stream()
    trainer.train_model(train, [linear_data(64, 1)], num_epochs=3, steps_per_epoch=6, resume=resume)
    return trainer


@pytest.mark.parametrize("interrupt, options", [("sigterm", {}), ("sigterm", {"prefetch": 2}), ("crash", {}),
                                                ("sigterm", {"shared": True})],
                         ids=["sigterm-mid-epoch-2", "sigterm-with-prefetch", "crash-after-epoch-1", "shared-stream"])
def test_a_resumed_stream_goes_on_after_every_batch_the_run_trained_on(tmp_path, interrupt, options):
    """A generator is not restarted between epochs, so its place is the run's batch count, not the
    epoch's: a resumed run passes over all the batches trained on (earlier epochs included) and
    ends bitwise equal to the uninterrupted run, each stream batch trained on once."""
    reference = _stream_run(tmp_path, "ref", [], **options)
    if interrupt == "sigterm":
        with pytest.raises(SystemExit):
            _stream_run(tmp_path, "run", [], callbacks=[SigtermAt(9)], **options)  # epoch 2, after its batch 3
        trained = 9
    else:
        with pytest.raises(RuntimeError, match="crash"):
            _stream_run(tmp_path, "run", [], callbacks=[CrashAfterEpoch(1)], **options)
        trained = 6
    drawn = []
    with pytest.warns(RuntimeWarning, match=f"a stream .* passes over its first {trained} batches"):
        resumed = _stream_run(tmp_path, "run", drawn, resume=True, **options)
    assert drawn == list(range(18)) and resumed.global_step == 18
    jax.tree.map(np.testing.assert_array_equal, resumed.state.params, reference.state.params)


class _EpochIterator:
    """A loader whose ``set_epoch(epoch)`` builds that epoch's shuffled iterator and whose ``__iter__``
    hands it out (``iter(l) is iter(l)``)."""

    def __init__(self, x, y):
        self.x, self.y, self.iterator = x, y, None

    def set_epoch(self, epoch):
        order = np.random.default_rng(epoch).permutation(len(self.x))
        self.iterator = iter([(self.x[order[i:i + 16]], self.y[order[i:i + 16]]) for i in range(0, len(self.x), 16)])

    def __len__(self):
        return 6

    def __iter__(self):
        return self.iterator


class _SamplerWithSetEpoch:
    """A sampler whose ``set_epoch`` builds ``loader``'s epoch iterator."""

    def __init__(self, loader):
        self.loader = loader

    def set_epoch(self, epoch):
        self.loader.set_epoch(epoch)


class _SamplerEpochIterator:
    """The same loader, told the epoch through its ``sampler`` (as a torch DistributedSampler is)."""

    def __init__(self, x, y):
        self.sampler = _SamplerWithSetEpoch(_EpochIterator(x, y))

    def __len__(self):
        return 6

    def __iter__(self):
        return self.sampler.loader.iterator


@pytest.mark.parametrize("loader_class", [_EpochIterator, _SamplerEpochIterator], ids=["own", "sampler"])
def test_a_loader_whose_set_epoch_builds_the_epochs_iterator_resumes_bitwise_equal(tmp_path, loader_class):
    """``set_epoch`` restarts such a loader at each epoch, so a resume mid epoch 2 passes over only
    that epoch's batches, not the earlier epochs' too: all 18 steps, the same parameters."""
    x, y = linear_data(96, 0)

    def run(name, resume=False, callbacks=()):
        trainer = _regressor(tmp_path, name, enable_checkpointing=True, callbacks=list(callbacks))
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # "ran out after 3 of the epoch's 6 batches" before
            trainer.train_model(loader_class(x, y), [linear_data(32, 1)], num_epochs=3, resume=resume)
        return trainer

    reference = run("ref")
    with pytest.raises(SystemExit):
        run("run", callbacks=[SigtermAt(9)])  # epoch 2, after its batch 3
    resumed = run("run", resume=True)
    assert resumed.global_step == reference.global_step == 18
    jax.tree.map(np.testing.assert_array_equal, resumed.state.params, reference.state.params)


class _SharedStream:
    """A loader whose ``__iter__`` hands out one generator, made once: it runs dry after one pass."""

    def __init__(self, batches):
        self.stream = (batch for batch in batches)

    def __len__(self):
        return 2

    def __iter__(self):
        return self.stream


def test_a_loader_handing_out_one_shared_iterator_is_explained_when_it_runs_dry(tmp_path):
    x, y = linear_data(64, 0)
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)]
    shared = r"yielded no batches this time, though it yielded some at an earlier pass: its __iter__ hands out one " \
             r"shared iterator .* return a new generator each time"
    with pytest.raises(ValueError, match=r"The evaluation loader \(val/\) " + shared):
        _small_regressor(tmp_path, x).train_model(batches, _SharedStream(batches[:2]), num_epochs=2)
    trainer = _small_regressor(tmp_path, x, logger_params={"log_dir": str(tmp_path / "train")})
    with pytest.raises(ValueError, match="train_loader " + shared):
        trainer.train_model(_SharedStream(batches[:2]), None, num_epochs=2)
    assert trainer.global_step == 2  # the first epoch trained
    with pytest.raises(ValueError, match="check the dataset size"):  # never yielded a batch: empty
        _small_regressor(tmp_path, x, logger_params={"log_dir": str(tmp_path / "empty")}).eval_model(_SharedStream([]))


# ---------------------------------------------------------------------------------- torch
class PairDataset(torch.utils.data.Dataset):
    """Items (x[i], y[i]) as numpy arrays: a map-style torch Dataset, also a grain data source."""

    def __init__(self, x, y):
        self.x, self.y = x, y

    def __len__(self):
        return len(self.x)

    def __getitem__(self, i):
        return self.x[i], self.y[i]


def numpy_collate(samples):
    """[(x, y), ...] -> (xs, ys) as numpy arrays (torch's default collate makes torch tensors)."""
    return tuple(np.stack(field) for field in zip(*samples))


def test_torch_dataloader_with_numpy_collate(tmp_path, capsys):
    x, y, vx, vy = _digits()
    train = torch.utils.data.DataLoader(PairDataset(x, y), batch_size=BATCH, shuffle=True, collate_fn=numpy_collate,
                                        generator=torch.Generator().manual_seed(0))
    val = torch.utils.data.DataLoader(PairDataset(vx, vy), batch_size=VAL_BATCH, collate_fn=numpy_collate)
    assert len(train) == 15
    trainer = _classifier(tmp_path, enable_checkpointing=True)
    metrics = trainer.train_model(train, val, num_epochs=3)
    assert trainer.global_step == 45
    assert [(s, e) for s, e, _ in _epoch_rows(tmp_path / "run", "train/loss")] == [(15, 1), (30, 2), (45, 3)]
    assert metrics["val/acc"] > 0.8
    # A resume continues from the last checkpoint; torch's shuffling has no set_epoch, so it warns.
    resumed = _classifier(tmp_path, enable_checkpointing=True)
    with pytest.warns(RuntimeWarning, match="set_epoch"):
        resumed.train_model(train, val, num_epochs=4, resume=True)
    assert "Resumed from checkpoint 45" in capsys.readouterr().err
    assert resumed.global_step == 60
    assert [e for _, e, _ in _epoch_rows(tmp_path / "run", "train/loss")] == [1, 2, 3, 4]


def test_torch_distributed_sampler_is_told_the_epoch(tmp_path):
    x, y, vx, vy = _digits()
    dataset = PairDataset(x, y)
    sampler = torch.utils.data.distributed.DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=True, seed=0)
    train = torch.utils.data.DataLoader(dataset, batch_size=BATCH, sampler=sampler, collate_fn=numpy_collate)
    _classifier(tmp_path).train_model(train, None, num_epochs=2)
    assert sampler.epoch == 2  # a new order every epoch, a pure function of (seed, epoch): resumable




class SeenDataset(PairDataset):
    """A PairDataset that records the indices it is asked for, in order: the data order."""

    def __init__(self, x, y):
        super().__init__(x, y)
        self.seen = []

    def __getitem__(self, i):
        self.seen.append(int(i))
        return super().__getitem__(i)


def _seeded_torch_loader(dataset):
    """The UvA guide's train loader: shuffled, drop_last, its own seeded generator."""
    return torch.utils.data.DataLoader(dataset, batch_size=16, shuffle=True, drop_last=True,
                                       collate_fn=numpy_collate, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("options", [{}, {"prefetch": 2}, {"steps_per_execution": 4}],
                         ids=["plain", "prefetch", "blocks"])
def test_a_seeded_shuffled_torch_loader_gives_a_plain_loops_order_every_epoch(tmp_path, options):
    """torch's RandomSampler draws its generator for the next order when a pass ends; flaxlight took
    len() batches and never ended the pass, so from epoch 2 on its orders were not a for loop's."""
    x, y = linear_data(100, 0)
    plain = SeenDataset(x, y)
    loop = _seeded_torch_loader(plain)
    for _ in range(3):
        for _ in loop:
            pass
    dataset = SeenDataset(x, y)
    _regressor(tmp_path, **options).train_model(_seeded_torch_loader(dataset), None, num_epochs=3)
    assert len(plain.seen) == 3 * 96 and dataset.seen == plain.seen  # 6 batches of 16 an epoch, the same orders


class CountingLoader:
    """``length`` batches by ``len()``; its generator yields ``extra`` more and counts the batches
    drawn and the passes run to their end (a ``for`` loop's ``StopIteration``)."""

    def __init__(self, length=6, extra=0):
        self.length, self.extra, self.drawn, self.ended = length, extra, 0, 0
        self.x, self.y = linear_data(16 * (length + extra), 0)

    def __len__(self):
        return self.length

    def __iter__(self):
        for i in range(self.length + self.extra):
            self.drawn += 1
            yield self.x[16 * i:16 * (i + 1)], self.y[16 * i:16 * (i + 1)]
        self.ended += 1


@pytest.mark.parametrize("options, drawn, ended", [
    ({}, 18, 3), ({"prefetch": 2}, 18, 3), ({"steps_per_execution": 4}, 18, 3),
    ({"max_steps": 12}, 12, 2), ({"max_steps": 12, "prefetch": 2}, 12, 2),  # ends at epoch 2's last batch
    ({"max_steps": 9}, 9, 1), ({"limit_train_batches": 4}, 12, 0), ({"limit_train_batches": 4, "prefetch": 2}, 12, 0),
], ids=["plain", "prefetch", "blocks", "max-steps-at-an-end", "max-steps-at-an-end-prefetch", "max-steps-cut",
        "limit", "limit-prefetch"])
def test_an_epoch_ends_its_loaders_pass_and_a_cut_draws_nothing_more(tmp_path, options, drawn, ended):
    loader = CountingLoader()
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        trainer = _regressor(tmp_path, **options)
        trainer.train_model(loader, None, num_epochs=3)
    assert (loader.drawn, loader.ended) == (drawn, ended)
    assert trainer.global_step == min(drawn, 3 * options.get("limit_train_batches", 6))


@pytest.mark.parametrize("options", [{}, {"prefetch": 2}], ids=["plain", "prefetch"])
def test_a_batch_beyond_len_is_not_trained_on_and_said(tmp_path, options):
    loader = CountingLoader(length=4, extra=1)
    trainer = _regressor(tmp_path, **options)
    with pytest.warns(RuntimeWarning, match=r"train_loader yielded more batches in one pass than its len\(\) \(4\) "
                                            r"says: an epoch trains 4 batches.*is not trained on \(batch 5 was drawn.*"
                                            r"Said once") as said:
        trainer.train_model(loader, None, num_epochs=2)
    assert trainer.global_step == 8 and loader.drawn == 10  # 4 trained, the 5th drawn to end each pass
    assert len([w for w in said if "more batches in one pass" in str(w.message)]) == 1  # not once per epoch


class ShortQueueLoader:
    """A loader whose len() says more than it yields, and whose iterator must not be asked again once
    it ended (a queue fed by a thread blocks there: training hung)."""

    def __init__(self):
        self.x, self.y = linear_data(48, 0)

    def __len__(self):
        return 5  # it yields 3

    def __iter__(self):
        return self._Iterator(self)

    class _Iterator:
        def __init__(self, loader):
            self.loader, self.i, self.ended = loader, 0, False

        def __iter__(self):
            return self

        def __next__(self):
            assert not self.ended, "asked for a batch after the pass ended (a blocking queue hangs here)"
            if self.i == 3:
                self.ended = True
                raise StopIteration
            self.i += 1
            return self.loader.x[16 * (self.i - 1):16 * self.i], self.loader.y[16 * (self.i - 1):16 * self.i]


@pytest.mark.parametrize("options", [{}, {"prefetch": 2}], ids=["plain", "prefetch"])
def test_a_loader_that_ends_before_its_len_is_not_asked_again(tmp_path, options):
    """The pass's end was drawn with one more next() even when the epoch ran out first: a loader
    whose len() says more than it yields and whose iterator blocks then hung the run (a review)."""
    trainer = _regressor(tmp_path, **options)
    trainer.train_model(ShortQueueLoader(), None, num_epochs=2)
    assert trainer.global_step == 6


class SharedIteratorWithLen:
    """A stream (``iter()`` hands out one shared iterator) whose ``len()`` is an epoch's batches."""

    def __init__(self, batches):
        self.iterator, self.length, self.drawn = self._draw(batches), 2, []

    def _draw(self, batches):
        for i, batch in enumerate(batches):
            self.drawn.append(i)
            yield batch

    def __len__(self):
        return self.length

    def __iter__(self):
        return self.iterator


def test_a_streams_batch_drawn_at_an_epochs_end_starts_the_next_epoch(tmp_path):
    """Ending epoch 1's pass draws the stream's third batch: the stream is not restarted, so it is
    epoch 2's first, not lost (a lost one would leave epoch 2 a batch short, which warns)."""
    x, y = linear_data(64, 0)
    loader = SharedIteratorWithLen([(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)])
    trainer = _regressor(tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        trainer.train_model(loader, None, num_epochs=2)
    assert trainer.global_step == 4 and loader.drawn == [0, 1, 2, 3]

class EpochBatchSampler(torch.utils.data.Sampler):
    """Batches of indices in an order drawn from the epoch it is told (bucketing samplers work so)."""

    def __init__(self, n, size):
        self.n, self.size, self.epochs = n, size, []

    def set_epoch(self, epoch):
        self.epochs.append(epoch)

    def __len__(self):
        return math.ceil(self.n / self.size)

    def __iter__(self):
        order = np.random.default_rng(self.epochs[-1] if self.epochs else 0).permutation(self.n)
        return iter([order[i:i + self.size].tolist() for i in range(0, self.n, self.size)])


def test_torch_batch_sampler_is_told_the_epoch_once_per_epoch(tmp_path):
    """As Lightning does: set_epoch reaches a DataLoader's batch_sampler (and its sampler, and the
    batch sampler's sampler), each object once."""
    x, y, _, _ = _digits()
    batch_sampler = EpochBatchSampler(len(x), BATCH)
    train = torch.utils.data.DataLoader(PairDataset(x, y), batch_sampler=batch_sampler, collate_fn=numpy_collate)
    firsts = []

    class FirstBatch(flaxlight.Callback):
        def on_train_epoch_start(self, trainer, epoch):
            firsts.append(next(iter(trainer.train_loader))[1][:8].tolist())

    _classifier(tmp_path, callbacks=[FirstBatch()]).train_model(train, None, num_epochs=3)
    assert batch_sampler.epochs == [1, 2, 3]
    assert len({tuple(first) for first in firsts}) == 3  # a new order every epoch


# ---------------------------------------------------------------------------------- grain
def test_grain_map_dataset(tmp_path):
    x, y, vx, vy = _digits()
    train = grain.MapDataset.source([(x[i], y[i]) for i in range(len(x))]).shuffle(seed=0).batch(BATCH)
    val = grain.MapDataset.source([(vx[i], vy[i]) for i in range(len(vx))]).batch(VAL_BATCH)
    assert len(train) == 15
    # A MapDataset is re-iterable and replays the same order: every epoch sees the same batches.
    assert [b[1].tolist() for b in train] == [b[1].tolist() for b in train]
    trainer = _classifier(tmp_path)
    metrics = trainer.train_model(train, val, num_epochs=3)
    assert trainer.global_step == 45
    assert [(s, e) for s, e, _ in _epoch_rows(tmp_path / "run", "train/loss")] == [(15, 1), (30, 2), (45, 3)]
    assert [e for _, e, _ in _epoch_rows(tmp_path / "run", "val/acc")] == [1, 2, 3]
    assert metrics["val/acc"] > 0.8


class GrainEpochs:
    """A grain pipeline reshuffled every epoch, its order a pure function of (seed, epoch).

    ``shuffle(...).repeat()`` reshuffles each pass over the source; epoch k (the trainer counts
    from 1) is the k-th pass, sliced out and batched. ``set_epoch`` makes a resume exact.
    """

    def __init__(self, records, batch_size, seed):
        self.passes = grain.MapDataset.source(records).shuffle(seed=seed).repeat()
        self.num_records, self.batch_size, self.epoch = len(records), batch_size, 1

    def set_epoch(self, epoch):
        self.epoch = epoch

    def __len__(self):
        return math.ceil(self.num_records / self.batch_size)

    def __iter__(self):
        start = (self.epoch - 1) * self.num_records
        return iter(self.passes[start:start + self.num_records].batch(self.batch_size))


def test_grain_pipeline_with_set_epoch_reshuffles_and_resumes_exactly(tmp_path, capsys):
    x, y = linear_data(256, 0)
    records = [(x[i], y[i]) for i in range(len(x))]
    loader = GrainEpochs(records, batch_size=32, seed=0)  # 8 batches
    first = [b[1][:, 0].tolist() for b in loader]
    loader.set_epoch(2)
    assert [b[1][:, 0].tolist() for b in loader] != first  # another order...
    assert sorted(sum(first, [])) == sorted(y[:, 0].tolist())  # ...of the same 256 records

    class Crash(flaxlight.Callback):
        every_n_steps = 20  # mid-epoch 3

        def on_step(self, trainer, step):
            raise RuntimeError("crash")

    def run(name, callbacks=(), resume=False):
        trainer = _regressor(tmp_path, name, callbacks=list(callbacks), log_every_n_steps=5)
        trainer.train_model(GrainEpochs(records, batch_size=32, seed=0), None, num_epochs=4, resume=resume)
        return trainer

    reference = run("reference")
    with pytest.raises(RuntimeError, match="crash"):
        run("crashed", callbacks=[flaxlight.ModelCheckpoint(every_n_steps=19, every_n_epochs=None), Crash()])
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "no set_epoch" warning
        resumed = run("crashed", callbacks=[flaxlight.ModelCheckpoint(every_n_steps=19, every_n_epochs=None)],
                      resume=True)  # the same checkpoint callback: its state is taken, not warned about
    assert "Resumed from checkpoint 19" in capsys.readouterr().err  # mid-epoch 3 (8 steps per epoch)
    assert resumed.global_step == reference.global_step == 32
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.state.params),
                 jax.device_get(reference.state.params))
    assert _rows(tmp_path / "crashed") == _rows(tmp_path / "reference")


def test_grain_dataloader_without_len(tmp_path):
    def loader(num, seed, batch_size, shuffle):
        x, y = linear_data(num, seed)
        sampler = grain.samplers.IndexSampler(num, shard_options=grain.sharding.NoSharding(), shuffle=shuffle,
                                              num_epochs=1, seed=0)
        return grain.DataLoader(data_source=PairDataset(x, y), sampler=sampler,
                                operations=[grain.transforms.Batch(batch_size)], worker_count=0)

    train, val = loader(256, 0, 32, shuffle=True), loader(64, 1, 64, shuffle=False)  # 8 batches
    assert not hasattr(train, "__len__")
    assert [b[1].tolist() for b in train] == [b[1].tolist() for b in train]  # every iter() replays the order
    trainer = _regressor(tmp_path, log_every_n_steps=4)
    metrics = trainer.train_model(train, val, num_epochs=3, steps_per_epoch=8)
    assert trainer.global_step == 24
    losses = _epoch_rows(tmp_path / "run", "train/loss")
    assert [(s, e) for s, e, _ in losses] == [(8, 1), (16, 2), (24, 3)]
    assert losses[-1][2] < 0.5 * losses[0][2]
    assert [e for _, e, _ in _epoch_rows(tmp_path / "run", "val/loss")] == [1, 2, 3]
    assert metrics["val/loss"] < 0.5 * losses[0][2]


def test_grain_dataloader_resumes_from_its_saved_position_without_rereading(tmp_path, capsys):
    x, y = linear_data(256, 0)
    reads = []

    class CountingSource(PairDataset):
        def __repr__(self):  # grain checks a saved position against repr(data_source)
            return "CountingSource(linear_data(256, 0))"

        def __getitem__(self, i):
            reads.append(int(i))
            return super().__getitem__(i)

    def loader():  # shuffled, no set_epoch: the iterator's own state says where it is
        sampler = grain.samplers.IndexSampler(256, shard_options=grain.sharding.NoSharding(), shuffle=True,
                                              num_epochs=1, seed=3)
        return grain.DataLoader(data_source=CountingSource(x, y), sampler=sampler,
                                operations=[grain.transforms.Batch(32)], worker_count=0)

    class Crash(flaxlight.Callback):
        every_n_steps = 14  # mid-epoch 2 (8 steps per epoch), one step after checkpoint 13

        def on_step(self, trainer, step):
            raise RuntimeError("crash")

    def run(name, callbacks=(), resume=False):
        trainer = _regressor(tmp_path, name, callbacks=list(callbacks), log_every_n_steps=4)
        trainer.train_model(loader(), None, num_epochs=3, steps_per_epoch=8, resume=resume)
        return trainer

    reference = run("reference")
    with pytest.raises(RuntimeError, match="crash"):
        run("crashed", callbacks=[flaxlight.ModelCheckpoint(every_n_steps=13, every_n_epochs=None), Crash()])
    reads.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the loader's position is saved: no "no set_epoch" warning
        resumed = run("crashed", callbacks=[flaxlight.ModelCheckpoint(every_n_steps=13, every_n_epochs=None)],
                      resume=True)  # the same checkpoint callback: its state is taken, not warned about
    assert "Resumed from checkpoint 13 " in capsys.readouterr().err
    assert len(reads) == 256 - 5 * 32 + 256  # the rest of epoch 2 and epoch 3: no record read twice
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(resumed.state.params),
                 jax.device_get(reference.state.params))
    assert _rows(tmp_path / "crashed") == _rows(tmp_path / "reference")


# ---------------------------------------------------------------------------------- no torch, no grain
_NO_IMPORT_SCRIPT = textwrap.dedent("""
    import json, sys, tempfile
    import jax.numpy as jnp, numpy as np, flax.linen as nn
    import flaxlight

    def loaded():
        return sorted({m.split(".")[0] for m in sys.modules} & {"torch", "grain"})

    seen = {"import": loaded()}

    class Net(nn.Module):
        @nn.compact
        def __call__(self, x, train=False):
            return nn.Dense(1)(x)

    class Regressor(flaxlight.TrainerModule):
        def loss_fn(self, params, batch, *, train, rng, state):
            x, y = batch
            pred, updates = state.apply_model(params, x, train=train, rng=rng)
            return jnp.mean((pred - y) ** 2), ({}, updates)

    x = np.random.default_rng(0).normal(size=(64, 4)).astype(np.float32)
    loader = flaxlight.ArrayLoader(x, x.sum(1, keepdims=True), batch_size=16, shuffle=True)
    for loggers in (["csv"], None):  # None: the default loggers (CSV and, when installed, TensorBoard)
        trainer = Regressor(model_class=Net, model_hparams={}, optimizer_hparams={"lr": 1e-2}, exmp_input=x[:1],
                            enable_model_summary=False, enable_checkpointing=False, enable_progress_bar=False,
                            logger_params={"log_dir": tempfile.mkdtemp(), "logger_type": loggers})
        trainer.train_model(loader, loader, num_epochs=2)
        seen["default loggers" if loggers is None else "csv"] = loaded()
    print(json.dumps(seen))
""")


@pytest.fixture(scope="module")
def modules_loaded_by_flaxlight():
    """Which of torch and grain a fresh process holds after importing flaxlight and training."""
    result = subprocess.run([sys.executable, "-c", _NO_IMPORT_SCRIPT], capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, CI="true"))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_flaxlight_never_imports_torch_or_grain(modules_loaded_by_flaxlight):
    assert modules_loaded_by_flaxlight["import"] == []
    assert modules_loaded_by_flaxlight["csv"] == []  # trained with an ArrayLoader, metrics.csv logging


def test_default_loggers_do_not_import_torch(modules_loaded_by_flaxlight):
    assert modules_loaded_by_flaxlight["default loggers"] == []


def test_a_loader_shorter_than_steps_per_epoch_warns(tmp_path):
    batches = [(np.ones((4, 4), np.float32), np.ones((4, 1), np.float32))] * 3

    class ThreeBatches:  # no len(): the run is sized by steps_per_epoch
        def __iter__(self):
            return iter(batches)

    trainer = RegressTrainer(model_class=TinyMLP, model_hparams={}, optimizer_hparams={},
                             exmp_input=batches[0][0][:1], **quiet(tmp_path))
    with pytest.warns(RuntimeWarning, match="ran out after 3 of the epoch's 5 batches"):
        trainer.train_model(ThreeBatches(), None, num_epochs=1, steps_per_epoch=5)
    assert int(trainer.state.step) == 3


def _small_regressor(tmp_path, x, **kwargs):
    return RegressTrainer(model_class=TinyMLP, model_hparams={}, optimizer_hparams={"lr": 1e-2},
                          exmp_input=x[:1], **quiet(tmp_path, **kwargs))


def test_an_endless_stream_without_len_trains_to_max_steps(tmp_path):
    x, y = linear_data(64, 0)

    def endless():
        while True:
            yield x[:16], y[:16]

    trainer = _small_regressor(tmp_path, x, max_steps=12)
    trainer.train_model(endless(), None)
    assert trainer.global_step == 12


def test_generators_that_run_dry_are_explained(tmp_path):
    x, y = linear_data(64, 0)
    batches = [(x[i:i + 16], y[i:i + 16]) for i in range(0, 64, 16)]
    with pytest.raises(ValueError, match="val_loader is an iterator .* runs dry after the first validation"):
        _small_regressor(tmp_path, x).train_model(batches, (b for b in batches), num_epochs=2)
    trainer = _small_regressor(tmp_path, x)
    with pytest.raises(ValueError, match=r"train_loader yielded no batches: it is an iterator .*a list, an ArrayLoader"):
        trainer.train_model((b for b in batches), None, num_epochs=2, steps_per_epoch=4)
    assert trainer.global_step == 4  # the first epoch trained


# ---------------------------------------------------------------------------------- no len(): what sizes the run


class _Records(torch.utils.data.IterableDataset):
    """A torch ``IterableDataset`` (no ``len()``): ``passes`` of the same 5 batches of 16, or endless."""

    def __init__(self, batches, endless=False):
        self.batches, self.endless = batches, endless

    def __iter__(self):
        while True:
            yield from self.batches
            if not self.endless:
                return


def _five_batches():
    x, y = linear_data(80, 0)
    return [(x[i:i + 16], y[i:i + 16]) for i in range(0, 80, 16)]


def _torch_stream(batches, endless=False):
    """The usual big-data loader: a torch DataLoader over an IterableDataset, batches as they come."""
    return torch.utils.data.DataLoader(_Records(batches, endless), batch_size=None, collate_fn=lambda batch: batch)


def _trained(tmp_path, name, loader, num_epochs=500, callbacks=(), resume=False, **options):
    trainer = _regressor(tmp_path, name, callbacks=list(callbacks), **options)
    trainer.train_model(loader, None, num_epochs=num_epochs, resume=resume)
    return trainer


@pytest.mark.parametrize("optimizer", [{}, {"accumulate_grad_batches": 2, "schedule": "constant"}],
                         ids=["warmup_cosine", "accumulating"])
def test_max_steps_sizes_a_torch_iterable_dataset_as_lightning_does(tmp_path, optimizer):
    """A DataLoader over an IterableDataset with max_steps was refused ("has no len()"), where a
    generator with max_steps was taken: its epochs end where its passes end (5, 5, then 2 batches),
    and the run and its schedule (warmup_cosine: sized by the run's length) equal a sized loader's.
    Accumulating gradients, each pass's end ends an update, as an epoch's end does: no update mixes
    two epochs."""
    batches = _five_batches()
    hparams = {"optimizer": "adam", "lr": 1e-2, **optimizer}
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # no "ran out after 5 of the epoch's 12 batches"
        streamed = _trained(tmp_path, "stream", _torch_stream(batches), max_steps=12, optimizer_hparams=hparams)
    sized = _trained(tmp_path, "sized", batches, max_steps=12, optimizer_hparams=hparams)
    assert streamed.global_step == sized.global_step == 12
    assert [row["epoch"] for row in streamed.history] == [1, 2, 3]
    jax.tree.map(np.testing.assert_array_equal, streamed.state.params, sized.state.params)


def test_an_int_limit_train_batches_is_the_epoch_length_of_a_loader_without_len(tmp_path):
    """limit_train_batches=N is "batches per epoch" (Lightning takes it for an IterableDataset): an
    endless torch stream and a generator train N per epoch, as a list of those N batches does."""
    batches = _five_batches()
    sized = _trained(tmp_path, "sized", batches[:3], num_epochs=2)
    endless = _trained(tmp_path, "endless", _torch_stream(batches, endless=True), num_epochs=2, limit_train_batches=3)
    stream = _trained(tmp_path, "generator", (b for b in batches[:3] * 2), num_epochs=2, limit_train_batches=3)
    assert endless.global_step == stream.global_step == sized.global_step == 6
    for trainer in (endless, stream):
        jax.tree.map(np.testing.assert_array_equal, trainer.state.params, sized.state.params)


def test_a_loader_without_len_and_nothing_that_sizes_the_run_names_every_way_out(tmp_path):
    with pytest.raises(TypeError, match=r"train_loader has no len\(\).*steps_per_epoch=N.*max_steps=N.*"
                                        r"limit_train_batches=N \(batches per epoch\)"):
        _trained(tmp_path, "run", _torch_stream(_five_batches()), num_epochs=2)
    with pytest.raises(TypeError, match=r"limit_train_batches=0.5 is a fraction, but train_loader has no len\(\)"):
        _trained(tmp_path, "run", _torch_stream(_five_batches()), max_steps=12, limit_train_batches=0.5)


@pytest.mark.parametrize("step, optimizer", [(7, {}), (5, {"accumulate_grad_batches": 2, "schedule": "constant"})],
                         ids=["mid-pass-2", "at-pass-1s-end-accumulating"])
def test_a_loader_without_len_sized_by_max_steps_resumes_bitwise_equal(tmp_path, step, optimizer):
    """SIGTERM in the second pass (epoch 2, after its batch 2), or after the first pass's last batch
    (before its end is known: its partial group of gradients is applied on resume): the resumed run
    passes over that epoch's trained batches and ends as the uninterrupted one."""
    batches = _five_batches()
    options = {"max_steps": 12, "enable_checkpointing": True,
               "optimizer_hparams": {"optimizer": "adam", "lr": 1e-2, **optimizer}}
    reference = _trained(tmp_path, "ref", _torch_stream(batches), **options)
    with pytest.raises(SystemExit):
        _trained(tmp_path, "run", _torch_stream(batches), callbacks=[SigtermAt(step)], **options)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # a loader without set_epoch: resumed exactly if its order holds
        resumed = _trained(tmp_path, "run", _torch_stream(batches), resume=True, **options)
    assert resumed.global_step == reference.global_step == 12
    jax.tree.map(np.testing.assert_array_equal, resumed.state.params, reference.state.params)


def test_a_last_epoch_that_ends_before_max_steps_warns(tmp_path):
    with pytest.warns(RuntimeWarning, match=r"ran out after 5 batches in the run's last epoch \(num_epochs=1\): the "
                                            r"run ends at step 5, before max_steps=12"):
        trainer = _trained(tmp_path, "run", _torch_stream(_five_batches()), num_epochs=1, max_steps=12)
    assert trainer.global_step == 5


def test_an_empty_generator_is_told_apart_from_one_that_ran_dry(tmp_path):
    """A generator whose filter dropped every example got "it runs dry after one pass: give a re-iterable"."""
    batches = _five_batches()

    def filtered():
        yield from (b for b in batches if b[1].min() > 100)  # a filter that drops everything

    with pytest.raises(ValueError, match=r"has yielded none since the trainer got it, not even at its first pass\. "
                                         r"Its data are empty \(a filter that drops every example\?"):
        _trained(tmp_path, "empty", filtered(), num_epochs=1, max_steps=5)
    trainer = _regressor(tmp_path, "dry")
    with pytest.raises(ValueError, match=r"an iterator \(a generator\?\) that ran dry: it yielded batches at an "
                                         r"earlier pass.*a list, an ArrayLoader"):
        trainer.train_model(iter(batches), None, num_epochs=2, steps_per_epoch=5)  # iter(list): no weak reference
    assert trainer.global_step == 5


def test_a_stream_with_max_steps_takes_limit_train_batches_1_0_as_no_limit(tmp_path):
    """1.0 (Lightning's "all") was refused as a fraction of a loader without len() (review)."""
    trainer = _trained(tmp_path, "run", _torch_stream(_five_batches()), num_epochs=3, max_steps=6,
                       limit_train_batches=1.0)
    assert trainer.global_step == 6


def test_a_sized_loader_shorter_than_steps_per_epoch_is_warned_of_also_when_max_steps_ends_the_epoch(tmp_path):
    """The 'ran out' warning was skipped for a sized loader when max_steps fell inside the epoch (review)."""
    with pytest.warns(RuntimeWarning, match=r"ran out after 5 of the epoch's 10 batches"):
        _regressor(tmp_path, max_steps=10).train_model(_five_batches(), None, num_epochs=3, steps_per_epoch=10)
