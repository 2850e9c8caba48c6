"""The expert tier: host banks, the device expert cache, the miss-split policy, CPU executor, the MoE layer's plan/run/combine."""
