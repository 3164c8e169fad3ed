import numpy as np
import pytest

from flaxlight import ArrayLoader
from flaxlight.data import check_batch


def test_order_is_a_pure_function_of_seed_and_epoch():
    x = np.arange(100)
    a, b = ArrayLoader(x, batch_size=10, shuffle=True, seed=3), ArrayLoader(x, batch_size=10, shuffle=True, seed=3)
    a.set_epoch(2)
    b.set_epoch(5)
    list(b)  # iterating another epoch first changes nothing
    b.set_epoch(2)
    assert [batch.tolist() for batch in a] == [batch.tolist() for batch in b]
    a.set_epoch(3)
    assert a.order().tolist() != b.order().tolist()
    assert sorted(a.order().tolist()) == list(range(100))


def test_lengths_partial_last_batch_and_drop_last():
    x, y = np.zeros((10, 3)), np.arange(10)
    loader = ArrayLoader(x, y, batch_size=4)
    assert len(loader) == 3
    assert [b[0].shape for b in loader] == [(4, 3), (4, 3), (2, 3)]
    assert [b[1].tolist() for b in loader][-1] == [8, 9]
    dropped = ArrayLoader(x, y, batch_size=4, drop_last=True)
    assert len(dropped) == 2 and len(list(dropped)) == 2


def test_dict_data_yields_dicts():
    loader = ArrayLoader({"image": np.zeros((5, 2)), "label": np.arange(5)}, batch_size=2)
    first = next(iter(loader))
    assert set(first) == {"image", "label"} and first["label"].tolist() == [0, 1]


def test_mismatched_lengths_fail_with_shapes():
    with pytest.raises(ValueError, match=r"leading dimension.*\(5, 2\).*\(4,\)"):
        ArrayLoader(np.zeros((5, 2)), np.zeros(4), batch_size=2)


def test_check_batch_names_the_bad_leaf():
    with pytest.raises(TypeError, match=r"\[1\].*str"):
        check_batch((np.zeros((2, 3)), "labels"))
    with pytest.raises(TypeError, match="list"):
        check_batch([[1, 2], [3, 4]])
