"""The dispatcher: the Python path with its propagation cache, the compiled front's glue,
and the installation of methods, operators and public functions from the op table."""
