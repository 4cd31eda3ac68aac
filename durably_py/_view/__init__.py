"""What a person reads: the live view of a run and a log record as one line."""
