"""Regression tests for dtype and numerics bugs that shipped in popular QLoRA stacks (see docs/numerics.md)."""
