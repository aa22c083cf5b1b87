"""The graph core: a training step as one fx graph (capture), marks, aliasing facts, the rewrite's rules and
policies, the memory planner."""
