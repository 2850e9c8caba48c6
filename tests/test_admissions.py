"""The admissions' orchestration (experts/captured/admissions.py) without a GPU: the streams, events and
the gather kernel replaced by recorders, a step of four MoE layers with the last half deferred;
and the cpu's form (each gather in place).
What the real thing does on cuda (same tokens, books and slot bytes as eager decode) is
tests/test_graph_step.py's gpu tests."""
from types import SimpleNamespace

import pytest
import torch

from freetoken.config import Tuning
from freetoken.experts.captured import admissions


class _Log:
    def __init__(self):
        self.calls = []

    def stream(self, *args, **kwargs):
        log = self

        class Stream:
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


def _runtime(capacity, admit_defer=None, is_cuda=True):
    """is_cuda: the cuda orchestration (on fake_cuda's recorders), else the cpu's (in place)."""
    info = SimpleNamespace(num_experts=8, slot_stride=64)
    layers = (0, 1, 2, 3)
    return SimpleNamespace(infos={l: info for l in layers}, banks={l: None for l in layers},
                           host={l: torch.zeros(8 * 64, dtype=torch.uint8) for l in layers},
                           top_k=2, device="cpu", is_cuda=is_cuda,
                           cache=SimpleNamespace(capacity=capacity),
                           tuning=Tuning(admit_defer=admit_defer))


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
    adm.join()


def test_deferred_lists_wait_for_the_next_step(fake_cuda):
    boxes = {}
    adm = admissions.Admissions(_runtime(capacity=100), boxes, lambda layer: None, None, 1)
    assert adm.defer == (2, 3) and not adm.join_each_layer
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


def test_small_caches_and_defer_0_defer_nothing(fake_cuda):
    small = admissions.Admissions(_runtime(capacity=12), {}, lambda layer: None, None, 1)
    assert small.join_each_layer and small.defer == ()  # 4 layers x (2 + 1) slots per step
    boxes = {}
    none = admissions.Admissions(_runtime(capacity=100, admit_defer=0), boxes, lambda layer: None,
                                 None, 1)
    assert none.defer == ()
    fake_cuda.calls.clear()
    _step(none, boxes, fake_cuda)
    assert [c[1] for c in fake_cuda.calls if c[0] == "gather"] == [10, 11, 12, 13]



def test_cpu_gathers_in_place_in_step_order(fake_cuda):
    """On the cpu (Triton's interpreter: GPU-resident control run inline in tests) no stream,
    event or sync: each layer's admissions gathered at its fills, the deferred ones at the next
    step's start, the pending ones by flush."""
    boxes = {}
    adm = admissions.Admissions(_runtime(capacity=100, is_cuda=False), boxes, lambda layer: None,
                                None, 1)
    assert adm.side is None and adm.defer == (2, 3)
    fake_cuda.calls.clear()
    _step(adm, boxes, fake_cuda)
    assert fake_cuda.calls == [("gather", 10, 8), ("gather", 11, 8)]
    fake_cuda.calls.clear()
    _step(adm, boxes, fake_cuda)
    assert fake_cuda.calls == [("gather", 12, 8), ("gather", 13, 8), ("gather", 10, 8),
                               ("gather", 11, 8)]
    fake_cuda.calls.clear()
    adm.flush()
    assert fake_cuda.calls == [("gather", 12, None), ("gather", 13, None)]


def test_link_busy_and_admit_write_the_tables_together():
    """DeviceControl's q and b tables (what its captured steps read at replay): link_busy
    zeroes both, admit(False) (a kept step on a cache under the joins' line: runtime.py) b
    only; each gives back only what the other does not hold off."""
    from freetoken.experts.captured.control import DeviceControl
    control = DeviceControl.__new__(DeviceControl)  # the tables' part alone
    q, b = torch.tensor([0, 1, 2]), torch.tensor([0, 1, 1])
    control.books = SimpleNamespace(qtab=q.clone(), btab=b.clone())
    control._tables, control._busy, control._admit = None, False, True

    def tables():
        return control.books.qtab.tolist(), control.books.btab.tolist()
    control.link_busy(False)
    assert tables() == ([0, 1, 2], [0, 1, 1]) and control._tables is None  # nothing changed
    control.link_busy(True)
    assert tables() == ([0, 0, 0], [0, 0, 0])
    control.admit(False)
    control.link_busy(False)
    assert tables() == ([0, 1, 2], [0, 0, 0])  # fills back, admissions still off
    control.link_busy(True)
    control.admit(True)
    assert tables() == ([0, 0, 0], [0, 0, 0])  # still beside a prefill
    control.link_busy(False)
    assert tables() == ([0, 1, 2], [0, 1, 1])
