"""dispatch/: the Python dispatcher, the compiled dispatch front, and the catalogue of
errors that bad inputs raise.
"""
