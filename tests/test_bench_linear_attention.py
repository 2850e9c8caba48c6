"""tools/bench_linear_attention.py at tiny sizes on cpu: without fla (ours alone, and it says
so), and with a stand-in for fla written from fla's documented contract ([B, T, H, D] layout,
value head h on key head h // (HV / H), state [N, HV, K, V], fused_recurrent's gk/gv before
beta), which checks the bench hands fla our inputs in fla's terms."""
import sys

import pytest
import torch

import bench_linear_attention as bla

TINY = ["--device", "cpu", "--tiny", "--prefill-lengths", "16,70", "--decode-batches", "1,2",
        "--repeats", "2", "--warmup", "1"]


def test_without_fla_ours_alone_matches_its_fp32_reference(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)  # `import fla` raises ImportError
    rows = bla.main(TINY)
    assert "fla is missing" in capsys.readouterr().out
    ours = {r[0]: r for r in rows if r[1] == "ours"}
    assert list(ours) == ["prefill B=1 T=16", "prefill B=1 T=70", "decode B=1 T=1",
                          "decode B=2 T=1"]
    assert not [r for r in rows if r[1].startswith("fla")]
    refs = {r[0]: r for r in rows if r[1].startswith("(reference")}
    for case, (_, _, ms, do, ds) in ours.items():
        assert ms > 0 and ds == 0.0  # the same fp32 math on the same values
        assert 0 < do <= refs[case][3] * 2 ** -7  # the bf16 rounding of the output alone


def fla_contract(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None, initial_state=None,
                  output_final_state=False, use_qk_l2norm_in_kernel=False):
    """The gated delta rule as fla's docstrings and kernels state it, token by token."""
    assert gk is None and gv is None and beta is not None and output_final_state
    B, T, H, K = q.shape
    HV = v.shape[2]
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    if use_qk_l2norm_in_kernel:
        q, k = (t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    scale = K ** -0.5 if scale is None else scale
    h = initial_state.float().clone()  # [B, HV, K, V]
    o = torch.empty(B, T, HV, v.shape[-1])
    for b in range(B):
        for t in range(T):
            for hv in range(HV):
                kk, qq = k[b, t, hv // (HV // H)], q[b, t, hv // (HV // H)] * scale
                h[b, hv] *= g[b, t, hv].exp()
                u = beta[b, t, hv] * (v[b, t, hv] - kk @ h[b, hv])
                h[b, hv] += kk[:, None] * u[None, :]
                o[b, t, hv] = qq @ h[b, hv]
    return o.to(v.dtype), h


def test_fla_rows_with_a_stand_in_for_fla(capsys, monkeypatch):
    monkeypatch.setattr(bla, "load_fla", lambda device: (fla_contract, fla_contract, None))
    monkeypatch.setitem(sys.modules, "fla", type(sys)("fla"))  # the header's version line
    sys.modules["fla"].__version__, sys.modules["fla"].__file__ = "stand-in", "test"
    rows = bla.main(TINY + ["--repeats", "1", "--warmup", "0"])
    assert "fla stand-in" in capsys.readouterr().out
    fla = {r[0]: r for r in rows if r[1] == "fla"}
    assert len(fla) == 4
    for case, (_, _, ms, do, ds) in fla.items():
        assert ms > 0 and do < 1e-5 and ds < 1e-5, case


@pytest.mark.gpu
def test_cuda_full_widths_short_lengths(capsys):
    """On cuda at the Qwen3.6 layer's widths: ours runs every row (decode captured too); with
    fla installed its eager rows stay within 2^-5 of the largest reference value (a wrong head,
    state or scale mapping is off by the order of the values themselves); a failing capture of
    fla's is the bench's FAILED row, not checked here."""
    rows = bla.main(["--prefill-lengths", "64,200", "--decode-batches", "1,4", "--repeats", "3",
                     "--warmup", "2", "--graph-calls", "4"])
    assert not [r for r in rows if r[1].startswith(("ours", "fla FAILED"))
                and "FAILED" in r[1]], rows
    impls = {(r[0], r[1]) for r in rows}
    assert {("decode B=1 T=1", "ours (graph)"), ("decode B=4 T=1", "ours (graph)")} <= impls
    refs = {r[0]: r for r in rows if r[1].startswith("(reference")}
    for case, impl, ms, do, ds in rows:
        if impl == "fla":
            assert ms > 0 and do <= refs[case][3] * 2 ** -5 and ds <= refs[case][4] * 2 ** -5, case
