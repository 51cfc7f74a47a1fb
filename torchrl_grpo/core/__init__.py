"""The bottom layer: errors as one line, the console and log file, the allocator settings, checkpoint files
written atomically, the cache folder. Imports nothing of the package above it."""
