"""Row split of a lone CPU miss in a GPU-controlled decode step (device_step.py), opt-in and not
yet measured: FREETOKEN_SPLIT_ROWS=r (or auto).

In a layer step whose one miss runs on the CPU and is admitted (m = 1, q = 0, b >= 1), the plan
kernel also gives that expert's rows [0, r) to the device (device_plan.py). They are gathered
from the pinned bank into the admission's slot on the step's own stream, before the layer's
admissions start beside it (first: zero_copy.gather_rows, a full grid, on the critical path)
and computed there (triton_experts' limits), while the CPU computes rows [r, I) (the mailbox's
lo, cython/serve.h). The expert's admission copies only rows [r, I) into that slot, on the side
stream by looping programs like the other admissions (rest; the plan leaves it out of the
whole-slot list). The books are the same as without the split.

The aim: a lone miss in max(r/I of a fill, (1 - r/I) of a CPU job) instead of a whole CPU job;
auto takes the r that evens the two, the paper's q* = m P / (P + C) for the rows of one expert.
"""
import os

from ..errors import ConfigError
from . import zero_copy

ALIGN = 16  # rows: auto rounds to it; r and I multiples of it keep 16-byte loads (triton_experts)


def rows_setting(experts, admits: bool, bw=None) -> int:
    """r from FREETOKEN_SPLIT_ROWS: 0 (the default) no row split; r > 0; auto: I * P / (P + C)
    with the split's concurrent bandwidths (bw), rounded to a multiple of ALIGN. It needs
    admissions and the Triton device experts, and r below every layer's expert hidden size."""
    text = os.environ.get("FREETOKEN_SPLIT_ROWS", "0")
    inter = min(layout[-1] for layout in experts.layouts.values())
    if text == "auto":
        if bw is None:
            raise ConfigError("FREETOKEN_SPLIT_ROWS=auto needs the split's bandwidths; give a "
                              "row count instead")
        rows = min(max(ALIGN, round(inter * bw.P / (bw.P + bw.C) / ALIGN) * ALIGN), inter - 1)
    elif text.isdigit():
        rows = int(text)
    else:
        raise ConfigError(f"FREETOKEN_SPLIT_ROWS={text!r}: use 0 (no split), a row count r > 0 "
                          f"or auto (r from the fill and CPU bandwidths)")
    if not rows:
        return 0
    if not admits:
        raise ConfigError("FREETOKEN_SPLIT_ROWS splits lone misses that are admitted into the "
                          "cache: it needs admissions (hybrid's default, or --fill-behind 1)")
    if not getattr(experts, "use_triton", False):
        raise ConfigError("FREETOKEN_SPLIT_ROWS needs the Triton device experts (unset "
                          "FREETOKEN_DEVICE_EXPERTS=torch)")
    if rows >= inter:
        raise ConfigError(f"FREETOKEN_SPLIT_ROWS={rows}: use fewer rows than the experts' "
                          f"{inter} intermediate rows")
    return rows


class RowSplit:
    """The split's copies for DeviceControl: the layers' banks and the pool in the bank dtype,
    made once per layer."""

    def __init__(self, runtime, experts, rows: int, admit_programs):
        self.rt, self.experts, self.rows = runtime, experts, rows
        self.admit_programs = admit_programs
        self.views = {}  # layer -> (its bank, the pool, in the bank dtype; the layout)

    def multiple(self, inter: int) -> int:
        """What every limit of a layer with expert hidden size `inter` is a multiple of."""
        return ALIGN if self.rows % ALIGN == 0 and inter % ALIGN == 0 else 1

    def first(self, layer, src_idx, dst_idx) -> None:
        """Rows [0, r) by a full grid, on the current stream (the step's critical path)."""
        src, typed, layout = self._views(layer)
        zero_copy.gather_rows(src, typed, src_idx, dst_idx, layout, self.rows)

    def rest(self, layer, src_idx, dst_idx) -> None:
        """Rows [r, I) by the admissions' looping programs, on the current (side) stream."""
        src, typed, layout = self._views(layer)
        zero_copy.gather_rows(src, typed, src_idx, dst_idx, layout, layout[1][0],
                              start=self.rows, programs=self.admit_programs)

    def preload(self, none) -> None:
        """Both copies' kernels for every layer now, moving nothing (a fill list of -1): loaded
        lazily behind a layer's wait for the host they could deadlock (device_step.py)."""
        for layer in self.rt.infos:
            self.first(layer, none, none.clamp(min=0))
            self.rest(layer, none, none.clamp(min=0))

    def _views(self, layer):
        views = self.views.get(layer)
        if views is None:
            info = self.rt.infos[layer]
            D = self.experts.layouts[layer][2][3]  # gate's span: (offset, bytes, I, D)
            typed, layout = self.experts.triton_view(layer, D)
            host = zero_copy.host_typed(self.rt.host[layer], info.num_experts, info.slot_stride,
                                        typed.dtype)
            views = self.views[layer] = (host, typed, layout)
        return views
