"""Batches of prompts with a deterministic, resumable order.

The order of epoch ``e`` is a permutation drawn from ``(seed, e)`` alone, so it does not depend on
what ran before; the position is ``(epoch, offset)`` with ``offset`` the number of prompts of that
epoch already handed out. Saving the position and loading it into a new loader over the same
dataset yields exactly the batches an uninterrupted run would have yielded.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from megarl.data.dataset import DatasetError


class PromptLoader:
    """Yields lists of ``batch_size`` dataset items (shallow copies), shuffled by seed and epoch.

    ``next_batch()`` moves on to the next epoch by itself; iterating the loader yields the rest of
    the current epoch (or, when that is used up, the whole next epoch). With ``drop_last`` the
    prompts that do not fill a last batch are skipped for that epoch (they come back in other
    epochs at other positions).
    """

    def __init__(
        self,
        dataset: Sequence[dict[str, Any]],
        batch_size: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        drop_last: bool = True,
    ) -> None:
        if batch_size <= 0:
            raise DatasetError(f"data.train_batch_size must be > 0, got {batch_size}")
        if seed < 0:
            raise DatasetError(f"data.seed must be >= 0, got {seed}")
        if drop_last and batch_size > len(dataset):
            raise DatasetError(
                f"data.train_batch_size={batch_size} is larger than the dataset "
                f"({len(dataset)} prompts after filtering); lower data.train_batch_size to at "
                f"most {len(dataset)} or add data"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.offset = 0
        self._order_epoch = -1
        self._order: list[int] = []

    def epoch_order(self, epoch: int) -> list[int]:
        """Dataset indices in the order epoch ``epoch`` visits them (each index exactly once)."""
        n = len(self.dataset)
        if not self.shuffle:
            return list(range(n))
        return np.random.default_rng([self.seed, epoch]).permutation(n).tolist()

    def __len__(self) -> int:
        """Batches per epoch."""
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    def _prompts_per_epoch(self) -> int:
        return len(self) * self.batch_size if self.drop_last else len(self.dataset)

    def epoch_done(self) -> bool:
        """Whether the current epoch has no batch left."""
        return self.offset >= self._prompts_per_epoch()

    def next_batch(self) -> list[dict[str, Any]]:
        """The next batch; starts the next epoch when the current one is used up."""
        if self.epoch_done():
            self.epoch += 1
            self.offset = 0
        if self._order_epoch != self.epoch:
            self._order = self.epoch_order(self.epoch)
            self._order_epoch = self.epoch
        indices = self._order[self.offset:self.offset + self.batch_size]
        self.offset += len(indices)
        return [dict(self.dataset[i]) for i in indices]

    def __iter__(self) -> Iterator[list[dict[str, Any]]]:
        """The remaining batches of the current epoch, or all of the next one if it is done."""
        yield self.next_batch()
        while not self.epoch_done():
            yield self.next_batch()

    def state_dict(self) -> dict[str, int]:
        """The position (epoch, offset) plus what must match for a resume to be exact."""
        return {"epoch": self.epoch, "offset": self.offset, "seed": self.seed,
                "num_prompts": len(self.dataset)}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at a position saved by :meth:`state_dict` of a loader over the same data."""
        for key, mine in (("seed", self.seed), ("num_prompts", len(self.dataset))):
            if key in state and state[key] != mine:
                raise DatasetError(
                    f"cannot resume the data loader: saved {key}={state[key]} but this run has "
                    f"{key}={mine}; resume with the same data files, filters and data.seed"
                )
        epoch, offset = int(state["epoch"]), int(state["offset"])
        if epoch < 0 or not 0 <= offset <= len(self.dataset):
            raise DatasetError(
                f"cannot resume the data loader: position epoch={epoch} offset={offset} is out of "
                f"range for {len(self.dataset)} prompts"
            )
        self.epoch, self.offset = epoch, offset
