"""Where runs execute: local engine slots now; the interface leaves room for a cluster."""
