"""RL losses and the jitted train step."""
