"""The Table-1-like text `freetoken profile` prints for a profile dict (profile.py measures it).
Pure formatting: reads the dict's keys, prints absent paths as such, touches nothing else.
"""


def format_profile(r: dict) -> str:
    """The Table-1-like text of a profile dict."""
    def gb(v):
        return "absent (no GPU)" if v is None else f"{v:7.2f} GB/s"
    s = r["shape"]
    lines = [f"freetoken profile: {r['cpu']} | GPU {r['gpu'] or 'none'} | pool {r['threads']} threads, {r['isa']}",
             f"expert {s['name']}: D={s['hidden']} I={s['expert_hidden']} {s['dtype']}"
             f"{'' if s.get('quant', 'none') == 'none' else ' ' + s['quant'] + ' experts'} top-{s['top_k']}, "
             f"slot {r['slot_bytes'] / 1e6:.1f} MB, layer {r['layer_bytes'] / 1e9:.2f} GB, "
             f"working set {r['working_set_bytes'] / 1e9:.2f} GB (LLC {r['llc_bytes'] >> 20} MiB)",
             "",
             f"  {'path':<44} {'alone':>15} {'concurrent':>15}",
             f"  {'B_P  pinned H2D copy, one slot':<44} {gb(r['B_P_slot']):>15} {'':>15}",
             f"  {'B_P  pinned H2D copy, whole layer':<44} {gb(r['B_P']):>15} {gb(r['P']) if r['gpu'] else '':>15}",
             *([f"  {'B_P  zero-copy gather kernel, 8 slots':<44} {gb(r['B_Z']):>15} {gb(r['P_zc']):>15}",
                f"  {'B_H  CPU expert kernel beside the gather':<44} {'':>15} {gb(r['C_zc']):>15}"]
               if r.get("P_zc") else []),
             f"  {'B_H  CPU expert kernel, batch 1':<44} {gb(r['B_H']):>15} {gb(r['C']) if r['gpu'] else '':>15}",
             f"  {'host STREAM-like read':<44} {gb(r['stream_read']):>15} {'':>15}",
             *([f"  {'F    CPU experts, 32 tokens each (prefill)':<44} "
                f"{r['cpu_gflops']:>7.1f} GFLOP/s {'':>15}"] if r.get("cpu_gflops") else []), ""]
    if r["gpu"]:
        lines += [f"  q*/m = P/(P+C) = {r['q_frac']:.3f}  (P, C measured concurrently; sum {r['P'] + r['C']:.1f} GB/s)",
                  f"  paper's q*/m = B_P/B_H = {r['paper_q_frac']:.3f}"]
        if r.get("P_zc"):
            lines.append(f"  zero-copy fills (captured decode steps use these): q*/m = "
                         f"{r['q_frac_zc']:.3f}  (sum {r['P_zc'] + r['C_zc']:.1f} GB/s)")
    else:
        lines += ["  no GPU: B_P absent, policy CPU-only (q* = 0)"]
    if r.get("remeasured"):
        lines.append(f"  C {' and '.join(r['remeasured'])} re-measured once "
                     "(inconsistent with B_H alone)")
    if r.get("inconsistent"):
        lines.append(f"  INCONSISTENT after the re-measure: {r['inconsistent']}")
    if r.get("path"):
        lines.append(f"  saved to {r['path']}")
    return "\n".join(lines)
