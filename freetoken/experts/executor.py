"""The CPU executor: runs a layer's CPU routes from the host banks while the device works.
submit(...) returns at once; handle.wait() returns the fp32 partial [T, D]. Two backends behind
one facade: the Cython pool of freetoken.kernels (docs/INTERFACES.md section 5) and a torch
path, kept as the reference. It does not decide which routes run here (that is the plan's job).

Threads (the rule, enforced here, in KernelCpuExecutor): while the kernel pool is in use, torch
runs single-threaded (torch.set_num_threads(1)), on cuda and on cpu alike. The pool owns the
cores (one pinned worker per physical core); the expert bytes, the bulk of a step's memory
traffic, are read by it. The ops left to torch on the driver thread (norms, attention, router,
sampling) are small; an OpenMP team for each of them would wait on a worker preempted by the
pool, the prefill copy thread or another process (measured on 2 cores: a 33-token prefill of a
48-layer model took 12.9 s with 2 torch threads, 1.4 s with 1). With the torch executor (no
kernels) torch keeps its default threads: it then does all the work.
On CPU-only runs the pool's workers cover every core, so nobody may spin: not the workers after
a job (the driver needs a core for the next layer's torch ops) nor the driver waiting for one
(a worker needs it). The pool is then made with spin_us=0 (measured on 2 cores, one decode
job of 4 experts: submit + wait 260-320 us with the default 100 us spin, 46-59 us without).

Shape legend: T tokens, R routes given to the CPU, D hidden.
"""
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import torch

from ..config import env
from ..errors import ConfigError
from .bank import bank_tensor, expert_slot, slot_views
from ..kernel_args import SILU
from .ffn import ExpertWeights, expert_ffn

BACKENDS = ("auto", "torch", "kernels")


class _Done:
    """A handle whose result is already there (no routes)."""

    def __init__(self, out):
        self.out = out

    def wait(self):
        return self.out


class _Future:
    def __init__(self, future):
        self.future = future

    def wait(self):
        return self.future.result()


class TorchCpuExecutor:
    """Torch path: one worker thread (torch ops release the GIL), fp32 math on weights widened
    from the bank dtype, routes grouped by expert."""

    name = "torch"

    def __init__(self, banks: dict, act=SILU):
        self.banks = banks
        self.act = act  # kernel_args.ExpertAct
        self.host = {layer: bank_tensor(b) for layer, b in banks.items()}
        self.pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ft-cpu-experts")

    def submit(self, layer: int, x, token_ids, expert_ids, weights, out=None):
        """x fp32 [T, D] CPU; token_ids, expert_ids int [R]; weights fp32 [R] -> handle.
        out: fp32 [T, D] to add into (zeroed by the caller), or None for a fresh one."""
        if out is None:
            out = torch.zeros(x.shape, dtype=torch.float32)  # [T, D]
        if len(token_ids) == 0:
            return _Done(out)
        return _Future(self.pool.submit(self._run, layer, x, token_ids, expert_ids, weights, out))

    def _run(self, layer, x, token_ids, expert_ids, weights, out):
        # inference mode is per thread: `out` may be an inference tensor made by the driver
        with torch.inference_mode():
            return self._run_routes(layer, x, token_ids, expert_ids, weights, out)

    def _run_routes(self, layer, x, token_ids, expert_ids, weights, out):
        info = self.banks[layer].info
        expert_ids = torch.as_tensor(expert_ids, dtype=torch.int64)
        token_ids = torch.as_tensor(token_ids, dtype=torch.int64)
        weights = torch.as_tensor(weights, dtype=torch.float32)
        order = torch.argsort(expert_ids, stable=True)  # [R]
        experts, counts = torch.unique_consecutive(expert_ids[order], return_counts=True)
        start = 0
        for e, n in zip(experts.tolist(), counts.tolist()):
            rows = order[start:start + n]
            tok = token_ids[rows]
            w = ExpertWeights.of(slot_views(expert_slot(self.host[layer], info, e), info))
            y = expert_ffn(x.index_select(0, tok), w.to(dtype=torch.float32), self.act)  # [n, D]
            out.index_add_(0, tok, y * weights[rows, None])
            start += n
        return out

    def abandon(self):
        """(KernelCpuExecutor.abandon's; the worker queue serves any number of callers.)"""

    def close(self):
        self.pool.shutdown(wait=True)


class KernelCpuExecutor:
    """freetoken.kernels.CpuExpertPool: persistent pinned native workers, GIL released."""

    name = "kernels"

    def __init__(self, banks: dict, num_threads=None, has_gpu=True, act=SILU):
        from .. import kernels
        self.banks = banks
        self.act = act  # kernel_args.ExpertAct
        self.pool = _get_pool(kernels, num_threads or kernels.default_num_threads(has_gpu), has_gpu)
        self.layouts = {layer: kernels.layout_from_bank_info(b.info) for layer, b in banks.items()}
        self.slot_layouts = {}  # (layer, slot_stride) -> layout of a slot pool (submit_slots)
        torch.set_num_threads(1)  # the thread rule: see the module docstring

    def submit(self, layer: int, x, token_ids, expert_ids, weights, out=None):
        """out: fp32 [T, D] to add into (zeroed by the caller), or None for a fresh one."""
        return self._submit(x, self.banks[layer].data, self.layouts[layer], token_ids,
                            expert_ids, weights, out)

    def submit_slots(self, layer: int, x, storage, token_ids, slot_ids, weights, out=None):
        """Like submit, but the experts are the slots of `storage` (uint8 [C, stride], a cpu
        device tier's slot pool or a streamed layer buffer) holding this layer's experts:
        slot_ids instead of expert ids."""
        stride = int(storage.shape[1])
        layout = self.slot_layouts.get((layer, stride))
        if layout is None:
            layout = self.slot_layouts[layer, stride] = replace(self.layouts[layer],
                                                                slot_stride=stride)
        return self._submit(x, storage.reshape(-1), layout, token_ids, slot_ids, weights, out)

    def serve_table(self, layers, trace: bool = False, skip_jobs: bool = False):
        """layers: [(layer, device_step.Mailbox)] in step order -> the pool's serve table
        (trace, skip_jobs: kernels.CpuExpertPool.serve_table's diagnostics)."""
        return self.pool.serve_table([(self.banks[layer].data, self.layouts[layer], self.act, box)
                                      for layer, box in layers], trace, skip_jobs)

    def serve(self, table) -> None:
        """Serve one GPU-controlled decode step (kernels.CpuExpertPool.serve)."""
        self.pool.serve(table)

    def _submit(self, x, bank, layout, token_ids, expert_ids, weights, out):
        if out is None:
            out = torch.zeros(x.shape, dtype=torch.float32)  # [T, D]
        if len(token_ids) == 0:
            return _Done(out)
        return self.pool.submit(
            x.contiguous(), bank, layout, np.ascontiguousarray(token_ids, dtype=np.int32),
            np.ascontiguousarray(expert_ids, dtype=np.int32),
            np.ascontiguousarray(weights, dtype=np.float32), out, self.act)

    def abandon(self):
        """A thread that ends on an error lets the pool go if it holds it (a job submitted and
        not waited for): kernels.CpuExpertPool.abandon. The pool runs one job at a time and
        serves several threads, each job holding it from submit to wait."""
        self.pool.abandon()

    def close(self):
        pass


# With a GPU the workers spin this long after a job before parking: a decode step gives the
# pool one job per MoE layer, and between two jobs the GPU runs the next attention block and the
# host plans (a fraction of a millisecond); a parked pool costs a futex wake of every worker
# per layer. The pool leaves one core to the driver thread, so the spinning takes no one's core.
GPU_SPIN_US = 2000


def _get_pool(kernels, num_threads: int, has_gpu: bool):
    """The process-wide kernel pool; without a GPU one that never spins (module docstring)."""
    pool = kernels.get_pool(num_threads, spin_us=GPU_SPIN_US if has_gpu else 0)
    if has_gpu:
        use_gpu_run_tuning(pool)
    return pool


def use_gpu_run_tuning(pool) -> None:
    """With a GPU the driver thread does not help the pool with its items (help=0, unless
    FREETOKEN_KERNEL_TUNE names help): it plans the next layer, and items it ran emptied its
    caches first (it measured slower helping). Software prefetch stays on: it
    keeps its gain beside the PCIe copies while no thread spins in a CUDA wait on the pool's
    cores. Work items of 96 KB of weights (unless the variable names item_kb): a decode job is
    a few experts, and the last items' imbalance is its tail. The runs:
    docs/MEASUREMENTS.md#cpu-kernel-on-a-gpu-host. `freetoken profile` measures this way."""
    from .. import kernels
    tune = env(kernels.TUNE_ENV)
    pool.tuning = kernels.tuning_from_env()  # the variable now: the shared pool may be older
    if "help" not in tune:
        pool.tuning = replace(pool.tuning, help=0)
    if "item_kb" not in tune:
        pool.tuning = replace(pool.tuning, item_kb=GPU_ITEM_KB)


GPU_ITEM_KB = 96


def create_executor(banks: dict, backend: str = "auto", num_threads=None, has_gpu=True, act=SILU):
    """backend (config.Tuning.cpu_experts): auto (the kernels when freetoken.kernels imports,
    else torch) | torch (the reference: tests) | kernels (an error when not built). act: the
    experts' kernel_args.ExpertAct."""
    if backend not in BACKENDS:
        raise ConfigError(f"the CPU expert backend must be one of {', '.join(BACKENDS)}, "
                          f"not {backend!r}")
    if backend in ("auto", "kernels"):
        try:
            return KernelCpuExecutor(banks, num_threads, has_gpu, act)
        except ImportError as e:
            if backend == "kernels":
                raise ConfigError(f"the CPU expert kernels are not built ({e}); rebuild with "
                                  "`pip install -e .` or use the torch backend") from None
    return TorchCpuExecutor(banks, act)
