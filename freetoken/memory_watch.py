"""The free-memory trigger of the elastic expert cache (MemoryWatch) and the record of every
resize (Resize, one log line each). Between scheduler steps, at most every
Tuning.memory_watch_ms, a probe says how many bytes the device still has for the engine; under the memory
plan's margin the expert cache gives back what is missing plus a step of slack, and when memory
returns it grows back toward its target (the planned size, or the size last asked for, less
the slots lent to the KV pool: kv_grow.py). Owns when and by how much; the resize itself is
Engine.resize_expert_cache.

    free < margin               -> shrink by margin - free + slack   (whole slots, at most to 0)
    free > margin + 2 x slack   -> grow by free - margin - slack     (whole slots, at most to the
                                   target, and to what the plan's budget leaves the cache)
    otherwise                   -> nothing: after either resize free sits at margin + slack, in
                                   the dead band between the two, so a resize never undoes itself
    slack = min(margin / 4, target / 8), at least one slot

The check's cost: docs/MEASUREMENTS.md#memory-watch.
"""
import logging
import math
import time
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from . import host_memory
from .errors import ConfigError
from .memory_plan import GB

log = logging.getLogger("freetoken.memory")

# who resized: LLM/Engine call, the server's route, the watch, the KV pool lending (kv_grow.py)
TRIGGERS = ("api", "admin", "memory", "kv")


@dataclass(frozen=True)
class Resize:
    """One resize of the expert cache: slots before and after, why (trigger: one of TRIGGERS,
    reason: words for the log), and the pause it took between two steps."""
    old_slots: int
    new_slots: int
    slot_bytes: int
    trigger: str
    reason: str
    pause_s: float

    def line(self) -> str:
        why = f"{self.trigger}: {self.reason}" if self.reason else self.trigger
        return (f"expert cache {self.old_slots * self.slot_bytes / GB:.2f} GB -> "
                f"{self.new_slots * self.slot_bytes / GB:.2f} GB ({self.old_slots} -> "
                f"{self.new_slots} slots; {why}), pause {self.pause_s * 1e3:.1f} ms")

    def as_dict(self) -> dict:
        return {"old_slots": self.old_slots, "new_slots": self.new_slots,
                "slot_bytes": self.slot_bytes, "trigger": self.trigger, "reason": self.reason,
                "pause_ms": round(self.pause_s * 1e3, 3)}


def device_free(device, margin: int = 0) -> int:
    """Bytes the device still has now. cuda: the driver's free memory; when that is under
    `margin` and torch's allocator holds blocks unused, they go back to the driver first
    (empty_cache): another program can take only what the driver has, and a shrink must not
    be made for memory this process merely keeps. cpu (the slot pool lives in host RAM): the
    host's available memory (host_memory.host_available)."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        if free < margin and torch.cuda.memory_reserved(device) > torch.cuda.memory_allocated(device):
            torch.cuda.empty_cache()
            free, _ = torch.cuda.mem_get_info(device)
        return free
    return host_memory.host_available()[0]


class MemoryWatch:
    """Watches `engine` (an Engine: memory_plan, resize_expert_cache, device). after_step() is
    what Engine.step calls: a clock read, and a check() once interval_s has passed since the
    last one. probe: () -> free bytes (device_free by default; tests replace it to simulate
    another program taking memory). target_slots: what the cache grows back to (the engine sets
    it when a resize is asked for). A resize the engine refuses (ConfigError) turns the watch
    off with a warning; `off` then says why."""

    def __init__(self, engine, interval_s: float, probe: Optional[Callable[[], int]] = None):
        self.engine, self.interval_s = engine, interval_s
        self.probe = probe or (lambda: device_free(engine.device, engine.memory_plan.margin))
        self.target_slots = engine.memory_plan.num_slots
        self.next_check = 0.0
        self.num_checks = 0
        self.off = ""

    def slack(self) -> int:
        """Bytes beyond the deficit a shrink gives up, and the dead band's width."""
        plan = self.engine.memory_plan
        step = min(plan.margin // 4, self.target_slots * plan.slot_bytes // 8)
        return max(plan.slot_bytes, step)

    def after_step(self) -> None:
        if self.off or not (self.target_slots or self.engine.memory_plan.num_slots):
            return  # (no cache to watch: the plain CPU engine, until a resize asks for one)
        now = time.perf_counter()
        if now < self.next_check:
            return
        self.next_check = now + self.interval_s
        self.check()

    def check(self) -> Optional[Resize]:
        """Probes now; shrinks or grows the cache as the module docstring says. Returns the
        resize made, or None."""
        self.num_checks += 1
        plan = self.engine.memory_plan
        free, margin, stride = self.probe(), plan.margin, plan.slot_bytes
        slots, slack = plan.num_slots, self.slack()
        # never past what the plan's budget leaves the cache: a resize refused there would turn
        # the watch off
        target = min(self.target_slots, (plan.budget - plan.context_part) // stride)
        if free < margin and slots > 0:
            new = max(0, slots - math.ceil((margin - free + slack) / stride))
            reason = f"free {free / GB:.2f} GB < margin {margin / GB:.2f} GB"
        elif free > margin + 2 * slack and slots < target:
            new = min(target, slots + (free - margin - slack) // stride)
            reason = f"free {free / GB:.2f} GB, back above the margin"
        else:
            return None
        try:
            # (half a slot over: the engine floors GB to whole slots)
            return self.engine.resize_expert_cache((new + 0.5) * stride / GB, trigger="memory",
                                                   reason=reason)
        except ConfigError as e:
            self.off = str(e)
            log.warning("memory watch off: the expert cache cannot be resized here (%s)", e)
            return None
