"""The expert side of a decode step captured in a CUDA graph (the engine side: freetoken/graphs.py).
graph_step.py captures and replays it; control.py is GPU-resident control (each layer planned on
the GPU by device_plan.py, the host serving the CPU routes through handshake.py's mailboxes,
admissions.py copying CPU-run misses in behind the step); cut_step.py is the host-planned form
where that control cannot run."""
