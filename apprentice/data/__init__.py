"""Tables: the trajectory and problem schema, atomic Parquet I/O, content identity of problems."""
