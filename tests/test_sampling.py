"""sample() and SamplingParams: greedy, seeded reproducibility, each mask on crafted logits,
repetition penalty, and validation errors that name the option and its valid range."""
import math

import pytest
import torch

from freetoken.errors import ConfigError
from freetoken.sampling import (SamplingParams, apply_repetition_penalty, filter_logits,
                                make_generator, sample)

OFF = dict(top_k=0, top_p=1.0, min_p=0.0)


def kept(logits, **kw):
    """Sorted ids that survive filter_logits (finite logits)."""
    out = filter_logits(torch.tensor(logits), SamplingParams(**{**OFF, "temperature": 1.0, **kw}))
    return torch.nonzero(torch.isfinite(out)).flatten().tolist()


def test_greedy_is_argmax():
    gen = make_generator(0, "cpu")
    for seed in range(5):
        logits = torch.randn(1000, generator=torch.Generator().manual_seed(seed))
        tok = sample(logits, SamplingParams(temperature=0), gen)
        assert tok.dim() == 0 and tok.dtype == torch.int64
        assert int(tok) == int(logits.argmax())


def test_seed_reproducible_and_seeds_differ():
    logits = torch.zeros(5000)  # uniform: every draw is pure noise
    params = SamplingParams(temperature=1.0, **OFF)

    def draws(seed):
        gen = make_generator(seed, "cpu")
        return [int(sample(logits, params, gen)) for _ in range(20)]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_sampling_follows_the_distribution():
    probs = torch.tensor([0.5, 0.3, 0.2])
    params = SamplingParams(temperature=1.0, **OFF)
    gen = make_generator(0, "cpu")
    counts = torch.bincount(torch.stack([sample(probs.log(), params, gen) for _ in range(4000)]),
                            minlength=3).float() / 4000
    assert torch.allclose(counts, probs, atol=0.03), counts


def test_top_k_keeps_k_best():
    assert kept([1.0, 5.0, 3.0, 4.0, 2.0], top_k=2) == [1, 3]
    assert kept([1.0, 5.0, 3.0], top_k=0) == [0, 1, 2]
    assert kept([1.0, 5.0, 3.0], top_k=10) == [0, 1, 2]


def test_top_p_keeps_smallest_set_reaching_p():
    logits = torch.tensor([0.5, 0.25, 0.15, 0.1]).log().tolist()
    assert kept(logits, top_p=0.5) == [0]  # 0.5 alone reaches 0.5
    assert kept(logits, top_p=0.6) == [0, 1]
    assert kept(logits, top_p=0.8) == [0, 1, 2]
    assert kept(logits, top_p=0.01) == [0]  # the top token always survives


def test_min_p_is_relative_to_top_prob():
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().tolist()
    assert kept(logits, min_p=0.2) == [0, 1, 2]  # threshold 0.1
    assert kept(logits, min_p=0.7) == [0]  # threshold 0.35
    assert kept(logits, min_p=1.0) == [0]


def test_masks_compose_in_order():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log().tolist()
    # top-k=3 renormalises to 4/9, 3/9, 2/9; then top-p 0.7 needs tokens 0 and 1.
    assert kept(logits, top_k=3, top_p=0.7) == [0, 1]


def test_temperature_sharpens():
    logits = torch.tensor([2.0, 1.0])
    hot = torch.softmax(filter_logits(logits, SamplingParams(temperature=2.0, **OFF)), -1)
    cold = torch.softmax(filter_logits(logits, SamplingParams(temperature=0.5, **OFF)), -1)
    assert cold[0] > torch.softmax(logits, -1)[0] > hot[0]


def test_sampled_token_always_in_kept_set():
    gen = make_generator(3, "cpu")
    logits = torch.randn(200, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=1.5, top_k=5, top_p=0.9, min_p=0.0)
    allowed = set(torch.topk(logits, 5).indices.tolist())
    assert {int(sample(logits, params, gen)) for _ in range(200)} <= allowed


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([2.0, -2.0, 1.0, 3.0])
    out = apply_repetition_penalty(logits, torch.tensor([0, 1, 1]), 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0, 3.0]
    # greedy honours it: token 3 was seen, so 2 (=1.5) beats 3 (=3/2.5=1.2)
    logits = torch.tensor([0.0, 0.0, 1.5, 3.0])
    params = SamplingParams(temperature=0, repetition_penalty=2.5)
    assert int(sample(logits, params, make_generator(0, "cpu"), torch.tensor([3]))) == 2
    assert int(sample(logits, params, make_generator(0, "cpu"), None)) == 3


@pytest.mark.parametrize("kw, option", [
    (dict(max_tokens=0), "-n"), (dict(max_tokens=2.5), "-n"),
    (dict(temperature=-0.1), "--temp"), (dict(temperature=math.nan), "--temp"),
    (dict(top_k=-1), "--top-k"), (dict(top_p=0.0), "--top-p"), (dict(top_p=1.5), "--top-p"),
    (dict(min_p=-0.5), "--min-p"), (dict(min_p=2.0), "--min-p"),
    (dict(repetition_penalty=0.0), "--repeat-penalty"), (dict(seed=-1), "--seed"),
    (dict(stop=("",)), "--stop"),
])
def test_validation_names_option_and_range(kw, option):
    with pytest.raises(ConfigError) as e:
        SamplingParams(**kw)
    assert option in str(e.value) and "must be" in str(e.value)


def test_params_frozen_and_stop_normalised():
    p = SamplingParams(stop="END")
    assert p.stop == ("END",)
    with pytest.raises(Exception):
        p.temperature = 1.0  # type: ignore[misc]
