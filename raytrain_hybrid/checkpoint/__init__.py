"""Sharded DCP checkpoints: save/load under any layout (state), the driver's checks (manifest),
the safe metadata reader (reader), and Hugging Face export (export)."""
