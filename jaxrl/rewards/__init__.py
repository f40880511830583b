"""Reward models and generative judges: rewards computed by a model instead of a rule.

model.py   the scalar reward model: a score head on a decoder, the Bradley-Terry loss
pairs.py   preference pairs: JSONL files and synthetic generators, tokenised
train.py   `jaxrl reward-model train`: the training loop, checkpoints, held-out accuracy
scorer.py  a trained reward model as a reward function of an RL run (one jitted forward per step)
judge.py   a generative judge on the slot engine: template, verdict parser, reward
"""
