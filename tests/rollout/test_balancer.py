"""Engine choice: least outstanding tokens, sticky prompt groups, unhealthy engines skipped."""

from __future__ import annotations

import pytest

from megarl.rollout.balancer import LoadBalancer, NoHealthyEngine


def test_new_groups_go_to_the_least_loaded_engine():
    lb = LoadBalancer(3)
    assert [lb.acquire(f"g{i}", cost) for i, cost in enumerate((100, 50, 10, 5))] == [0, 1, 2, 2]
    assert lb.outstanding == [100, 50, 15]
    lb.release(0, 100)
    assert lb.acquire("g9", 1) == 0


def test_a_prompt_group_sticks_to_its_engine():
    lb = LoadBalancer(2)
    first = lb.acquire("prompt-A", 1000)
    assert all(lb.acquire("prompt-A", 1000) == first for _ in range(3))  # n samples together
    assert lb.acquire("prompt-B", 1) != first
    assert lb.acquire(None, 1) != first  # no key: least loaded


def test_unhealthy_engines_are_skipped_and_sticky_groups_move():
    lb = LoadBalancer(2)
    assert lb.acquire("g", 1) == 0
    lb.set_healthy(0, False)
    assert lb.acquire("g", 1) == 1 and lb.acquire("h", 1) == 1
    lb.set_healthy(1, False)
    with pytest.raises(NoHealthyEngine):
        lb.acquire("g", 1)


def test_sticky_table_is_bounded():
    lb = LoadBalancer(2, sticky_capacity=2)
    for key in ("a", "b", "c"):
        lb.acquire(key, 0)
    assert list(lb._sticky) == ["b", "c"]
