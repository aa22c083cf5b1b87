"""Fast planning: a plan-only step recorded without proxies, and stamped from a few layers' trace."""
