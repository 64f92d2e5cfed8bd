"""splitlab: split learning and split federated learning, exact and measurable."""

__version__ = "0.1.0"
