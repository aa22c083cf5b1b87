"""Training: data, the gate, the step built once per shape (the Planner), the walk, the trainer, ranks, checkpoints."""
