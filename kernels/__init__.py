"""Finished code every stage stands on: reference, masks, runtime, loader, tolerance, plots."""
