"""Sampler filters, penalties and masks on hand-made logits."""

from __future__ import annotations

import torch

from cadenza.actors.sampler import SamplingRow, sample
from cadenza.sampling_params import SamplingParams


def row(outputs: list[int] | None = None, **kw) -> SamplingRow:  # noqa: ANN003
    return SamplingRow(SamplingParams(**kw), [0], outputs or [], (3,))


def draws(logits: torch.Tensor, r: SamplingRow, n: int = 400) -> set[int]:
    return {sample(logits[None], [r])[0][0] for _ in range(n)}


LOGITS = torch.tensor([4.0, 3.0, 2.0, 1.0, 0.0])


def test_greedy_and_top_k() -> None:
    assert sample(LOGITS[None], [row(temperature=0)])[0] == [0]
    assert draws(LOGITS, row(temperature=1.0, top_k=2)) == {0, 1}


def test_top_p_keeps_smallest_nucleus() -> None:
    probs = torch.softmax(LOGITS, -1)  # [0.64, 0.24, 0.09, ...]
    assert float(probs[0]) < 0.7 < float(probs[:2].sum())
    assert draws(LOGITS, row(temperature=1.0, top_p=0.7)) == {0, 1}


def test_min_p() -> None:
    assert draws(LOGITS, row(temperature=1.0, min_p=0.3)) == {0, 1}


def test_min_tokens_masks_stop_ids() -> None:
    logits = torch.tensor([0.0, 0.0, 0.0, 10.0, 0.0])
    assert sample(logits[None], [row(temperature=0, min_tokens=2, max_tokens=5)])[0] == [0]
    assert sample(logits[None], [row([1, 1], temperature=0, min_tokens=2, max_tokens=5)])[0] == [3]


def test_penalties() -> None:
    logits = torch.tensor([2.0, 1.9, 0.0, 0.0, 0.0])
    assert sample(logits[None], [row([0], temperature=0, frequency_penalty=0.5)])[0] == [1]
    assert sample(logits[None], [row([0], temperature=0, presence_penalty=0.5)])[0] == [1]
    assert sample(logits[None], [row([], temperature=0, repetition_penalty=2.0)])[0] == [1]  # prompt has 0


def test_seeded_rows_are_batch_independent() -> None:
    logits = torch.randn(6, 50)
    rows = [row(temperature=1.0, seed=i) for i in range(6)]
    batch, _ = sample(logits, rows)
    alone = [sample(logits[i : i + 1], [rows[i]])[0][0] for i in range(6)]
    assert batch == alone


def test_distribution_matches_softmax() -> None:
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5])
    rows = [row(temperature=0.8) for _ in range(4000)]
    tokens, _ = sample(logits.expand(4000, -1).clone(), rows)
    freq = torch.bincount(torch.tensor(tokens), minlength=4).float() / 4000
    assert torch.allclose(freq, torch.softmax(logits / 0.8, -1), atol=0.03)


def test_logprobs_rank_and_top() -> None:
    _, lps = sample(LOGITS[None], [row(temperature=0, logprobs=2)])
    lp = lps[0]
    assert lp.token_ids == [0, 0, 1] and lp.rank == 1
    assert abs(lp.logprobs[0] - float(torch.log_softmax(LOGITS, -1)[0])) < 1e-6


def test_bad_words_ban_the_token_that_would_complete_them() -> None:
    logits = torch.zeros(1, 10)
    logits[0, 5], logits[0, 8] = 3.0, 2.0  # 5 is best, 8 second
    words = [[5], [7, 8]]
    params = SamplingParams(temperature=0, bad_words_token_ids=words)
    after_7 = SamplingRow(params, [1], [3, 7], ())
    assert sample(logits, [after_7])[0] == [0]  # 5 always banned; 8 banned after 7
    after_3 = SamplingRow(params, [1], [7, 3], ())
    assert sample(logits, [after_3])[0] == [8]


def test_grammar_mask_bans_all_but_its_tokens() -> None:
    logits = torch.arange(12, dtype=torch.float32)[None, :]
    mask = torch.zeros(10, dtype=torch.bool)  # shorter than the padded vocabulary: the tail is banned
    mask[[2, 4]] = True
    row = SamplingRow(SamplingParams(temperature=0), [1], [], (), mask)
    assert sample(logits, [row])[0] == [4]
    seeded = SamplingRow(SamplingParams(temperature=1.0, seed=1), [1], [], (), mask)
    assert all(sample(logits, [seeded])[0][0] in (2, 4) for _ in range(20))


def test_batched_logprobs_equal_each_row_on_its_own() -> None:
    """One top-k at the largest k asked, sliced per row, gives each row's own top-k."""
    from cadenza.actors.sampler import token_logprobs

    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(3))
    asked = [0, None, 3, 5]
    rows = [row(temperature=0, logprobs=k) for k in asked]
    tokens, logprobs = sample(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert tokens == logits.argmax(dim=-1).tolist()
    for i, k in enumerate(asked):
        assert logprobs[i] == (None if k is None else token_logprobs(raw[i], tokens[i], k))


def _dense_penalties(logits: torch.Tensor, r: SamplingRow) -> torch.Tensor:
    """The penalties as whole-vocabulary passes, one row at a time: the reference."""
    p, out = r.params, logits.clone()
    counts = torch.bincount(torch.tensor(r.output_ids, dtype=torch.long), minlength=out.shape[0]).to(out.dtype)
    if p.repetition_penalty != 1.0:
        seen = counts > 0
        seen[torch.tensor(r.prompt_ids, dtype=torch.long)] = True
        penalised = torch.where(out > 0, out / p.repetition_penalty, out * p.repetition_penalty)
        out = torch.where(seen, penalised, out)
    return out - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).to(out.dtype)


def test_batched_penalties_equal_each_row_penalised_alone() -> None:
    """Mixed rows (penalised or not, empty outputs, repeats, negative logits) in one batch."""
    from cadenza.actors.sampler import apply_penalties_and_masks

    gen = torch.Generator().manual_seed(0)
    vocab, rows = 97, []
    for i in range(12):
        ids = lambda n: torch.randint(0, vocab, (n,), generator=gen).tolist()  # noqa: E731
        kinds = [{}, {"repetition_penalty": 1.3}, {"frequency_penalty": 0.4, "presence_penalty": -0.2},
                 {"repetition_penalty": 0.8, "frequency_penalty": 0.1, "presence_penalty": 0.3}]  # fmt: skip
        outputs = ids(i * 3)  # none on row 0
        outputs += outputs[:2] * (i % 2)  # repeated ids on odd rows
        rows.append(SamplingRow(SamplingParams(**kinds[i % 4]), ids(1 + i), outputs, (3,)))
    logits = torch.randn(len(rows), vocab, generator=gen) * 3
    got = apply_penalties_and_masks(logits, rows)
    for i, r in enumerate(rows):
        torch.testing.assert_close(got[i], _dense_penalties(logits[i], r), rtol=0, atol=1e-6)
