"""Internal package (a layer; its public names reach users through ``dtensor``): the
dispatcher (the Python path with its propagation cache), the entry points built once from
the op table (methods, operators, public functions) and the compiled front's glue."""
