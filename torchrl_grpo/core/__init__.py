"""The bottom layer: the keys of a step's batch, errors as one line, the console and log file, the allocator
settings, checkpoint files written atomically, writes a full disk cannot leave half done, secrets masked, an
event loop for async clients, the cache folder. Imports nothing of the package above it."""
