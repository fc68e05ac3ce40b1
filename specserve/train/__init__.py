"""Training: the reference model family and drafter heads for any local target."""
