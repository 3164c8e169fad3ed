"""Data-parallel and FSDP training on forced CPU devices, and two processes on localhost.

Device counts are fixed when JAX starts, so each run is a subprocess (tests/distributed_script.py).
"""

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).with_name("distributed_script.py")


def _run(*args, timeout=240):
    env = dict(os.environ, CI="true")
    env.pop("XLA_FLAGS", None)
    return subprocess.Popen([sys.executable, str(SCRIPT), *map(str, args)], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(process, timeout=240):
    out, err = process.communicate(timeout=timeout)
    assert process.returncode == 0, err[-3000:]
    return err


def _params(path):
    with np.load(path) as data:
        return float(data["loss"]), str(data["sharding"]), [data[k] for k in sorted(data.files) if k.startswith("p")]


@pytest.fixture(scope="module")
def single_device(tmp_path_factory):
    root = tmp_path_factory.mktemp("single")
    _finish(_run("none", root / "out.npz", root / "run"))
    return (*_params(root / "out.npz"), root / "out.npz")


def _assert_close(got, want):
    assert got[0] == pytest.approx(want[0], rel=1e-5)
    for a, b in zip(got[2], want[2], strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_fsdp_on_4_devices_matches_one_device_and_restores_on_1_and_2(single_device, tmp_path):
    _finish(_run("fsdp", tmp_path / "fsdp.npz", tmp_path / "fsdp", "--devices", 4))
    fsdp = _params(tmp_path / "fsdp.npz")
    assert "'data': 4" in fsdp[1] and "P(None, 'data')" in fsdp[1]  # the big kernel is split
    _assert_close(fsdp, single_device)

    on_one = _run("none", tmp_path / "r1.npz", tmp_path / "r1", "--restore-from", tmp_path / "fsdp")
    on_two = _run("data_parallel", tmp_path / "r2.npz", tmp_path / "r2", "--devices", 2,
                  "--restore-from", tmp_path / "fsdp")
    _finish(on_one), _finish(on_two)
    for restored in (_params(tmp_path / "r1.npz"), _params(tmp_path / "r2.npz")):
        assert restored[0] == pytest.approx(fsdp[0], rel=1e-6)
        for a, b in zip(restored[2], fsdp[2], strict=True):
            np.testing.assert_array_equal(a, b)


def test_two_processes_on_localhost_match_one_process(single_device, tmp_path):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    workers = [_run("data_parallel", tmp_path / "mp.npz", tmp_path / "mp", "--num-processes", 2,
                    "--process-id", i, "--port", port) for i in range(2)]
    for worker in workers:
        _finish(worker)
    _assert_close(_params(tmp_path / "mp.npz"), single_device)
    assert (tmp_path / "mp" / "metrics.csv").is_file()  # written by process 0 only
    with np.load(tmp_path / "mp.npz") as two, np.load(single_device[3]) as one:  # eval_model before train_model
        assert float(two["before"]) == pytest.approx(float(one["before"]), rel=1e-5)


def test_batch_that_does_not_split_over_the_devices(tmp_path):
    process = _run("data_parallel", tmp_path / "x.npz", tmp_path / "x", "--devices", 4, "--batch-size", 30)
    _, err = process.communicate(timeout=240)
    assert process.returncode != 0
    assert "A batch of 30 examples cannot be split over 4 devices" in err
    # found before the run's folder is claimed: the corrected run goes into the same folder
    assert not (tmp_path / "x" / "hparams.yaml").exists()


def test_an_epochs_smaller_last_batch_runs_whole_and_matches_one_device(tmp_path):
    """510 training examples in batches of 32 end on 30, 130 validation examples on 2: neither splits
    over 4 devices; those batches run on every device whole, and the run equals one device's."""
    one = _run("none", tmp_path / "one.npz", tmp_path / "one", "--uneven")
    four = _run("data_parallel", tmp_path / "four.npz", tmp_path / "four", "--devices", 4, "--uneven")
    _finish(one), _finish(four)
    _assert_close(_params(tmp_path / "four.npz"), _params(tmp_path / "one.npz"))


def test_unknown_distributed_mode(tmp_path):
    from conftest import RegressTrainer, TinyMLP, quiet

    with pytest.raises(ValueError, match="distributed must be one of"):
        RegressTrainer(model_class=TinyMLP, model_hparams={}, optimizer_hparams={},
                       exmp_input=np.zeros((1, 4), np.float32), **quiet(tmp_path, distributed="ddp"))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _classify_processes(tmp_path, *extra):
    script, port = Path(__file__).with_name("classify_processes_script.py"), _free_port()
    env = dict(os.environ, CI="true")
    env.pop("XLA_FLAGS", None)
    workers = [subprocess.Popen([sys.executable, str(script), str(i), "2", str(port), str(tmp_path / "run"), *extra],
                                env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in range(2)]
    return [worker.communicate(timeout=240) + (worker.returncode,) for worker in workers]


def test_the_classification_trainer_trains_on_two_processes(tmp_path):
    """Its first-batch label check read the whole batch, which spans both processes: it failed
    with JAX's 'Fetching value for jax.Array that spans non-addressable devices'."""
    for out, err, code in _classify_processes(tmp_path):
        assert code == 0, err[-3000:]
        assert float(out.split("accuracy")[-1]) > 0.8
    for out, err, code in _classify_processes(tmp_path / "bad", "--label-offset", "1"):  # labels 1 and 2 of 2 classes
        assert code != 0 and "labels must be in [0, 1]" in err, err[-3000:]
