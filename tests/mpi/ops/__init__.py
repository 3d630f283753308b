"""ops/: every op on DTensors against numpy (the op table, chains, indexing, vocab-parallel
cross entropy, autograd) and the program fuzzer.
"""
