"""Configuration, limits, error kinds and the registry of the models served."""
