"""The top-k candidate sampler against the whole-vocabulary chain (its reference): the same
kept tokens, the same draws for seeded rows, the filtered distribution for the others."""

import pytest
import torch

from engine.sampling_params import SamplingParams
from engine.worker.candidate_plan import MAX_CANDIDATE_TOP_K, TIE_SLACK
from engine.worker.logits_processing import apply_min_p, apply_top_k_top_p
from engine.worker.sampler import sample_on_device
from engine.worker.sampling_batch import build_sampling_batch
from engine.worker.sampling_candidates import filter_candidates

EOS = 1


def make_batch(params, vocab, device="cpu", num_output_tokens=None, seeded=True):
    """A fresh generator for each seeded row, so two batches built alike draw alike."""
    gens = [
        torch.Generator(device).manual_seed(0) if seeded and p.seed is not None else None
        for p in params
    ]
    n = len(params)
    return build_sampling_batch(
        params, [[2]] * n, [[]] * n, gens, EOS, vocab, device, num_output_tokens
    )


def reference_kept(logits, batch):
    """[B, V] bool: what the whole-vocabulary chain's filters keep."""
    scaled = logits / batch.temperature
    scaled = apply_top_k_top_p(scaled, batch.top_k, batch.top_p)
    if batch.min_p is not None:
        scaled = apply_min_p(scaled, batch.min_p)
    return torch.isfinite(scaled)


def candidate_kept(logits, batch):
    scores, ids = filter_candidates(logits, batch)
    kept = torch.zeros(logits.shape, dtype=torch.bool)
    return kept.scatter_(1, ids, torch.isfinite(scores))


def random_params(gen, rows, seed=None):
    pick = lambda options: options[int(torch.randint(len(options), (1,), generator=gen))]  # noqa: E731
    return [
        SamplingParams(
            temperature=pick([0.5, 0.8, 1.0, 1.7]),
            top_k=pick([1, 2, 5, 20, 50]),
            top_p=pick([1.0, 0.95, 0.9, 0.5, 0.2]),
            min_p=pick([0.0, 0.0, 0.05, 0.3]),
            seed=None if seed is None else seed + i,
        )
        for i in range(rows)
    ]


def test_candidates_keep_the_tokens_the_whole_vocabulary_chain_keeps():
    gen = torch.Generator().manual_seed(0)
    vocab = 600
    params = random_params(gen, 64)
    logits = torch.randn(64, vocab, generator=gen) * 3
    batch = make_batch(params, vocab)
    assert torch.equal(candidate_kept(logits, batch), reference_kept(logits, batch))


def test_ties_with_the_kth_logit_are_kept_as_the_reference_keeps_them():
    # bfloat16 logits tie often; top-k and min-p cut by value, so the sets must agree
    # whatever order the tied values come in.
    gen = torch.Generator().manual_seed(1)
    vocab = 600
    params = [
        SamplingParams(temperature=t, top_k=k, min_p=m)
        for t, k, m in [(1.0, 5, 0.0), (0.7, 20, 0.05), (1.3, 50, 0.0), (1.0, 3, 0.0)]
    ]
    logits = (torch.randn(4, vocab, generator=gen) * 2).bfloat16().float()
    logits[3, 10:20] = 9.0  # ten tokens tied at the 3rd value: all ten kept
    logits[3, :10] = -5.0
    batch = make_batch(params, vocab)
    kept = candidate_kept(logits, batch)
    assert torch.equal(kept, reference_kept(logits, batch))
    assert kept[3].sum() == 10


def test_ties_past_the_slack_keep_a_subset_of_the_tied_tokens():
    # The documented limit: more tokens tied with the k-th value than the extra candidates.
    vocab = 600
    logits = torch.full((1, vocab), -3.0)
    logits[0, 0] = 5.0
    logits[0, 100 : 100 + 2 * TIE_SLACK] = 1.0
    batch = make_batch([SamplingParams(top_k=2)], vocab)
    kept, reference = candidate_kept(logits, batch), reference_kept(logits, batch)
    assert reference.sum() == 1 + 2 * TIE_SLACK
    assert kept[0, 0] and bool((kept <= reference).all()) and kept.sum() == 2 + TIE_SLACK


def test_seeded_rows_draw_the_reference_tokens_in_every_row_group():
    gen = torch.Generator().manual_seed(2)
    vocab, rows = 1000, 48
    params = random_params(gen, rows, seed=100)
    # Rows that take the whole-vocabulary chain beside the candidates, and greedy rows.
    params[3] = SamplingParams(top_p=0.9, seed=7)
    params[4] = SamplingParams(temperature=0.8, min_p=0.1, seed=8)
    params[5] = SamplingParams(top_k=MAX_CANDIDATE_TOP_K + 1, seed=9)
    params[6] = SamplingParams(temperature=0)
    params[7] = SamplingParams(temperature=0, top_k=3)
    for step in range(3):
        logits = torch.randn(rows, vocab, generator=gen) * 2
        num_out = [step] * rows
        new, _ = sample_on_device(logits, make_batch(params, vocab, num_output_tokens=num_out))
        ref, _ = sample_on_device(
            logits, make_batch(params, vocab, num_output_tokens=num_out), top_k_candidates=False
        )
        assert new.tolist() == ref.tolist(), step
        assert new[6] == logits[6].argmax() and new[7] == logits[7].argmax()


def test_a_seeded_top_k_row_does_not_depend_on_its_neighbours_candidates():
    # The neighbours change how many candidates the step fetches and split it in groups.
    gen = torch.Generator().manual_seed(10)
    vocab = 2000
    mine = SamplingParams(temperature=0.9, top_k=5, top_p=0.9, seed=77)
    neighbours = [
        [],
        [SamplingParams(top_k=900)],
        [SamplingParams(top_p=0.5), SamplingParams(temperature=0)],
        [SamplingParams(top_k=MAX_CANDIDATE_TOP_K, seed=3), SamplingParams(min_p=0.2)],
    ]
    for step in range(4):
        row = torch.randn(1, vocab, generator=gen) * 2
        tokens = set()
        for others in neighbours:
            params = [*others, mine]
            logits = torch.cat([torch.randn(len(others), vocab), row])
            batch = make_batch(params, vocab, num_output_tokens=[step] * len(params))
            tokens.add(int(sample_on_device(logits, batch)[0][-1]))
        assert len(tokens) == 1, (step, tokens)


def test_a_step_with_only_top_k_rows_takes_no_whole_vocabulary_pass():
    params = [SamplingParams(top_k=5), SamplingParams(temperature=0), SamplingParams(top_k=40)]
    batch = make_batch(params, 100)
    plan = batch.candidates
    assert plan.max_top_k == 40 and plan.whole_rows == [] and plan.row_groups is None
    mixed = make_batch(params + [SamplingParams(min_p=0.1), SamplingParams(top_k=5000)], 8000)
    plan = mixed.candidates
    assert plan.whole_rows == [3, 4] and plan.whole_filters == {"top_k", "min_p"}
    assert [t.tolist() for t in plan.row_groups] == [[0, 1, 2], [3, 4]]
    assert make_batch([SamplingParams(top_p=0.5)], 100).candidates is None
    assert make_batch([SamplingParams(top_k=3)], 2).candidates.max_top_k == 2


def chi_square_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    chi2 = ((counts - expected) ** 2 / expected).sum()
    df = torch.tensor(len(counts) - 1, dtype=torch.float64)
    return float(torch.special.gammaincc(df / 2, chi2 / 2))


def test_unseeded_draws_follow_the_filtered_distribution():
    vocab, draws = 24, 30000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(3)) * 1.5
    params = SamplingParams(temperature=0.7, top_k=9, top_p=0.9, min_p=0.02)
    batch = make_batch([params] * draws, vocab)
    reference = reference_kept(logits, make_batch([params], vocab))[0]
    probs = torch.softmax(logits[0] / 0.7, 0) * reference
    probs /= probs.sum()
    torch.manual_seed(4)
    tokens, _ = sample_on_device(logits.expand(draws, vocab), batch)
    counts = torch.bincount(tokens, minlength=vocab).double()
    assert bool((counts[~reference] == 0).all())
    support = reference.nonzero().flatten()
    assert len(support) >= 4  # the filters leave a distribution worth testing
    # Fixed seed; p < 1e-6 would fail a correct sampler one run in a million.
    p_value = chi_square_p_value(counts[support], draws * probs[support].double())
    assert p_value > 1e-6, (p_value, counts[support], draws * probs[support])


def test_logprobs_are_the_references():
    gen = torch.Generator().manual_seed(5)
    vocab = 500
    params = random_params(gen, 6, seed=1)
    params[0] = SamplingParams(top_k=10, logprobs=4, seed=3)
    params[1] = SamplingParams(temperature=0, logprobs=2)
    params[2] = SamplingParams(top_p=0.8, logprobs=0, seed=4)
    logits = torch.randn(6, vocab, generator=gen)
    new_ids, new = sample_on_device(logits, make_batch(params, vocab))
    ref_ids, ref = sample_on_device(logits, make_batch(params, vocab), top_k_candidates=False)
    assert torch.equal(new_ids, ref_ids)
    for got, want in zip(new.tensors(), ref.tensors(), strict=True):
        assert torch.equal(got, want)
    assert torch.allclose(new.sampled, logits.log_softmax(-1).gather(1, new_ids[:, None])[:, 0])


def test_a_realistic_vocabulary():
    vocab = 128256
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(3, vocab, generator=gen) * 3
    params = [
        SamplingParams(temperature=0.8, top_k=50, top_p=0.95, seed=11),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.6, top_k=20, min_p=0.05, seed=12),
    ]
    batch = make_batch(params, vocab)
    random_rows = [0, 2]  # a greedy row's filters mean nothing: its draw is replaced
    kept = candidate_kept(logits, batch)[random_rows]
    assert torch.equal(kept, reference_kept(logits, batch)[random_rows])
    new, _ = sample_on_device(logits, make_batch(params, vocab))
    ref, _ = sample_on_device(logits, make_batch(params, vocab), top_k_candidates=False)
    assert new.tolist() == ref.tolist() and new[1] == logits[1].argmax()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_seeded_rows_draw_the_reference_tokens_at_a_real_batch_size():
    gen = torch.Generator().manual_seed(7)
    vocab, rows = 151936, 256
    params = random_params(gen, rows, seed=1000)
    params[::5] = [SamplingParams(top_p=0.9, seed=i) for i in range(len(params[::5]))]
    params[1::7] = [SamplingParams(temperature=0)] * len(params[1::7])
    # Distinct float32 logits: equal probabilities at a top-p boundary may be cut in another
    # order by the reference's sort (see sampling_candidates.py).
    logits = (torch.randn(rows, vocab, generator=gen) * 3).cuda()
    new, _ = sample_on_device(logits, make_batch(params, vocab, "cuda"))
    ref, _ = sample_on_device(logits, make_batch(params, vocab, "cuda"), top_k_candidates=False)
    assert new.tolist() == ref.tolist()
    batch = make_batch(params, vocab, "cuda")
    part = batch.candidates.candidate_rows(rows)
    sub = batch.select_rows(batch.candidates.row_groups[0], part)
    scores, ids = filter_candidates(logits[part], sub)
    kept = torch.zeros(len(part), vocab, dtype=torch.bool, device="cuda")
    kept.scatter_(1, ids, torch.isfinite(scores))
    random_part = [j for j, i in enumerate(part) if params[i].temperature > 0]
    assert torch.equal(kept[random_part], reference_kept(logits[part], sub)[random_part])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_unseeded_draws_follow_the_filtered_distribution():
    vocab, draws = 64, 200000
    logits = torch.randn(1, vocab, generator=torch.Generator().manual_seed(8)) * 1.5
    params = SamplingParams(temperature=0.8, top_k=12, top_p=0.95)
    batch = make_batch([params] * draws, vocab, "cuda")
    reference = reference_kept(logits, make_batch([params], vocab))[0]
    probs = torch.softmax(logits[0] / 0.8, 0) * reference
    probs /= probs.sum()
    torch.manual_seed(9)
    tokens, _ = sample_on_device(logits.cuda().expand(draws, vocab), batch)
    counts = torch.bincount(tokens.cpu(), minlength=vocab).double()
    assert bool((counts[~reference] == 0).all())
    support = reference.nonzero().flatten()
    p_value = chi_square_p_value(counts[support], draws * probs[support].double())
    assert p_value > 1e-6, (p_value, counts[support], draws * probs[support])
