"""Glue between dmuon and training frameworks; each submodule imports its framework on demand."""
