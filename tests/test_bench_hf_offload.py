"""tools/bench_hf_offload.py (HF transformers + accelerate offload, the decode bench's naive peer):
a tiny CPU run prints one parsable table row and places exactly the cache's share of blocks on the
GPU side under accelerate's hooks; the device map at the real shape (meta, no memory) keeps the
resident share at --cache-frac; user errors are one line."""
import pytest
import torch

import bench_hf_offload as hf

TINY = ["--device", "cpu", "--layers", "3", "--hidden", "64", "--inter", "32", "--experts", "8",
        "--top-k", "2", "--heads", "4", "--kv-heads", "2", "--head-dim", "16", "--vocab", "128",
        "--tokens", "2", "--cache-frac", "0.34"]


def covering_keys(name, dm):
    return [k for k in dm if k == "" or name == k or name.startswith(k + ".")]


def table_row(text):
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.split()[:2] == ["layers", "split"])
    return lines[i + 2].split()


@pytest.mark.parametrize("split,block", [("layer", "model.layers.{}"), ("experts", "model.layers.{}.mlp.experts")])
def test_tiny_cpu_run_prints_one_row_and_offloads_the_cache_share(capsys, split, block):
    res = hf.main(TINY + ["--split", split, "--compare-ms-per-layer", "0.5"])
    out = capsys.readouterr().out
    layers, got_split, frac, gpu_gb, cpu_gb, ms_tok, ms_layer, tps = table_row(out)
    assert (int(layers), got_split, frac) == (3, split, "34%")
    gpu_gb, cpu_gb, ms_tok, ms_layer, tps = map(float, (gpu_gb, cpu_gb, ms_tok, ms_layer, tps))
    assert min(gpu_gb, cpu_gb, ms_tok, ms_layer, tps) > 0
    assert ms_layer == pytest.approx(ms_tok / 3, rel=1e-2)
    assert tps == pytest.approx(1e3 / ms_tok, rel=1e-2)
    assert "HF+accelerate" in out and "distinct experts per layer" in out
    model, dm = res["model"], res["device_map"]
    # every parameter is covered by exactly one device-map entry, every entry names a real module
    names = [n for n, _ in model.named_parameters()]
    assert all(len(covering_keys(n, dm)) == 1 for n in names)
    modules = dict(model.named_modules())
    assert all(k in modules for k in dm)
    # 0.34 of three blocks' experts: one block on the GPU side, two offloaded
    blocks = [block.format(i) for i in range(3)]
    assert [dm[b] for b in blocks] == [0, "cpu", "cpu"]
    # accelerate's hooks hold the offloaded weights: the model's own parameters there are meta
    for n, p in model.named_parameters():
        offloaded = any(n.startswith(b + ".") for b in blocks[1:])
        assert (p.device.type == "meta") == offloaded, n
    assert res["offloaded_bytes"] == pytest.approx(cpu_gb * 1e9, rel=1e-3)


@pytest.mark.parametrize("frac,on_gpu", [(0.1, 0), (0.25, 1), (0.5, 2)])
def test_real_shape_map_keeps_the_resident_share_at_the_cache_fraction(frac, on_gpu):
    """Qwen3-30B-A3B shape, 4 layers, on meta: whole layers (split layer) and fused experts
    modules (split experts) resident for frac x 4 layers; the rest of the model on the GPU."""
    a = hf.parse_args(["--layers", "4", "--cache-frac", str(frac)])
    model = hf.build_meta_model(a, torch.bfloat16)
    experts = sum(p.numel() * 2 for n, p in model.named_parameters() if ".mlp.experts." in n)
    cap = int(hf.nbytes(model) - experts + (frac + 0.01) * experts)
    dm, reserve = hf.plan_device_map(model, "layer", cap, 10**12)
    assert [dm[f"model.layers.{i}"] for i in range(4)] == [0] * on_gpu + ["cpu"] * (4 - on_gpu)
    assert dm["lm_head"] == dm["model.embed_tokens"] == 0
    assert reserve == hf.nbytes(model.model.layers[0])
    dm, _ = hf.plan_device_map(model, "experts", cap, 10**12)
    assert [dm[f"model.layers.{i}.mlp.experts"] for i in range(4)] == [0] * on_gpu + ["cpu"] * (4 - on_gpu)
    assert dm["model.layers.3.self_attn"] == dm["model.layers.3.mlp.gate"] == 0
    assert hf.map_summary(dm)["CPU"] == f"layers[{on_gpu}-3].mlp.experts"


def test_auto_split_is_accelerates_plain_map_on_the_whole_model():
    a = hf.parse_args(["--layers", "4", "--cache-frac", "0.25", "--split", "auto"])
    model = hf.build_meta_model(a, torch.bfloat16)
    dm, reserve = hf.plan_device_map(model, "auto", 2_650_000_000, 10**12)
    assert reserve == 0 and dm["model.embed_tokens"] == 0 and dm["lm_head"] == "cpu"
    assert all(len(covering_keys(n, dm)) == 1 for n, _ in model.named_parameters())


@pytest.mark.parametrize("argv,msg", [(["--cache-frac", "1.5"], "--cache-frac 1.5 is outside"),
                                      (["--tokens", "0"], "must be >= 1")])
def test_user_errors_are_one_line_and_exit_2(capsys, argv, msg):
    with pytest.raises(SystemExit) as e:
        hf.main(["--device", "cpu"] + argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and msg in err and len(err.strip().splitlines()) == 1
