"""Model definitions: shared layers, the generic MoE block, one file per family."""
