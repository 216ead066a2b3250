"""Reinforcement learning through the rollout server (`preft rollout-serve`): runs whose results docs cite."""
