"""How the embedded engine fills its KV pool: admission by expected lengths, retraction when the
pool runs short.

A row that may stop early (an EOS or a stop token it does not ignore) rarely runs to
``max_new_tokens``; reserving that much for every row would hold the pool at a fraction of what
the rows use. So, as SGLang's scheduler does (``new_token_ratio``), admission counts a row at its
prompt and drawn tokens plus :attr:`KVAdmission.ratio` of the tokens it may still draw. The ratio
starts at :data:`INIT_RATIO` and falls by an equal amount each decode step to :data:`MIN_RATIO`
over :data:`DECAY_STEPS` steps: the longer nothing runs short, the more the engine admits. A row
that cannot stop early (``ignore_eos`` and no stop tokens: e.g. forced lengths) is counted at
its final length: it will use all of it.

When a decode step's rows need more new pages than the pool has free, the rows with the fewest
drawn tokens (then the longest prompts) are retracted until it fits: their tokens stay, their
pages go back, and they wait at the head of the queue to be prefilled again with prompt + drawn
tokens (the same next-token distribution; the fused sampler's draws depend on the row's seed
and position only). The ratio then goes back to :data:`INIT_RATIO`.
"""

from __future__ import annotations

from typing import Protocol

INIT_RATIO = 0.7
MIN_RATIO = 0.1
DECAY_STEPS = 600


class _Row(Protocol):
    """What :class:`KVAdmission` reads of a running sample (engine.Sample)."""

    max_new_tokens: int
    stop_ids: frozenset[int]
    output_ids: list[int]

    @property
    def prompt_length(self) -> int: ...


def final_length(row: _Row) -> int:
    """Tokens a row holds when it ends: its prompt plus every token it may draw."""
    return row.prompt_length + row.max_new_tokens


class KVAdmission:
    """The expected-length ratio and the retraction count (module docstring)."""

    def __init__(self) -> None:
        self.ratio = INIT_RATIO
        self.retractions = 0
        """Rows retracted so far for want of pages."""

    def expected_length(self, row: _Row) -> int:
        """Tokens admission counts ``row`` at."""
        if not row.stop_ids:  # it runs to max_new_tokens
            return final_length(row)
        drawn = len(row.output_ids)
        rest = row.max_new_tokens - drawn
        return row.prompt_length + drawn + min(rest, int(rest * self.ratio + 0.999))

    def decoded(self) -> None:
        """One decode step ran."""
        self.ratio = max(MIN_RATIO, self.ratio - (INIT_RATIO - MIN_RATIO) / DECAY_STEPS)

    def to_retract(self, rows: list[_Row], held: list[int], wants: list[bool],
                   free: int) -> list[int]:
        """Rows to retract (indices, in retraction order) so that the pages ``wants`` asks for
        fit the ``free`` pages, each retracted row freeing the pages it ``held``; at least one
        row stays. Counts them and resets the ratio when there are any."""
        short = sum(wants) - free
        victims: list[int] = []
        order = sorted(range(len(rows)),
                       key=lambda i: (len(rows[i].output_ids), -rows[i].prompt_length))
        for i in order:
            if short <= 0 or len(victims) == len(rows) - 1:
                break
            victims.append(i)
            short -= held[i] + wants[i]
        if victims:
            self.retractions += len(victims)
            self.ratio = INIT_RATIO
        return victims
