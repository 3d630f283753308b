"""redistribute/: the planner and cost model, its caches, the collectives' debug hooks,
node-shared segments and the watchdog's files.
"""
