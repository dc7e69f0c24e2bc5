"""HTTP routers, one per resource: generation, models, health, metrics."""
