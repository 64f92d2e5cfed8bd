"""The target value that no loss or metric counts (padding, prompts, positions outside the loss mask).

A foundation of its own so that losses and metrics, below the datasets, can name it without importing them.
"""

IGNORED = -100
