"""The multi-turn workload of ``bench store-ssd``: round robin, with quick follow-ups."""

from __future__ import annotations

import itertools

from ascend_offload.bench.store_ssd import multi_turn_prompts


def test_without_follow_ups_each_conversation_returns_after_all_others() -> None:
    prompts = multi_turn_prompts(3, 3, seed=1)
    assert [c for c, _ in prompts] == [0, 1, 2] * 3
    for c in range(3):
        mine = [p for cc, p in prompts if cc == c]
        assert all(b[:len(a)] == a and len(b) > len(a) for a, b in itertools.pairwise(mine))


def test_a_follow_up_comes_at_once_and_continues_its_conversation() -> None:
    prompts = multi_turn_prompts(4, 4, quick=0.5, seed=1)
    quick = [i for i in range(1, len(prompts)) if prompts[i][0] == prompts[i - 1][0]]
    assert quick, "no follow-up at share 0.5"
    assert all(i >= 4 for i in quick)  # never after a conversation's first turn
    for i in quick:
        prev, cur = prompts[i - 1][1], prompts[i][1]
        assert cur[:len(prev)] == prev and len(cur) > len(prev)
    assert len(prompts) == 16 + len(quick)
    assert multi_turn_prompts(4, 4, quick=1.0, seed=1).count(prompts[0]) == 1
    assert len(multi_turn_prompts(4, 4, quick=1.0, seed=1)) == 16 + 12
