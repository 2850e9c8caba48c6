"""Device experts. Two jobs, each with a Triton path on cuda and a torch path that is the cpu
device's path and the tests' oracle: a captured step's fixed routes read in place from their
slots (gathered.py; on cuda triton_experts.py), and many tokens' experts as two grouped
matmuls (grouped_experts.py; elsewhere ffn.run_expert_runs's per-expert matmuls). Quantized
slots (quant_blocks.py) have the Triton paths alone: ftw.quant's dequantize is their oracle."""
