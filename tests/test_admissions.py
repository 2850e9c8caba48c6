"""The admissions' orchestration (experts/admissions.py) without a GPU: the streams, events and
the gather kernel replaced by recorders, a step of four MoE layers with the last half deferred.
What the real thing does on cuda (same tokens, books and slot bytes as eager decode) is
tests/test_graph_step.py's gpu tests."""
from types import SimpleNamespace

import pytest
import torch

from freetoken.experts import admissions


class _Log:
    def __init__(self):
        self.calls = []

    def stream(self, *args, **kwargs):
        log = self

        class Stream:
            cuda_stream = 0

            def synchronize(self):
                log.calls.append(("sync",))

            def wait_stream(self, other):
                log.calls.append(("side waits main",))

            def wait_event(self, event):
                log.calls.append(("main waits", event.name))
        return Stream()

    def event(self):
        log = self

        class Event:
            name = f"event{sum(c[0] == 'record' for c in log.calls)}"

            def record(self, stream=None):
                log.calls.append(("record", self.name))
        return Event()


@pytest.fixture
def fake_cuda(monkeypatch):
    log = _Log()
    main = log.stream()
    monkeypatch.setattr(torch.cuda, "Stream", log.stream)
    monkeypatch.setattr(torch.cuda, "Event", log.event)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda: main)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    class On:
        def __init__(self, stream):
            self.stream = stream

        def __enter__(self):
            log.calls.append(("on side",))

        def __exit__(self, *exc):
            log.calls.append(("off side",))
    monkeypatch.setattr(torch.cuda, "stream", On)

    def gather(src, storage, asrc, adst, stride, programs=None):
        log.calls.append(("gather", int(asrc[0]), programs))
    monkeypatch.setattr(admissions.zero_copy, "gather", gather)
    monkeypatch.setattr(admissions.zero_copy, "host_words", lambda *a: None)
    return log


def _runtime(capacity):
    info = SimpleNamespace(num_experts=8, slot_stride=64)
    layers = (0, 1, 2, 3)
    return SimpleNamespace(infos={l: info for l in layers}, banks={l: None for l in layers},
                           host={l: torch.zeros(8 * 64, dtype=torch.uint8) for l in layers},
                           top_k=2, device="cpu", cache=SimpleNamespace(capacity=capacity))


def _box(expert):
    return SimpleNamespace(asrc_d=torch.tensor([expert]), adst_d=torch.tensor([0]))


def _step(adm, boxes, log):
    """One step as DeviceControl runs it: each layer planned (its list written), then the end."""
    adm.begin()
    for i, layer in enumerate((0, 1, 2, 3)):
        boxes.setdefault(layer, _box(10 + layer))
        adm.before_plan(layer, first=i == 0)
        boxes[layer].asrc_d.fill_(10 + layer)  # the plan writes the layer's list
        adm.beside_fills(layer, boxes[layer])
        adm.after_finish(layer, boxes[layer])
    adm.join()


@pytest.fixture(autouse=True)
def _defaults(monkeypatch):
    for name in ("FREETOKEN_ADMIT_DEFER", "FREETOKEN_ADMIT_AT", "FREETOKEN_ADMIT_PROGRAMS"):
        monkeypatch.delenv(name, raising=False)


def test_deferred_lists_wait_for_the_next_step(fake_cuda):
    boxes = {}
    adm = admissions.Admissions(_runtime(capacity=100), boxes, lambda layer: None, None, 1)
    assert adm.defer == (2, 3) and adm.early and not adm.join_each_layer
    fake_cuda.calls.clear()
    _step(adm, boxes, fake_cuda)
    gathers = [c for c in fake_cuda.calls if c[0] == "gather"]
    assert gathers == [("gather", 10, 8), ("gather", 11, 8)]  # layers 0, 1 in their step
    assert fake_cuda.calls[-1][0] == "main waits"  # the step's end joins them
    fake_cuda.calls.clear()
    _step(adm, boxes, fake_cuda)
    calls = fake_cuda.calls
    gathers = [c for c in calls if c[0] == "gather"]
    # at the step's start the last step's lists of layers 2 and 3, then layers 0 and 1's own
    assert gathers == [("gather", 12, 8), ("gather", 13, 8), ("gather", 10, 8), ("gather", 11, 8)]
    assert int(boxes[2].asrc_d[0]) == 12  # (rewritten by this step's plan after its gather)
    first_wait = next(i for i, c in enumerate(calls) if c[0] == "main waits")
    assert first_wait > calls.index(("gather", 11, 8))  # joined when layer 2 plans, not before
    fake_cuda.calls.clear()
    adm.flush()  # the books go back: this step's deferred lists land, full grid, then cleared
    assert [c for c in fake_cuda.calls if c[0] == "gather"] == [("gather", 12, None),
                                                                 ("gather", 13, None)]
    assert int(boxes[2].asrc_d[0]) == -1 and int(boxes[3].asrc_d[0]) == -1


def test_small_caches_and_late_starts_defer_nothing(fake_cuda, monkeypatch):
    small = admissions.Admissions(_runtime(capacity=12), {}, lambda layer: None, None, 1)
    assert small.join_each_layer and small.defer == ()  # 4 layers x (2 + 1) slots per step
    monkeypatch.setenv("FREETOKEN_ADMIT_AT", "after_cpu")
    boxes = {}
    late = admissions.Admissions(_runtime(capacity=100), boxes, lambda layer: None, None, 1)
    assert not late.early and late.defer == ()
    fake_cuda.calls.clear()
    _step(late, boxes, fake_cuda)
    assert [c[1] for c in fake_cuda.calls if c[0] == "gather"] == [10, 11, 12, 13]


def test_copy_engine_mode_copies_the_deferred_lists_at_the_next_start(fake_cuda, monkeypatch):
    """FREETOKEN_ADMIT_COPIES=1: the deferred layers' lists (written by their plans to the
    mailbox) are copied by the host when the next step starts, each layer's copies followed by
    the clear of its pend word (their next plan kernels wait for it: test_device_step), and
    are neither gathered at the step's start nor in their own step; flush copies and waits."""
    monkeypatch.setenv("FREETOKEN_ADMIT_COPIES", "1")
    monkeypatch.setattr(admissions.cuda_copy, "available", lambda: True)
    monkeypatch.setattr(admissions.cuda_copy, "memops_available", lambda: True)
    monkeypatch.setattr(admissions.cuda_copy, "copy_htod",
                        lambda dst, src, n, stream: fake_cuda.calls.append(("copy", dst, src, n)))
    monkeypatch.setattr(admissions.cuda_copy, "write_value",
                        lambda addr, v, stream: fake_cuda.calls.append(("write", addr, v)))
    rt = _runtime(capacity=100)
    rt.cache.storage = torch.zeros((100, 32), dtype=torch.int32)  # 128-byte slot rows
    boxes = {}
    adm = admissions.Admissions(rt, boxes, lambda layer: None, None, 1)
    assert adm.copies and adm.defer == (2, 3) and [adm.copy_list(l) for l in range(4)] == [
        False, False, True, True]

    def step():
        adm.begin()
        adm.issue_copies()  # (DeviceControl: right after the replay's launch)
        for i, layer in enumerate((0, 1, 2, 3)):
            box = boxes.setdefault(layer, _box(10 + layer))
            box.alist = getattr(box, "alist", torch.full((2, 2), -1, dtype=torch.int64))
            box.pend_d = getattr(box, "pend_d", torch.zeros(1, dtype=torch.int32))
            adm.before_plan(layer, first=i == 0)
            box.asrc_d.fill_(10 + layer)  # the plan writes the layer's lists
            if adm.copy_list(layer):
                box.alist[:, 0] = torch.tensor([10 + layer, 40 + layer])  # expert, slot
            adm.beside_fills(layer, box)
            adm.after_finish(layer, box)
        adm.join()

    fake_cuda.calls.clear()
    step()
    calls = fake_cuda.calls
    assert [c for c in calls if c[0] in ("copy", "write")] == []  # nothing listed yet
    assert [c[1] for c in calls if c[0] == "gather"] == [10, 11]  # the first half, in-step
    assert not [c for c in calls if c[0] == "main waits"][:-1]  # only the step's end joins
    fake_cuda.calls.clear()
    step()
    calls = fake_cuda.calls
    bank = rt.host[2].data_ptr(), rt.host[3].data_ptr()
    assert [c for c in calls if c[0] in ("copy", "write")] == [
        ("copy", rt.cache.storage.data_ptr() + 42 * 128, bank[0] + 12 * 64, 64),
        ("write", boxes[2].pend_d.data_ptr(), 0),
        ("copy", rt.cache.storage.data_ptr() + 43 * 128, bank[1] + 13 * 64, 64),
        ("write", boxes[3].pend_d.data_ptr(), 0)]
    assert [c[1] for c in calls if c[0] == "gather"] == [10, 11]  # no deferred gathers
    fake_cuda.calls.clear()
    synced = []
    adm.copy_stream.synchronize = lambda: synced.append(True)
    adm.flush()  # this step's lists, then the wait for them
    assert [c[0] for c in fake_cuda.calls] == ["copy", "write", "copy", "write"] and synced
    assert (boxes[2].alist[0] == -1).all() and (boxes[3].alist[0] == -1).all()
    fake_cuda.calls.clear()
    adm.flush()  # nothing left: no copies, no writes
    assert [c for c in fake_cuda.calls if c[0] in ("copy", "write")] == []


def test_copy_engine_mode_clears_every_pend_word_when_issuing_fails(fake_cuda, monkeypatch):
    monkeypatch.setenv("FREETOKEN_ADMIT_COPIES", "1")
    monkeypatch.setattr(admissions.cuda_copy, "available", lambda: True)
    monkeypatch.setattr(admissions.cuda_copy, "memops_available", lambda: True)

    def fail(*args):
        raise admissions.cuda_copy.CudaError("cuMemcpyHtoDAsync failed")
    writes = []
    monkeypatch.setattr(admissions.cuda_copy, "copy_htod", fail)
    monkeypatch.setattr(admissions.cuda_copy, "write_value", lambda addr, v, s: writes.append(addr))
    rt = _runtime(capacity=100)
    rt.cache.storage = torch.zeros((100, 32), dtype=torch.int32)
    boxes = {}
    adm = admissions.Admissions(rt, boxes, lambda layer: None, None, 1)
    for layer in (2, 3):
        boxes[layer] = _box(layer)
        boxes[layer].alist = torch.tensor([[5, -1], [7, 0]])
        boxes[layer].pend_d = torch.ones(1, dtype=torch.int32)
    with pytest.raises(admissions.cuda_copy.CudaError):
        adm.issue_copies()
    assert writes == [boxes[2].pend_d.data_ptr(), boxes[3].pend_d.data_ptr()]


def test_copy_engine_mode_needs_the_driver(fake_cuda, monkeypatch):
    monkeypatch.setenv("FREETOKEN_ADMIT_COPIES", "1")
    monkeypatch.setattr(admissions.cuda_copy, "available", lambda: False)
    with pytest.raises(admissions.ConfigError, match="unset it"):
        admissions.Admissions(_runtime(capacity=100), {}, lambda layer: None, None, 1)
