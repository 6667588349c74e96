"""Layer trace: what a run records (recorder, records, stats, options, events), writes (sinks) and reads back (reader), with its schema."""
