"""User-facing tools: verify, audit, bench, roofline."""
