"""freetoken: edge-native Mixture-of-Experts inference (GPU expert cache + CPU experts)."""
