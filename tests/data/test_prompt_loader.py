"""PromptLoader: deterministic shuffle by (seed, epoch), each row once per epoch, exact resume."""

from __future__ import annotations

import pytest

from megarl.data.dataset import DatasetError
from megarl.data.loader import PromptLoader

DATA = [{"index": i} for i in range(23)]


def ids(batch):
    return [item["index"] for item in batch]


def take(loader: PromptLoader, k: int) -> list[list[int]]:
    return [ids(loader.next_batch()) for _ in range(k)]


def test_same_seed_same_order_other_epoch_or_seed_other_order():
    a, b = PromptLoader(DATA, 5, seed=3), PromptLoader(DATA, 5, seed=3)
    assert a.epoch_order(0) == b.epoch_order(0)
    assert a.epoch_order(0) != a.epoch_order(1)
    assert a.epoch_order(0) != PromptLoader(DATA, 5, seed=4).epoch_order(0)
    assert take(a, 9) == take(b, 9)


def test_every_row_once_per_epoch():
    loader = PromptLoader(DATA, 5, seed=0, drop_last=False)
    assert len(loader) == 5
    for epoch in range(3):
        batches = list(loader)
        assert [len(b) for b in batches] == [5, 5, 5, 5, 3]
        assert sorted(i for b in batches for i in ids(b)) == list(range(23))
        assert loader.epoch == epoch
    dropped = PromptLoader(DATA, 5, seed=0)  # drop_last: 4 full batches, no repeats
    seen = [i for b in dropped for i in ids(b)]
    assert len(seen) == 20 == len(set(seen))
    assert seen == dropped.epoch_order(0)[:20]


def test_next_batch_crosses_epochs():
    loader = PromptLoader(DATA, 5, seed=1)
    got = take(loader, 6)
    order0, order1 = loader.epoch_order(0), loader.epoch_order(1)
    expected = [order0[i:i + 5] for i in range(0, 20, 5)] + [order1[0:5], order1[5:10]]
    assert got == expected and loader.epoch == 1


def test_no_shuffle_keeps_file_order():
    assert ids(PromptLoader(DATA, 4, shuffle=False).next_batch()) == [0, 1, 2, 3]


@pytest.mark.parametrize("k", [0, 2, 4, 7])
def test_resume_yields_the_batches_of_an_uninterrupted_run(k):
    reference = take(PromptLoader(DATA, 5, seed=7), k + 6)
    first = PromptLoader(DATA, 5, seed=7)
    assert take(first, k) == reference[:k]
    state = first.state_dict()
    resumed = PromptLoader(DATA, 5, seed=7)
    resumed.load_state_dict(dict(state))
    assert take(resumed, 6) == reference[k:]
    assert take(first, 6) == reference[k:]


def test_resume_rejects_other_data_or_seed():
    state = PromptLoader(DATA, 5, seed=7).state_dict()
    with pytest.raises(DatasetError, match="saved seed=7 but this run has seed=8"):
        PromptLoader(DATA, 5, seed=8).load_state_dict(state)
    with pytest.raises(DatasetError, match="saved num_prompts=23 .* num_prompts=22"):
        PromptLoader(DATA[:22], 5, seed=7).load_state_dict(state)


def test_batch_larger_than_dataset_is_rejected():
    with pytest.raises(DatasetError, match=r"train_batch_size=30 .*\(23 prompts"):
        PromptLoader(DATA, 30)
