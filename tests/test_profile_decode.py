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
    assert "in the step call, then" in text and "waiting for the step's end" in text


class _Event:
    """A kineto device event as profile_decode reads one."""

    def __init__(self, start_us, end_us, stream, name):
        self.span, self.stream, self._name = (start_us * 1000, end_us * 1000), stream, name

    def start_ns(self):
        return self.span[0]

    def end_ns(self):
        return self.span[1]

    def device_resource_id(self):
        return self.stream

    def name(self):
        return self._name

    def device_type(self):
        import torch
        return torch.autograd.DeviceType.CUDA


def _profile_of(events):
    from types import SimpleNamespace
    return SimpleNamespace(profiler=SimpleNamespace(
        kineto_results=SimpleNamespace(events=lambda: events)))


def test_flags_lines_sort_layers_by_fills_and_waits():
    """(f) and (e) on a made-up timeline of two steps of two layers: main stream 7 (the side
    stream's admission gather does not count), a 30 µs gather marks a filling layer, a 100 µs
    finish one that waited."""
    events, t = [], 0
    for layer in range(4):
        gather, finish = (30 if layer == 1 else 3), (100 if layer % 2 else 2)
        for name, dur in (("_plan_kernel", 1), ("_gather", gather), ("_gate_up", 20),
                          ("_finish", finish)):
            events.append(_Event(t, t + dur, 7, name))
            if name == "_gather":
                events.append(_Event(t, t + 200, 9, "_gather_loop"))
            t += dur
        t += 1  # a 1 µs gap before the next layer
    prof = _profile_of(events)
    lines = profile_decode.signal_lines(prof, 2, "host line")
    assert lines[0] == "host line"
    rows = {line[:28].strip(): line.split()[-4:] for line in lines[2:]}
    assert rows == {"fills, waited": ["0.5", "50.0", "100.0", "150.0"],
                    "no fills, waited": ["0.5", "23.0", "100.0", "123.0"],
                    "no fills, no wait": ["1.0", "23.0", "2.0", "25.0"]}
    gaps = profile_decode.gap_lines(prof, 2, 3)
    assert gaps[0].startswith("main stream 7: 8 events per token")
    assert "_finish -> _plan_kernel" in gaps[2] and gaps[2].split()[-3:] == ["1.5", "1.0", "1.5"]
    empty = _profile_of([])
    assert profile_decode.signal_lines(empty, 1, "h") == profile_decode.gap_lines(empty, 1, 3)
