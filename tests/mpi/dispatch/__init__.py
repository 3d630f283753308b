"""dispatch/: the compiled and Python paths agree, compiled redistributes, escape hatches,
and the errors bad inputs raise on every rank.
"""
