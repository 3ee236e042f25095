"""A request's logit edits are made once and a step's cost does not grow with the client's
lists (issue #38: three requests with long bad_words lists slowed every stream ~10x)."""

from __future__ import annotations

import time

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cadenza.actors.logit_edits import LogitEdits
from cadenza.actors.sampler import SamplingRow, apply_penalties_and_masks
from cadenza.sampling_params import SamplingParams

TOKENS = st.integers(0, 7)


def _walk(words: list[list[int]], outputs: list[int]) -> set[int]:
    """The rule, read off every word (what the sampler did each step before)."""
    n = len(outputs)
    return {w[-1] for w in words if len(w) == 1 or (n >= len(w) - 1 and outputs[n - len(w) + 1 :] == w[:-1])}


@settings(max_examples=200, deadline=None)
@given(words=st.lists(st.lists(TOKENS, min_size=1, max_size=4), max_size=12), outputs=st.lists(TOKENS, max_size=10))
def test_indexed_bad_words_ban_what_the_walk_bans(words: list[list[int]], outputs: list[int]) -> None:
    assert set(LogitEdits.of(SamplingParams(bad_words_token_ids=words)).banned(outputs)) == _walk(words, outputs)


def test_edits_apply_bias_bans_and_allowed_as_before() -> None:
    params = SamplingParams(logit_bias={1: 5.0, 3: -100.0}, allowed_token_ids=[1, 2, 3], bad_words_token_ids=[[4, 2]])
    row = SamplingRow(params, [0], [4], ())
    logits = apply_penalties_and_masks(torch.zeros(1, 6), [row])[0]
    assert logits.tolist() == [float("-inf"), 5.0, float("-inf"), -100.0, float("-inf"), float("-inf")]
    assert row.edits is not None  # built once for the row, kept for the next call


def _step_cost(num_words: int) -> float:
    words = [[i % 50_000 + 1, i // 50_000 + 1] for i in range(num_words)]  # two tokens each, all distinct
    row = SamplingRow(SamplingParams(bad_words_token_ids=words), [0], list(range(100)), ())
    row.logit_edits  # noqa: B018 (made on arrival in the runner, not per step)
    logits = torch.zeros(1, 1000)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        apply_penalties_and_masks(logits, [row])
        best = min(best, time.perf_counter() - start)
    return best


def test_a_step_does_not_walk_the_bad_word_list() -> None:
    """100,000 bad words cost a step no more than 100x one word (a walk over them: ~1000x)."""
    assert _step_cost(100_000) <= 100 * _step_cost(1) + 0.001
