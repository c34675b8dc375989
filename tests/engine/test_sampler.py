import math

import pytest
import torch

from engine.sampling_params import SamplingParams
from engine.worker.sampler import (
    apply_min_p,
    apply_penalties,
    apply_top_k_top_p,
    build_sampling_batch,
    sample,
)

V = 64
EOS = 5


def run(
    logits: torch.Tensor,
    params: list[SamplingParams],
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
):
    n = len(params)
    batch = build_sampling_batch(
        params,
        prompts or [[] for _ in range(n)],
        outputs or [[] for _ in range(n)],
        generators or [None] * n,
        EOS,
        logits.shape[1],
        "cpu",
    )
    return sample(logits, batch)


def seeded(seed: int) -> torch.Generator:
    return torch.Generator("cpu").manual_seed(seed)


def test_greedy_is_argmax():
    logits = torch.randn(8, V, generator=seeded(0))
    result = run(logits, [SamplingParams(temperature=0)] * 8)
    assert result.token_ids == logits.argmax(-1).tolist()
    assert result.logprobs == [None] * 8


def test_greedy_rows_mixed_with_random_rows_stay_argmax():
    logits = torch.randn(6, V, generator=seeded(1))
    params = [SamplingParams(temperature=0 if i % 2 == 0 else 1.0) for i in range(6)]
    result = run(logits, params)
    assert result.token_ids[::2] == logits[::2].argmax(-1).tolist()


def test_sample_leaves_caller_logits_untouched_and_ignores_vocab_padding():
    logits = torch.randn(3, V + 8, generator=seeded(2))
    logits[:, V:] = 1e4
    before = logits.clone()
    batch = build_sampling_batch(
        [SamplingParams(temperature=0), SamplingParams(top_k=5), SamplingParams(min_p=0.5)],
        [[1], [2], [3]],
        [[], [], []],
        [None] * 3,
        EOS,
        V,
        "cpu",
    )
    tokens = sample(logits, batch).token_ids
    assert all(t < V for t in tokens)
    assert torch.equal(logits, before)


def naive_support(row: torch.Tensor, k: int, p: float) -> set[int]:
    order = sorted(range(len(row)), key=lambda i: -row[i].item())
    if k > 0:
        order = order[:k]
    probs = torch.softmax(row[order], dim=0).tolist()
    kept, mass = [], 0.0
    for token, prob in zip(order, probs, strict=True):
        if p < 1.0 and mass >= p:
            break
        kept.append(token)
        mass += prob
    return set(kept)


def test_top_k_top_p_mask_matches_naive_per_row():
    gen = seeded(3)
    rows = 12
    logits = torch.randn(rows, V, generator=gen) * 3
    ks = [0, 1, 2, 7, V, 0, 3, 10, 0, 1, 20, 5]
    ps = [1.0, 1.0, 0.5, 1.0, 0.9, 0.3, 0.99, 0.6, 0.05, 0.7, 1.0, 0.2]
    top_k = torch.tensor([k if k > 0 else V for k in ks])
    top_p = torch.tensor(ps)
    masked = apply_top_k_top_p(logits.clone(), top_k, top_p)
    for i in range(rows):
        kept = set(torch.isfinite(masked[i]).nonzero().flatten().tolist())
        assert kept == naive_support(logits[i], ks[i], ps[i]), f"row {i}"
        assert torch.equal(masked[i][list(kept)], logits[i][list(kept)])


def test_top_k_alone_and_top_p_alone():
    logits = torch.randn(4, V, generator=seeded(4))
    only_k = apply_top_k_top_p(logits.clone(), torch.tensor([1, 3, V, 10]), None)
    assert torch.isfinite(only_k).sum(-1).tolist() == [1, 3, V, 10]
    only_p = apply_top_k_top_p(logits.clone(), None, torch.tensor([0.5, 1.0, 0.1, 0.8]))
    for i, p in enumerate([0.5, 1.0, 0.1, 0.8]):
        kept = set(torch.isfinite(only_p[i]).nonzero().flatten().tolist())
        assert kept == naive_support(logits[i], 0, p)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(top_p=1e-50),  # 0 in float32
        SamplingParams(top_k=3, top_p=1e-46),
        SamplingParams(repetition_penalty=1e-39),  # seen positive logits overflow
        SamplingParams(repetition_penalty=1e-39, top_p=0.5),
    ],
)
def test_extreme_valid_filters_still_sample_a_token_they_allow(params):
    logits = torch.randn(1, V, generator=seeded(11)) * 3
    best = int(logits.argmax())
    prompt = [best, (best + 1) % V]
    torch.manual_seed(0)
    tokens = run(logits.expand(50, V), [params] * 50, prompts=[prompt] * 50).token_ids
    if params.repetition_penalty == 1.0:
        assert set(tokens) == {best}, tokens  # the nucleus is the most likely token alone
    else:
        # A penalty below 1 favours the prompt's tokens; one with a positive logit wins.
        positive_seen = {t for t in prompt if logits[0, t] > 0}
        assert positive_seen and set(tokens) <= positive_seen, tokens


def test_min_p_mask_matches_naive_per_row():
    logits = torch.randn(5, V, generator=seeded(5)) * 2
    min_p = [0.0, 0.05, 0.2, 0.5, 1.0]
    masked = apply_min_p(logits.clone(), torch.tensor(min_p))
    for i, m in enumerate(min_p):
        probs = torch.softmax(logits[i], dim=0)
        expected = set((probs >= m * probs.max()).nonzero().flatten().tolist())
        assert set(torch.isfinite(masked[i]).nonzero().flatten().tolist()) == expected


def test_sampled_tokens_stay_inside_the_filtered_support():
    logits = torch.randn(1, V, generator=seeded(6)) * 2
    draws = 400
    cases = [
        (SamplingParams(top_k=4), naive_support(logits[0], 4, 1.0)),
        (SamplingParams(top_p=0.6), naive_support(logits[0], 0, 0.6)),
        (SamplingParams(top_k=10, top_p=0.8), naive_support(logits[0], 10, 0.8)),
    ]
    probs = torch.softmax(logits[0], 0)
    cases.append(
        (SamplingParams(min_p=0.3), set((probs >= 0.3 * probs.max()).nonzero().flatten().tolist()))
    )
    for params, support in cases:
        torch.manual_seed(0)
        tokens = run(logits.expand(draws, V), [params] * draws).token_ids
        assert set(tokens) <= support, params
        # Every kept token is reachable, not only the most likely one.
        assert set(tokens) == support, params


def test_sampling_follows_the_tempered_softmax():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    draws = 20000
    for temperature in (1.0, 0.5, 2.0):
        torch.manual_seed(1)
        tokens = run(logits.expand(draws, 5), [SamplingParams(temperature=temperature)] * draws)
        freq = torch.bincount(torch.tensor(tokens.token_ids), minlength=5).float() / draws
        expected = torch.softmax(logits[0] / temperature, 0)
        assert torch.allclose(freq, expected, atol=0.015), (temperature, freq, expected)


def naive_penalties(logits, prompt, output, rep, freq, pres):
    out = logits.clone()
    for token in set(prompt) | set(output):
        value = out[token].item()
        out[token] = value / rep if value > 0 else value * rep
    for token in set(output):
        out[token] -= freq * output.count(token) + pres
    return out


def test_penalties_match_naive_loop():
    gen = seeded(7)
    rows = 5
    logits = torch.randn(rows, V, generator=gen) * 2
    prompts = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (3, 0, 10, 1, 6)]
    outputs = [torch.randint(0, V, (n,), generator=gen).tolist() for n in (8, 4, 0, 12, 2)]
    # Repeats, so counts (frequency) and presence differ.
    outputs = [out + out[:2] * 2 for out in outputs]
    settings = [(1.3, 0.5, 0.2), (0.8, -0.4, 1.0), (1.0, 1.5, -1.0), (2.0, 0.0, 0.0), (1.0, 0, 0)]
    params = [
        SamplingParams(temperature=0, repetition_penalty=r, frequency_penalty=f, presence_penalty=p)
        for r, f, p in settings
    ]
    batch = build_sampling_batch(params, prompts, outputs, [None] * rows, None, V, "cpu")
    got = apply_penalties(
        logits.clone(),
        batch.output_token_counts,
        batch.prompt_token_mask,
        batch.repetition_penalty,
        batch.frequency_penalty,
        batch.presence_penalty,
    )
    for i, (r, f, p) in enumerate(settings):
        expected = naive_penalties(logits[i], prompts[i], outputs[i], r, f, p)
        assert torch.allclose(got[i], expected, atol=1e-5), f"row {i}"
    # Greedy picks the argmax of the penalised logits.
    assert sample(logits, batch).token_ids == got.argmax(-1).tolist()


def test_min_tokens_blocks_eos_and_stop_ids_until_reached():
    logits = torch.zeros(1, V)
    logits[0, EOS] = 10.0
    logits[0, 9] = 9.0
    logits[0, 11] = 8.0
    params = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[9])
    assert run(logits, [params], outputs=[[1, 2]]).token_ids == [11]
    assert run(logits, [params], outputs=[[1, 2, 3]]).token_ids == [EOS]
    # With ignore_eos, EOS ends nothing, so it is not blocked; the stop id still is.
    ignore = SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[9], ignore_eos=True)
    assert run(logits, [ignore], outputs=[[1]]).token_ids == [EOS]
    logits[0, EOS] = 0.0
    assert run(logits, [ignore], outputs=[[1]]).token_ids == [11]


def generate(seed_rows, batch_size, steps, unseeded_params=None, position=0):
    """Runs `steps` steps where row `position` is a seeded request; returns its tokens."""
    logit_gen = seeded(100)
    generators = [seeded(s) if s is not None else None for s in seed_rows]
    params = [
        SamplingParams(top_k=20, top_p=0.9, seed=s)
        if s is not None
        else (unseeded_params or SamplingParams())
        for s in seed_rows
    ]
    assert len(params) == batch_size
    tokens = []
    for _ in range(steps):
        step_logits = torch.randn(1, V, generator=logit_gen)
        logits = torch.randn(batch_size, V) * 3
        logits[position] = step_logits[0]
        out = run(logits, params, generators=generators).token_ids
        tokens.append(out[position])
    return tokens


def test_same_seed_reproduces_tokens():
    assert generate([42], 1, 20) == generate([42], 1, 20)
    assert generate([42], 1, 20) != generate([43], 1, 20)


def test_seeded_request_does_not_depend_on_batch_neighbours():
    alone = generate([42], 1, 20)
    torch.manual_seed(123)
    with_unseeded = generate([None, 42, None], 3, 20, position=1)
    with_seeded = generate([7, None, 42, 8], 4, 20, position=2)
    with_greedy = generate([42, None], 2, 20, unseeded_params=SamplingParams(temperature=0))
    assert alone == with_unseeded == with_seeded == with_greedy


def test_logprobs_are_raw_log_softmax_with_ranks_and_top_n():
    logits = torch.randn(4, V, generator=seeded(8)) * 2
    params = [
        SamplingParams(temperature=0.7, logprobs=5, repetition_penalty=1.5, top_k=10),
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(),
        SamplingParams(temperature=0, logprobs=3, presence_penalty=2.0),
    ]
    outputs = [[1, 2, 3], [], [4], [int(logits[3].argmax())]]
    torch.manual_seed(0)
    result = run(logits, params, prompts=[[5, 6]] * 4, outputs=outputs)
    raw = torch.log_softmax(logits, dim=-1)
    assert result.logprobs[2] is None
    for i, n in [(0, 5), (1, 0), (3, 3)]:
        lp = result.logprobs[i]
        token = result.token_ids[i]
        assert lp.token_id == token
        assert math.isclose(lp.logprob, raw[i, token].item(), abs_tol=1e-5)
        assert lp.rank == 1 + int((raw[i] > raw[i, token]).sum())
        assert len(lp.top) == n
        expected_ids = raw[i].argsort(descending=True)[:n].tolist()
        assert list(lp.top) == expected_ids
        for t, value in lp.top.items():
            assert math.isclose(value, raw[i, t].item(), abs_tol=1e-5)
    # The presence penalty moved greedy off the raw argmax, so its rank is below 1.
    assert result.logprobs[3].rank > 1


def test_build_rejects_mismatched_lengths():
    with pytest.raises(ValueError):
        build_sampling_batch([SamplingParams()], [[1]], [], [None], EOS, V, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_greedy_matches_cpu_and_seeded_rows_are_batch_independent():
    logits = torch.randn(4, V, generator=seeded(9))
    logits[3] = logits[1]
    params = [SamplingParams(temperature=0), SamplingParams(seed=1, top_p=0.9)] * 2
    params[2] = SamplingParams(temperature=0, repetition_penalty=1.5, logprobs=3)
    outputs = [[], [], [7, 8, 9], []]

    def run_cuda(rows: list[int]) -> list[int]:
        gens = {
            1: torch.Generator("cuda").manual_seed(1),
            3: torch.Generator("cuda").manual_seed(1),
        }
        batch = build_sampling_batch(
            [params[i] for i in rows],
            [[1, 2]] * len(rows),
            [outputs[i] for i in rows],
            [gens.get(i) for i in rows],
            EOS,
            V,
            "cuda",
        )
        return sample(logits[rows].cuda(), batch).token_ids

    cpu = run(logits, params, prompts=[[1, 2]] * 4, outputs=outputs).token_ids
    gpu = run_cuda([0, 1, 2, 3])
    assert gpu[0::2] == cpu[0::2]
    # Rows 1 and 3: same logits, same seed, each on its own generator.
    assert gpu[1] == gpu[3] == run_cuda([1])[0] == run_cuda([3, 0])[0]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_plain_temperature_batches_take_one_pass_and_keep_greedy_rows(monkeypatch):
    import kernels.triton_sampling as ts

    calls = []
    one_pass = ts.gumbel_sample_triton
    monkeypatch.setattr(
        ts, "gumbel_sample_triton", lambda *a, **k: calls.append(1) or one_pass(*a, **k)
    )
    logits = torch.randn(3, V, generator=seeded(4)).cuda()
    logits[1, 7] = 100.0  # at T=0.8 every draw of row 1 lands on token 7
    params = [SamplingParams(temperature=t) for t in (0, 0.8, 0.8)]
    batch = build_sampling_batch(params, [[1]] * 3, [[]] * 3, [None] * 3, EOS, V, "cuda")
    ids = sample(logits, batch).token_ids
    assert calls and ids[0] == int(logits[0].argmax()) and ids[1] == 7
    # A seeded row keeps its own generator: the batch takes the torch chain.
    calls.clear()
    params[2] = SamplingParams(temperature=0.8, seed=3)
    gens = [None, None, torch.Generator("cuda").manual_seed(3)]
    batch = build_sampling_batch(params, [[1]] * 3, [[]] * 3, gens, EOS, V, "cuda")
    ids = sample(logits, batch).token_ids
    assert not calls and ids[0] == int(logits[0].argmax()) and ids[1] == 7


def test_logit_bias_shifts_each_rows_own_tokens_before_sampling():
    logits = torch.randn(3, V, generator=seeded(12))
    top = logits.argmax(-1).tolist()
    params = [
        SamplingParams(temperature=0, logit_bias={7: 100}),  # forces 7
        SamplingParams(temperature=0, logit_bias={top[1]: -100}),  # bans its argmax
        SamplingParams(temperature=0, logprobs=1),  # no bias of its own
    ]
    result = run(logits, params)
    second = logits[1].clone()
    second[top[1]] -= 100
    assert result.token_ids == [7, int(second.argmax()), top[2]]
    # A random row follows the biased distribution too: all its mass on the boosted token.
    forced = SamplingParams(temperature=1.0, seed=3, logit_bias={9: 100})
    assert run(logits[:1], [forced], generators=[seeded(3)]).token_ids == [9]


def test_logit_bias_leaves_the_reported_logprobs_the_models():
    logits = torch.randn(1, V, generator=seeded(13))
    params = SamplingParams(temperature=0, logprobs=0, logit_bias={4: 100})
    result = run(logits, [params])
    assert result.token_ids == [4]
    want = logits[0].log_softmax(-1)[4].item()
    assert math.isclose(result.logprobs[0].logprob, want, rel_tol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_cuda_batches_with_a_logit_bias_skip_the_triton_passes(temperature):
    # The Triton argmax and one-pass sampler read the logits as they are; a bias must not
    # be lost on their way.
    logits = torch.randn(2, V, generator=seeded(14)).cuda()
    params = [
        SamplingParams(temperature=temperature, logit_bias={7: 100}),
        SamplingParams(temperature=0),
    ]
    batch = build_sampling_batch(params, [[1]] * 2, [[]] * 2, [None] * 2, EOS, V, "cuda")
    assert sample(logits, batch).token_ids == [7, int(logits[1].argmax())]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_steps_logprobs_are_read_without_waiting_for_work_queued_after_it():
    import time

    from engine.worker.model_runner import PendingRunnerOutput
    from engine.worker.sampler import sample_on_device

    logits = torch.randn(2, V, generator=seeded(15)).cuda()
    params = [SamplingParams(temperature=0, logprobs=2), SamplingParams(temperature=0)]
    batch = build_sampling_batch(params, [[1]] * 2, [[]] * 2, [None] * 2, EOS, V, "cuda")
    sampled, logprobs = sample_on_device(logits, batch)
    pending = PendingRunnerOutput(["a", "b"], sampled, logprobs, batch)
    torch.cuda._sleep(2_000_000_000)  # the next step: about a second of GPU time
    start = time.perf_counter()
    output = pending.result()
    waited = time.perf_counter() - start
    torch.cuda.synchronize()
    assert waited < 0.2, f"result() waited {waited:.2f} s for work queued after the step"
    assert output.sampled_token_ids == dict(zip("ab", logits.argmax(-1).tolist()))
    assert output.logprobs["a"].rank == 1 and "b" not in output.logprobs
