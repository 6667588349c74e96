"""Layer trace: what a run records (recorder, records, stats, options, events), writes (writers) and reads back (reader), with its schema."""
