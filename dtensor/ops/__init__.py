"""The op table: one record per op."""
