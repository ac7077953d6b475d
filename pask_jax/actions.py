"""KV actions (docs/DESIGN.md "Conventions"): what happens to a token's KV in a layer group.

int8 codes ordered by protection, so "max" protects most: **R**eleased < kept **L**ow (INT4) <
kept **H**igh (BF16).
"""
R, L, H = 0, 1, 2
NAMES = ("R", "L", "H")
