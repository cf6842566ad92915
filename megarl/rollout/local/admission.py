"""How the embedded engine fills its KV pool: admission by expected lengths, retraction when the
pool runs short.

A row that may stop early (an EOS or a stop token it does not ignore) rarely runs to
``max_new_tokens``; reserving that much for every row would hold the pool at a fraction of what
the rows use. So, as SGLang's scheduler does (``new_token_ratio``, its defaults in sglang
0.5.10's ``srt/environ.py``), admission counts a row at its prompt and drawn tokens plus
:attr:`KVAdmission.ratio` of the tokens it may still draw (at most :data:`CLIP_REST` of them).
The ratio starts at :data:`INIT_RATIO` and falls by an equal amount each decode step to
:data:`MIN_RATIO` over :data:`DECAY_STEPS` steps: the longer nothing runs short, the more the
engine admits. Unlike SGLang, a row that cannot stop early (``ignore_eos`` and no stop tokens:
e.g. forced lengths) is counted at its final length: it will use all of it.

When a decode step's rows need more new pages than the pool has free, the rows with the fewest
drawn tokens (then the longest prompts) are retracted until it fits, as SGLang's
``retract_decode`` picks them: their tokens stay, their pages go back, and they wait at the head
of the queue to be prefilled again with prompt + drawn tokens (the same next-token distribution;
the fused sampler's draws depend on the row's seed and position only). The ratio then becomes
what the rows left running have drawn, plus :data:`RETRACT_STEPS` tokens each, over what they
may draw (at most 1).
"""

from __future__ import annotations

import math
from typing import Protocol

INIT_RATIO = 0.7
MIN_RATIO = INIT_RATIO * 0.14
DECAY_STEPS = 600
RETRACT_STEPS = 20
CLIP_REST = 4096


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
        rest = min(row.max_new_tokens - drawn, CLIP_REST)
        return row.prompt_length + drawn + min(rest, math.ceil(rest * self.ratio))

    def held(self, rows: list[_Row], page: int) -> tuple[int, int]:
        """(the longest final length, the KV token slots at expected lengths in pages of
        ``page`` tokens; 0 without pages) of ``rows``, in one pass (admission counts every
        running row each step it admits)."""
        longest = slots = 0
        for row in rows:
            longest = max(longest, final_length(row))
            if page:
                slots += -(-self.expected_length(row) // page) * page
        return longest, slots

    def decoded(self) -> None:
        """One decode step ran."""
        self.ratio = max(MIN_RATIO, self.ratio - (INIT_RATIO - MIN_RATIO) / DECAY_STEPS)

    def to_retract(self, rows: list[_Row], held: list[int], wants: list[bool],
                   free: int) -> list[int]:
        """Rows to retract (indices, in retraction order) so that the pages ``wants`` asks for
        fit the ``free`` pages, each retracted row freeing the pages it ``held``; at least one
        row stays. Counts them and sets the ratio from the rows that stay (module docstring)."""
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
            out = set(victims)
            stay = [row for i, row in enumerate(rows) if i not in out]
            drawn = sum(len(row.output_ids) + RETRACT_STEPS for row in stay)
            self.ratio = min(1.0, drawn / (sum(row.max_new_tokens for row in stay) + 1))
        return victims
