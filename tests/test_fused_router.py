"""The router's fused kernel (freetoken/models/fused_router.softmax_topk: softmax -> top-k ->
renormalise) against the torch route (moe.softmax_topk's), and moe's choice between them.

The weights are compared within 1e-6 relative (under the interpreter its exp is numpy's, torch's
is its own), the ids exactly except among equal probabilities (torch.topk orders those as it
likes; the kernel takes the lower id first).
interpreter: on cpu tensors under TRITON_INTERPRET=1. gpu: the same on cuda, one kernel where
torch's route takes several, and inside a captured graph.
"""
import pytest
import torch

from freetoken.models import fused, fused_router, moe

from fused_support import kernel_checks_test, rand


def ref_route(logits, k, renormalize):
    """moe.softmax_topk's torch code -> (ids, weights, probs [.., E])."""
    probs = torch.softmax(logits.float(), dim=-1)
    weights, ids = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights, probs


def assert_route(ids, weights, logits, k, renormalize, what):
    """The fused route against torch's: weights within 1e-6 relative; a valid top k (each taken
    expert has the probability torch ranks there), no expert twice, equal probabilities in
    ascending id order; torch's ids wherever the probability is not tied in its row."""
    ref_ids, ref_w, probs = ref_route(logits, k, renormalize)
    assert ids.shape == ref_ids.shape and ids.dtype == torch.int64, what
    assert weights.shape == ref_w.shape and weights.dtype == torch.float32, what
    torch.testing.assert_close(weights, ref_w, rtol=1e-6, atol=0, msg=what)
    p = probs.gather(-1, ids)
    assert torch.equal(p, probs.gather(-1, ref_ids)), f"{what}: not the top {k}"
    assert torch.equal(ids.sort(-1).values.diff(dim=-1) > 0,
                       torch.ones_like(ids[..., 1:], dtype=torch.bool)), f"{what}: an id twice"
    tie = p[..., 1:] == p[..., :-1]
    assert bool((ids[..., 1:] > ids[..., :-1])[tie].all()), f"{what}: ties not by lower id"
    tied = (probs[..., None, :] == p[..., None]).sum(-1) > 1  # [.., K]
    assert bool((ids == ref_ids)[~tied].all()), f"{what}: other experts than torch's"


def check_softmax_topk(device, dtype):
    for i, (lead, E) in enumerate([((1,), 60), ((3,), 128), ((4,), 256), ((2,), 257),
                                   ((2, 3), 512)]):
        logits = rand(*lead, E, dtype=dtype, device=device, scale=2.5, seed=i)
        for k in (1, 2, 8):
            for renormalize in (False, True):
                ids, w = fused_router.softmax_topk(logits, k, renormalize)
                assert_route(ids, w, logits, k, renormalize, f"route {lead} E={E} k={k}")
    logits = rand(3, 60, dtype=dtype, device=device, scale=2.5, seed=9)
    for k in (60, 33):  # all experts (a full sort), and k not a power of two
        ids, w = fused_router.softmax_topk(logits, k, True)
        assert_route(ids, w, logits, k, True, f"route E=60 k={k}")
    wide = rand(4, 200, dtype=dtype, device=device, scale=2.5, seed=10)
    logits = wide[:, 7:135]  # rows not back to back
    ids, w = fused_router.softmax_topk(logits, 8, True)
    assert_route(ids, w, logits, 8, True, "route strided")
    ids, w = fused_router.softmax_topk(logits[:0], 8, True)
    assert ids.shape == w.shape == (0, 8) and ids.dtype == torch.int64


def check_softmax_topk_ties(device, dtype):
    """Equal logits: the kernel takes the lower ids first, with torch's weights."""
    E = 60
    logits = torch.zeros(3, E)
    logits[1, [50, 7, 3]] = 2.0  # three tied leaders
    logits[2, 10:] = 1.0  # expert 40 leads, then 10..59 tied
    logits[2, 40] = 3.0
    logits = logits.to(device=device, dtype=dtype)
    order = [list(range(E)), [3, 7, 50] + [e for e in range(E) if e not in (3, 7, 50)],
             [40] + [e for e in range(10, E) if e != 40] + list(range(10))]
    for k in (1, 2, 3, 8, E):
        for renormalize in (False, True):
            ids, w = fused_router.softmax_topk(logits, k, renormalize)
            want = torch.tensor([row[:k] for row in order], device=device)
            assert torch.equal(ids, want), (k, ids)
            assert_route(ids, w, logits, k, renormalize, f"ties k={k}")
    ids, _ = fused_router.softmax_topk(logits, 3, True)  # the torch path takes the same three leaders
    ref_ids, _, _ = ref_route(logits, 3, True)
    assert torch.equal(ids[1].sort().values, ref_ids[1].sort().values)


test_router = kernel_checks_test([check_softmax_topk, check_softmax_topk_ties])


@pytest.mark.skipif(not fused.available(), reason="needs Triton")
def test_router_k_out_of_range():
    with pytest.raises(ValueError, match="out of range"):
        fused_router.softmax_topk(torch.zeros(2, 8), 9, True)


def test_moe_softmax_topk_takes_the_kernel_when_enabled(monkeypatch):
    logits = rand(5, 60, dtype=torch.bfloat16, device="cpu", scale=2.5)
    monkeypatch.setattr(fused_router, "softmax_topk", lambda *args: ("fused", args))
    monkeypatch.setattr(fused, "enabled", lambda x: True)
    assert moe.softmax_topk(logits, 4, False) == ("fused", (logits, 4, False))
    monkeypatch.setattr(fused, "enabled", lambda x: False)
    for renormalize in (False, True):
        ids, w = moe.softmax_topk(logits, 4, renormalize)
        ref_ids, ref_w, _ = ref_route(logits, 4, renormalize)
        assert torch.equal(ids, ref_ids) and torch.equal(w, ref_w)


@pytest.mark.gpu
def test_router_is_one_kernel(monkeypatch):
    """moe.softmax_topk on cuda: one kernel, where torch's route takes several."""
    from torch.profiler import ProfilerActivity, profile
    logits = rand(1, 128, dtype=torch.bfloat16, device="cuda", scale=2.5)
    enabled = fused.enabled

    def count(fused_on: bool):
        monkeypatch.setattr(fused, "enabled", enabled if fused_on else lambda x: False)
        moe.softmax_topk(logits, 8, True)  # compiles
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            moe.softmax_topk(logits, 8, True)
            torch.cuda.synchronize()
        return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    unfused, fused_count = count(False), count(True)
    print(f"router kernels: {unfused} unfused, {fused_count} fused")
    assert fused_count == 1 and unfused > 1, (unfused, fused_count)


@pytest.mark.gpu
def test_router_captured():
    """The router inside a CUDA graph: each replay routes the logits then in the static input."""
    logits = torch.zeros(4, 128, device="cuda", dtype=torch.bfloat16)
    fused_router.softmax_topk(logits, 8, True)  # compiles outside the capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            ids, w = fused_router.softmax_topk(logits, 8, True)
    torch.cuda.current_stream().wait_stream(side)
    for seed in range(3):
        new = rand(4, 128, dtype=torch.bfloat16, device="cuda", scale=2.5, seed=seed)
        logits.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert_route(ids, w, new, 8, True, f"captured, replay {seed}")
