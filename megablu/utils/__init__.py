"""Small helpers with one home each: files (sha256, fsync, atomic writes), ranks (rank-0 decides,
the others receive), the device a setting means, Liger's chunk sizing and the sliding-window blocks
(torch-free, for the planner)."""
