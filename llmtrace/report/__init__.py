"""Layer report: the HTML report page drawn from a trace's events."""
