"""Prefill's expert side: per MoE layer of a long prompt, stream the whole expert layer over PCIe
(stream.py) or take the slot path (choice.py decides from the misses and the measured rates);
path.py runs the forward's layers through either. A streamed layer never changes the cache."""
