"""ops/: the op table, the strategy validator over every op, and autograd's formulas."""
