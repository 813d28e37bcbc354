"""Hydra configs of the training app (a package so Hydra finds them once installed)."""
