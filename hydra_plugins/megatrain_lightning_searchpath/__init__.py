"""Hydra plugin of megatrain_lightning: its configs on every Hydra app's search path."""
