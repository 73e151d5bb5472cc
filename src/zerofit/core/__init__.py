"""The ground floor: user errors, how zerofit speaks, file hashing, reported writes, the modes of written
files, data-file suffixes, the run directory's file names and the one precision table. Imports nothing else of zerofit."""
