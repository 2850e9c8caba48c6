"""tools/profile_decode.py runs end to end on a tiny cpu shape and prints its three parts."""
import profile_decode

TINY = ["--device", "cpu", "--layers", "2", "--experts", "8", "--top-k", "2", "--hidden", "32",
        "--inter", "16", "--vocab", "64", "--heads", "2", "--kv-heads", "1", "--head-dim", "16",
        "--tokens", "3", "--warmup", "1", "--history", "8", "--rows", "5", "--fill-threads", "1"]


def test_profile_decode_tiny(capsys):
    profile_decode.main(TINY + ["--cache-frac", "0.5", "--tier-compute", "torch", "--cpu-experts", "torch"])
    text = capsys.readouterr().out
    assert "ms/token" in text and "(b) top 5 ops by self CPU time" in text
    assert "aten::item" in text and "per layer" in text  # the sampler's one sync per token
