"""The ground floor: user errors, how zerofit speaks, file hashing, reported writes, the modes of written
files, data-file suffixes, the run directory's file names, the one precision table and hiding unloaded optional
libraries. Imports nothing else of zerofit."""
