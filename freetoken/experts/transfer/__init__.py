"""Moving expert bytes from the host banks into cache slots: planned fills and admissions as
copies on a copy stream (fills.py, through the driver API: cuda_copy.py), or as a Triton gather
reading the pinned banks inside a captured step (zero_copy.py). No decisions: the plan makes them."""
