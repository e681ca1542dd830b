"""Backends turn a cell's steps into code: `reference` (numpy) and, later, `cpu` (LLVM)."""
