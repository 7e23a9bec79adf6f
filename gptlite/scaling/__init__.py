"""Compute-optimal recipes from scaling laws measured on the user's data and machine: the sweep that measures them
(`python -m gptlite.scaling`, gptlite.scaling.sweep), the fits and where they are kept (gptlite.scaling.laws), the
recipe family and the budget it is given (gptlite.scaling.recipe), and `train.py --budget=...`'s derivation
(gptlite.scaling.derive). docs/scaling.md has the laws measured for this project."""
